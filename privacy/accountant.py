"""Client-level privacy accounting for the subsampled Gaussian mechanism, and the registry.

Each round is one release of the sum of the sampled clients' clipped updates with Gaussian noise
of std σC (noise multiplier σ relative to the L2 bound C on one client's update). Two sampling
assumptions, each with the adjacency under which its amplification theorem holds:

- ``poisson``: each client takes part independently with probability q; neighbouring datasets
  differ by adding or removing one client, so the sum's sensitivity is C.
  ``RdpAccountant`` uses Opacus's RDP of the Poisson-subsampled Gaussian (Mironov et al. 2019;
  ``privacy.rdp``, the same computation without importing Opacus and torch);
  ``PldAccountant`` (privacy.pld) and ``PrvAccountant`` (privacy.prv) are numerically tight.
- ``without_replacement``: a cohort of fixed size m = qN drawn without replacement; neighbouring
  datasets differ by *replacing* one client, so the sum's sensitivity is 2C (one clipped update
  swapped for another) and the base Gaussian RDP is ε(α) = α·(2C)²/(2σ²C²) = 2α/σ².
  ``WorRdpAccountant`` amplifies it with Wang, Balle & Kasiviswanathan 2019, Thm 9
  (privacy.subsampling_wor) at the integer orders 2..256. The ε is for replace-one adjacency,
  which is weaker per unit of ε than add/remove (add/remove ε-DP implies replace-one 2ε-DP), so
  it is typically about twice the Poisson number: that is the honest price of accounting a
  fixed-size cohort as what it is. A fixed cohort accounted as Poisson (as DP-FedSAM does)
  has no ε here (``ExperimentConfig.sampling_mismatch``); the paper configs run Poisson cohorts.

Both RDP accountants compose heterogeneous rounds by summing per-round RDP curves (σ and q may
change from round to round), cache the curve per distinct (σ, q), and convert to (ε, δ) with
Balle et al. 2020, Thm 21 (``privacy.rdp.epsilon_from_rdp``, Opacus's ``get_privacy_spent``).
``ClassicRdpAccountant`` (``rdp_classic``, Poisson) converts the same curve with Mironov 2017's
Prop. 3, ε = min_α ε(α) + log(1/δ)/(α − 1), the moments accountant's conversion: looser, and
what papers of that lineage report (the BLUR+LUS spec's main σ column).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from privacy.rdp import ORDERS, epsilon_from_rdp, round_rdp, validated
from privacy.subsampling_wor import gaussian_rdp, rdp_subsampled_without_replacement

WOR_ORDERS = tuple(range(2, 257))


@lru_cache(maxsize=256)
def _round_rdp_wor(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP of one replace-one release (sensitivity 2C) on a without-replacement sample."""
    orders = np.asarray(WOR_ORDERS)
    if noise_multiplier == 0.0:
        return np.full(orders.size, 0.0 if sample_rate == 0.0 else np.inf)
    base = gaussian_rdp(noise_multiplier / 2.0, orders)
    return rdp_subsampled_without_replacement(base, orders, sample_rate)


