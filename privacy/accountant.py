"""Client-level privacy accounting for the subsampled Gaussian mechanism.

Each round is one release of the sum of the sampled clients' clipped updates with Gaussian noise
of std σC (noise multiplier σ relative to the L2 sensitivity C), amplified by sampling clients
with rate q. ``RdpAccountant`` wraps Opacus's RDP accountant (Mironov et al. 2019 for the
Poisson-subsampled Gaussian; conversion to (ε, δ) by Balle et al. 2020, Thm 21) and composes
heterogeneous rounds (σ and q may change from round to round).

Assumption: the RDP bound is for Poisson sampling. A fixed-size cohort drawn without replacement
is accounted with the same q = m/N; the run records this as an approximation.
"""

from __future__ import annotations

import copy

from opacus.accountants import RDPAccountant


class RdpAccountant:
    name = "rdp"

    def __init__(self) -> None:
        self._opacus = RDPAccountant()

    def step(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> None:
        """Compose ``rounds`` releases of the q-subsampled Gaussian with multiplier σ."""
        for _ in range(rounds):
            self._opacus.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    @property
    def rounds(self) -> int:
        return sum(steps for _, _, steps in self._opacus.history)

    def epsilon(self, delta: float) -> float:
        if not self._opacus.history:
            return 0.0
        return float(self._opacus.get_epsilon(delta))

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """ε if one more round were composed, without composing it."""
        trial = copy.deepcopy(self)
        trial.step(noise_multiplier, sample_rate)
        return trial.epsilon(delta)

    def state_dict(self) -> dict:
        return {"history": [list(h) for h in self._opacus.history]}

    def load_state_dict(self, state: dict) -> None:
        self._opacus.history = [tuple(h) for h in state["history"]]


def sampling_assumption(sampling: str) -> str:
    if sampling == "poisson":
        return "poisson-subsampled gaussian (exact for poisson cohorts)"
    return "poisson-subsampled gaussian with q=m/N (approximation for fixed-size cohorts)"
