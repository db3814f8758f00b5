"""Client-level privacy accounting for the subsampled Gaussian mechanism.

Each round is one release of the sum of the sampled clients' clipped updates with Gaussian noise
of std σC (noise multiplier σ relative to the L2 sensitivity C), amplified by sampling clients
with rate q. ``RdpAccountant`` uses Opacus's RDP analysis of the Poisson-subsampled Gaussian
(Mironov et al. 2019) at Opacus's default orders, composes heterogeneous rounds by summing
their RDP curves (σ and q may change from round to round), and converts to (ε, δ) with
Balle et al. 2020, Thm 21 (``opacus.accountants.analysis.rdp.get_privacy_spent``).

The per-round curve is computed once per distinct (σ, q) and cached, so ε after every round
costs one conversion, not a recomputation of the whole history.

Assumption: the RDP bound is for Poisson sampling. A fixed-size cohort drawn without replacement
is accounted with the same q = m/N; the run records this as an approximation.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

ORDERS = tuple(RDPAccountant.DEFAULT_ALPHAS)


@lru_cache(maxsize=256)
def _round_rdp(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP ε(α) of one q-subsampled Gaussian release at every order in ``ORDERS``."""
    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=ORDERS)
    return np.asarray(rdp, dtype=np.float64)


class RdpAccountant:
    name = "rdp"

    def __init__(self) -> None:
        self.history: list[tuple[float, float, int]] = []  # (σ, q, rounds), merged when equal
        self._rdp = np.zeros(len(ORDERS))

    def step(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> None:
        """Compose ``rounds`` releases of the q-subsampled Gaussian with multiplier σ."""
        key = (float(noise_multiplier), float(sample_rate))
        if self.history and self.history[-1][:2] == key:
            self.history[-1] = (*key, self.history[-1][2] + rounds)
        else:
            self.history.append((*key, rounds))
        self._rdp = self._rdp + rounds * _round_rdp(*key)

    @property
    def rounds(self) -> int:
        return sum(rounds for _, _, rounds in self.history)

    @staticmethod
    def _epsilon(rdp: np.ndarray, delta: float) -> float:
        eps, _ = get_privacy_spent(orders=list(ORDERS), rdp=rdp, delta=delta)
        return float(eps)

    def epsilon(self, delta: float) -> float:
        return self._epsilon(self._rdp, delta) if self.history else 0.0

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """ε if one more round were composed, without composing it."""
        return self._epsilon(self._rdp + _round_rdp(noise_multiplier, sample_rate), delta)

    def state_dict(self) -> dict:
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.__init__()
        for sigma, q, rounds in state["history"]:
            self.step(sigma, q, int(rounds))


def sampling_assumption(sampling: str) -> str:
    if sampling == "poisson":
        return "poisson-subsampled gaussian (exact for poisson cohorts)"
    return "poisson-subsampled gaussian with q=m/N (approximation for fixed-size cohorts)"


ACCOUNTANTS = ("rdp",)


def accountant_class(name: str) -> type:
    """The accountant class for a config/CLI name."""
    if name == "rdp":
        return RdpAccountant
    raise ValueError(f"unknown accountant {name!r}; known: {', '.join(ACCOUNTANTS)}")
