"""Record-level (sample-level) ε of a run whose clients train with DP-SGD (DP-SCAFFOLD family).

What is released. Each round, a cohort of the M clients (rate l) runs K local DP-SGD steps;
each step's batch sum of per-record gradients clipped to C gets Gaussian noise κ·C·σ_g
(κ = 2 replace-one, 1 add/remove). Clients upload Δy_i (and Δc_i), post-processing of their
noisy steps.

Default threat model (``participation``): a server that sees **every upload** and knows which
clients were sampled; it then holds for anyone who sees less (a third party seeing x^T). A
record is protected by its own client's noise only: the other clients' noise is not counted,
because for K > 1 their gradients depend on their own noise histories and the server sees each
upload anyway. The record's client takes part in n ~ Binomial(T, l) rounds, independently of
the data; given n, the record's loss is that of n·K subsampled-Gaussian steps (multiplier σ_g,
record rate s = B/n_i, the worst client's). By joint convexity

    δ(ε) = Σ_n Binom(n; T, l)·δ_{nK}(ε),

exactly the hockey-stick divergence of the per-round mixture (1 − l)·δ₀ + l·PLD_K composed T
times (``privacy.sample_level``). Client sampling is *not* Poisson subsampling of the record:
removing a record does not remove its client.

Methods:

- ``pld`` (Poisson batches): ``SampleLevelPldAccountant`` at σ_g, add/remove or replace-one.
- ``rdp``: the same mixture in RDP, log((1 − l) + l·e^{(α−1)·K·ε_s(α)})/(α − 1), composed T
  times and converted with Balle et al. 2020, Thm 21. Poisson batches, add/remove:
  dp-accounting's subsampled-Gaussian RDP; fixed-size batches without replacement (``fresh``),
  replace-one: Wang, Balle & Kasiviswanathan 2019, Thm 27 (dp-accounting), σ_g relative to the
  replace sensitivity 2C (noise 2Cσ_g). The only method for fixed-size batches.
- ``paper``: DP-SCAFFOLD's own accountant (``TwoLevelSampleAccountant``), for reproducing its
  tables. It assumes the lM clients' noise adds up on the record (σ_e = σ_g·√(lM)) and amplifies
  by client sampling with Thm 9 at the client level; neither holds against the server, and its
  ε is a floor from l as σ_g → ∞ (spec 004 §3). Labelled with that assumption wherever shown.
- ``aggregate``: the tight PLD under the same aggregation assumption (σ_e, a third party who
  sees only x^T with K = 1); reported beside, never a run's ε. Each step is subsampled as the
  run's batches are (``aggregate_adjacency``): Poisson batches, the s-Poisson-subsampled
  Gaussian under the run's adjacency (add/remove: sensitivity C, noise Cσ_e; replace-one:
  dp-accounting's ``REPLACE_ONE`` pair, contributions ±C against noise 2Cσ_e); fixed-size
  batches without replacement, replace-one: the add/remove pair at σ_e (noise 2Cσ_e against
  the replace sensitivity 2C), both directions. Subsampling without replacement under
  replace-one is dominated by (s·P + (1 − s)·Q, Q), (P, Q) the base Gaussian's replace-one pair
  N(2C, ·), N(0, ·) (Zhu, Dong & Wang 2022, Thm 11), i.e. the remove direction of that PLD; a
  batch whose other records all sit where the replaced one does reaches its add direction too
  (``tests/test_sample_level_pld.py`` checks both against direct integration). Poisson's
  tighter ``REPLACE_ONE`` pair (the record absent contributes 0, between ±C) does not hold for
  fixed-size batches, where another record takes the replaced one's place.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

import numpy as np

from privacy.accountant import epsilon_from_rdp
from privacy.pld import MIN_DELTA
from privacy.sample_level import SampleLevelPldAccountant, _rdp_orders, _round_rdp
from privacy.subsampling_wor import TwoLevelSampleAccountant

METHODS = ("pld", "rdp", "paper", "aggregate")
ASSUMPTIONS = {
    "pld": "server sees every upload; own client's noise only; participation ~ Binomial(T, l)",
    "rdp": "server sees every upload; own client's noise only; participation ~ Binomial(T, l)",
    "paper": "DP-SCAFFOLD's accountant: the lM clients' noise summed on the record "
    "(σ_e = σ_g·√(lM)), client-level WOR amplification; a third party seeing x^T only",
    "aggregate": "the lM clients' noise summed on the record (σ_e = σ_g·√(lM)), each step "
    "subsampled as this run's batches are, under its adjacency; holds for K = 1 against a "
    "third party seeing x^T only",
}


def methods_for(batch_sampling: str, adjacency: str) -> tuple[str, ...]:
    """The methods with an analysis of these batches and this adjacency (first: the default)."""
    if batch_sampling == "poisson":
        own = ("pld", "rdp") if adjacency == "add_remove" else ("pld",)
    else:  # fixed-size batches without replacement: replace-one only
        own = ("rdp",) if adjacency == "replace_one" else ()
    return (*own, "paper", "aggregate") if own else ()


def aggregate_adjacency(batch_sampling: str, adjacency: str) -> str:
    """The adjacency of the s-Poisson-subsampled Gaussian PLD (``SampleLevelPldAccountant``) at
    σ_e that dominates one aggregate step: the run's own for Poisson batches; add/remove for
    fixed-size batches without replacement under replace-one (module docstring)."""
    return adjacency if batch_sampling == "poisson" else "add_remove"


@lru_cache(maxsize=32)
def _fresh_round_rdp(
    client_rate: float, data_rate: float, local_steps: int, noise_multiplier: float
) -> np.ndarray:
    """RDP of one round: K WOR-subsampled replace-one Gaussian steps, mixed over participation.

    The step is dp-accounting's ``SampledWithoutReplacementDpEvent`` (Wang, Balle &
    Kasiviswanathan 2019, Thm 27: the Gaussian-specific bound; their general Thm 9 has a floor
    as σ → ∞ that reads ε ≈ 11.7 at the paper's setting) with σ_g relative to the replace
    sensitivity 2C; s = B/n enters only as the ratio, given as an exact fraction.
    """
    # Imported here, not at module level: dp-accounting's import costs ~2.7 s at every run's
    # start-up (privacy.sample_level).
    from dp_accounting import dp_event
    from dp_accounting.privacy_accountant import NeighboringRelation
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    ratio = Fraction(data_rate).limit_denominator(10**6)
    step = dp_event.SampledWithoutReplacementDpEvent(
        ratio.denominator, ratio.numerator, dp_event.GaussianDpEvent(noise_multiplier)
    )
    accountant = rdp_lib.RdpAccountant(_rdp_orders(), NeighboringRelation.REPLACE_ONE)
    accountant.compose(step, local_steps)
    return _mixed(np.asarray(accountant.rdp), np.asarray(_rdp_orders()), client_rate)


def _mixed(inner: np.ndarray, orders: np.ndarray, client_rate: float) -> np.ndarray:
    """log((1 − l) + l·e^{(α−1)·inner(α)})/(α − 1): the exact RDP of the participation mixture."""
    log_stay = math.log1p(-client_rate) if client_rate < 1.0 else -math.inf
    exponent = (orders - 1.0) * inner
    return np.logaddexp(log_stay, math.log(client_rate) + exponent) / (orders - 1.0)


class RecordLevelAccountant:
    """A run's record-level accountant, with the client-level accountants' interface.

    ``step(σ_g, l, rounds)`` composes rounds of K local steps at record rate s (runs of equal
    (σ_g, l) merged); ``epsilon(δ)`` is the chosen method's ε of the composition. Calibration
    and round budgets (``privacy.calibration``) therefore work unchanged.
    """

    def __init__(
        self,
        data_rate: float,
        local_steps: int,
        batch_sampling: str = "fresh",
        adjacency: str = "replace_one",
        method: str | None = None,
        num_clients: int | None = None,
        fallback_to_rdp: bool = False,
    ) -> None:
        del fallback_to_rdp  # accepted so every accountant takes the same options
        allowed = methods_for(batch_sampling, adjacency)
        if not allowed:
            raise ValueError(
                f"no record-level analysis of {batch_sampling} batches under {adjacency} "
                "adjacency: fixed-size batches are analysed under replace-one; use adjacency "
                "replace_one or Poisson batches"
            )
        method = method or allowed[0]
        if method not in allowed:
            raise ValueError(
                f"accountant {method!r} has no analysis of {batch_sampling} batches under "
                f"{adjacency}; use one of {', '.join(allowed)}"
            )
        if method in ("paper", "aggregate") and not num_clients:
            raise ValueError(f"the {method} accountant needs the number of clients M")
        if not 0.0 < data_rate <= 1.0 or local_steps < 1:
            raise ValueError(f"need s in (0, 1] and K >= 1, got s={data_rate}, K={local_steps}")
        self.data_rate, self.local_steps = float(data_rate), int(local_steps)
        self.batch_sampling, self.adjacency, self.method = batch_sampling, adjacency, method
        self.num_clients = num_clients
        self.name = method
        self.assumption = ASSUMPTIONS[method]
        self.history: list[tuple[float, float, int]] = []  # (σ_g, l, rounds), merged when equal

    @property
    def rounds(self) -> int:
        return sum(n for _, _, n in self.history)

    @staticmethod
    def _checked(noise_multiplier: float, client_rate: float) -> tuple[float, float]:
        params = (float(noise_multiplier), float(client_rate))
        if not params[0] > 0 or not 0 < params[1] <= 1:
            raise ValueError(f"need σ_g > 0 and l in (0, 1], got {params}")
        return params

    def step(self, noise_multiplier: float, client_rate: float, rounds: int = 1) -> None:
        """Compose ``rounds`` rounds at (σ_g, l); l = 1 is a K-step release every record's
        client takes part in (DP-SCAFFOLD's authors'-code warm start)."""
        self.history = _extended(
            self.history, *self._checked(noise_multiplier, client_rate), rounds
        )

    def epsilon(self, delta: float) -> float:
        return self.epsilon_of_history(self.history, delta) if self.history else 0.0

    def produced_by(self, delta: float) -> str:
        """The accountant whose value ``epsilon(delta)`` is: always this method (it never falls
        back; a refusal is a ``ValueError``)."""
        del delta
        return self.name

    def epsilon_after(self, noise_multiplier: float, client_rate: float, delta: float) -> float:
        params = self._checked(noise_multiplier, client_rate)
        return self.epsilon_of_history(_extended(self.history, *params, 1), delta)

    def epsilon_of(self, sigma: float, client_rate: float, rounds: int, delta: float) -> float:
        """ε after ``rounds`` identical rounds at (σ_g, l), by this accountant's method."""
        return self.epsilon_of_history([(sigma, client_rate, rounds)], delta)

    def epsilon_of_history(self, history, delta: float) -> float:
        """ε of the composed runs (σ_g, l, rounds), by this accountant's method."""
        history = [(sg, rate, n) for sg, rate, n in history if n > 0]
        if not history:
            return 0.0
        if self.method in ("pld", "aggregate"):
            if delta < MIN_DELTA:  # the FFT composition's round-off (privacy.pld.MIN_DELTA)
                raise ValueError(
                    f"the {self.method} accountant refuses δ={delta:g} < {MIN_DELTA:g}: its "
                    "float64 convolution's round-off is no longer small against δ; use rdp"
                )
            if len(history) == 1:
                sigma, rate, n = history[0]
                return self._pld_accountant(sigma, rate).epsilon(n, delta)  # with its guard
            return float(compose_plds(self.run_plds(history)).get_epsilon_for_delta(delta))
        orders, total = self.rdp_curve(history)
        if self.method == "paper":
            return float(np.min(total + math.log(1.0 / delta) / (orders - 1)))
        return epsilon_from_rdp(orders, total, delta)

    def run_plds(self, history) -> list:
        """The PLD of each run (σ_g, l, rounds) of ``history`` (``pld`` and ``aggregate``):
        its round PLD self-composed ``rounds`` times, at the default interval."""
        return [
            self._pld_accountant(sigma, rate).round_pld.self_compose(n)
            for sigma, rate, n in history
        ]

    def rdp_curve(self, history) -> tuple[np.ndarray, np.ndarray] | None:
        """(orders, RDP curve) of the composed runs (σ_g, l, rounds); None without an RDP
        analysis of this method's mechanism.

        ``rdp``: the participation mixture's RDP (module docstring), Poisson or fresh batches;
        ``pld`` with Poisson batches under add/remove analyses the same mechanism, so the same
        curve bounds it (replace-one Poisson batches have no RDP analysis here: None);
        ``paper``: ``TwoLevelSampleAccountant``'s curve, under the paper's assumption;
        ``aggregate``: None (never a run's ε).
        """
        s, k = self.data_rate, self.local_steps
        if self.method == "paper":
            runs = [
                (n, TwoLevelSampleAccountant(self.num_clients, rate, s, k, sigma))
                for sigma, rate, n in history
            ]
            return runs[0][1].orders, sum(n * paper.round_rdp for n, paper in runs)
        if self.method == "aggregate" or (self.method == "pld" and self.adjacency != "add_remove"):
            return None
        curve_of = _round_rdp if self.batch_sampling == "poisson" else _fresh_round_rdp
        total = sum(n * curve_of(rate, s, k, sigma) for sigma, rate, n in history)
        return np.asarray(_rdp_orders()), total

    def _pld_accountant(self, sigma: float, rate: float) -> SampleLevelPldAccountant:
        """Rounds at (σ_g, l): ``pld`` at σ_g under the run's adjacency (Poisson batches);
        ``aggregate`` at σ_e = σ_g·√(lM) under ``aggregate_adjacency``."""
        s, k = self.data_rate, self.local_steps
        if self.method == "pld":
            return SampleLevelPldAccountant(rate, s, k, sigma, adjacency=self.adjacency)
        sigma_e = sigma * math.sqrt(rate * self.num_clients)
        adjacency = aggregate_adjacency(self.batch_sampling, self.adjacency)
        return SampleLevelPldAccountant(rate, s, k, sigma_e, adjacency=adjacency)

    def state_dict(self) -> dict:
        return {"history": [list(run) for run in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.history = [(float(a), float(b), int(n)) for a, b, n in state["history"]]


def compose_plds(plds: list):
    """The composition of PLDs of one discretisation interval, in order (non-empty list)."""
    composed = plds[0]
    for pld in plds[1:]:
        composed = composed.compose(pld)
    return composed


def _extended(history, sigma: float, rate: float, rounds: int):
    """``history`` with ``rounds`` more rounds at (σ, l), merged into the last run if equal."""
    if history and history[-1][:2] == (sigma, rate):
        return [*history[:-1], (sigma, rate, history[-1][2] + int(rounds))]
    return [*history, (sigma, rate, int(rounds))]