class RdpAccountant:
    """Poisson sampling, add/remove-one adjacency, Opacus's RDP at Opacus's default orders."""

    name = "rdp"
    sampling = "poisson"
    orders = ORDERS
    _curve = staticmethod(round_rdp)

    def __init__(self, fallback_to_rdp: bool = False) -> None:
        del fallback_to_rdp  # already RDP; accepted so every accountant takes the same options
        self.history: list[tuple[float, float, int]] = []  # (σ, q, rounds), merged when equal
        self._rdp = np.zeros(len(self.orders))

    def step(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> None:
        """Compose ``rounds`` releases of the q-subsampled Gaussian with multiplier σ."""
        key = append_rounds(self.history, noise_multiplier, sample_rate, rounds)
        self._rdp = self._rdp + rounds * self._curve(*key)

    @property
    def rounds(self) -> int:
        return sum(rounds for _, _, rounds in self.history)

    def _epsilon(self, rdp: np.ndarray, delta: float) -> float:
        return epsilon_from_rdp(self.orders, rdp, delta)

    def epsilon(self, delta: float) -> float:
        return self._epsilon(self._rdp, delta) if self.history else 0.0

    def produced_by(self, delta: float) -> str:
        """The accountant whose value ``epsilon(delta)`` is: always this one."""
        del delta  # RDP never refuses
        return self.name

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """ε if one more round were composed, without composing it."""
        sigma, q, _ = validated(noise_multiplier, sample_rate)
        return self._epsilon(self._rdp + self._curve(sigma, q), delta)

    def state_dict(self) -> dict:
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.__init__()
        for sigma, q, rounds in state["history"]:
            self.step(sigma, q, int(rounds))


def epsilon_from_rdp_classic(orders, rdp: np.ndarray, delta: float) -> float:
    """(ε, δ) from an RDP curve by Mironov 2017, Prop. 3: min over α of ε(α) + log(1/δ)/(α − 1)."""
    alphas = np.asarray(orders, dtype=np.float64)
    return float(np.min(np.asarray(rdp) + np.log(1.0 / delta) / (alphas - 1.0)))


class ClassicRdpAccountant(RdpAccountant):
    """``RdpAccountant``'s curve converted with the classic bound (the moments accountant's)."""

    name = "rdp_classic"

    def _epsilon(self, rdp: np.ndarray, delta: float) -> float:
        return epsilon_from_rdp_classic(self.orders, rdp, delta)


class WorRdpAccountant(RdpAccountant):
    """Fixed-size cohorts without replacement, replace-one adjacency (sensitivity 2C), Thm 9."""

    sampling = "without_replacement"
    orders = WOR_ORDERS
    _curve = staticmethod(_round_rdp_wor)


def rdp_of_history(sampling: str, history) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP curve) of a (σ, q, rounds) history under a sampling assumption: what
    ``RdpAccountant`` (Poisson) or ``WorRdpAccountant`` (without replacement) composes."""
    accountant = WorRdpAccountant() if sampling == "without_replacement" else RdpAccountant()
    for sigma, q, rounds in history:
        accountant.step(sigma, q, rounds)
    return np.asarray(accountant.orders, dtype=np.float64), accountant._rdp


ACCOUNTANTS = ("rdp", "pld", "prv", "rdp_classic")
SAMPLING_ASSUMPTIONS = ("poisson", "without_replacement")
ADJACENCY = {"poisson": "add/remove one client", "without_replacement": "replace one client"}


def assumption_for_sampler(sampler: str) -> str:
    """The sampling assumption that matches a cohort sampler (``fixed`` or ``poisson``)."""
    return "poisson" if sampler == "poisson" else "without_replacement"


def default_accountant(sampling: str) -> str:
    """The tightest reliable accountant for a sampling assumption (README: choosing one).

    Poisson: PLD. It is tight up to a pessimistic discretisation (≤0.02% above the exact ε for
    ε ≥ 0.5), and fast with caching; PRV is as tight but reports estimate + 0.01, needs a new
    grid for every ε and fails at large ε; RDP is 10-15% loose. Without replacement: RDP, the
    only one of the three with a without-replacement analysis.
    """
    return "pld" if sampling == "poisson" else "rdp"


def accountants_for(sampling: str) -> tuple[str, ...]:
    """The accountants with an analysis of a sampling assumption, in ``ACCOUNTANTS`` order.

    Poisson: all of them. Without replacement: rdp only (Wang et al. 2019, Thm 9).
    """
    if sampling not in SAMPLING_ASSUMPTIONS:
        raise ValueError(
            f"unknown sampling assumption {sampling!r}; known: {', '.join(SAMPLING_ASSUMPTIONS)}"
        )
    return ACCOUNTANTS if sampling == "poisson" else ("rdp",)


def accountant_class(name: str, sampling: str = "poisson") -> type:
    """The accountant class for a name (rdp|pld|prv|rdp_classic) and a sampling assumption."""
    if name not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {name!r}; known: {', '.join(ACCOUNTANTS)}")
    if name not in accountants_for(sampling):
        raise ValueError(
            f"the {name} accountant has no analysis of sampling without replacement; use "
            "accountant rdp (Wang et al. 2019), or account the cohort as Poisson"
        )
    if sampling == "without_replacement":
        return WorRdpAccountant
    if name == "pld":
        from privacy.pld import PldAccountant

        return PldAccountant
    if name == "prv":
        from privacy.prv import PrvAccountant

        return PrvAccountant
    if name == "rdp_classic":
        return ClassicRdpAccountant
    return RdpAccountant


def append_rounds(
    history: list[tuple[float, float, int]],
    noise_multiplier: float,
    sample_rate: float,
    rounds: int,
) -> tuple[float, float]:
    """Add ``rounds`` at (σ, q) to a (σ, q, rounds) history, merged into its last run when
    equal; returns the (σ, q) key (ValueError for values no accountant accepts)."""
    *key, rounds = validated(noise_multiplier, sample_rate, rounds)
    key = tuple(key)
    if history and history[-1][:2] == key:
        history[-1] = (*key, history[-1][2] + rounds)
    else:
        history.append((*key, rounds))
    return key
