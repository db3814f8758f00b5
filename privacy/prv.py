"""Client-level privacy accounting with privacy loss random variables (PRV).

Each round is one release of the sum of the sampled clients' clipped updates with Gaussian noise
of std σC, amplified by sampling clients with rate q. ``PrvAccountant`` composes the rounds with
opacus's ``PRVAccountant`` algorithm (Gopi et al. 2021, "Numerical composition of differential
privacy"; ``privacy.prv_grid``, the same computation without importing opacus and torch): the
privacy loss random variable of each distinct Poisson-subsampled Gaussian is truncated and
discretised on one grid, runs of equal rounds are self-composed by FFT and the runs are
convolved together. σ and q may change from round to round; the merged (σ, q, rounds)
history is opacus's own history format. ε is opacus's ``get_epsilon``: the *upper* end of its
error interval, estimate + ``eps_error`` (0.01 by default), with ``delta_error`` = δ/1000.

Cost: the grid depends on the whole history (its range L comes from an RDP bound on the
composition, its mesh is eps_error / sqrt(T log(12/δ_err) / 2)), so every ε is computed from
scratch and ``epsilon_after`` cannot reuse the previous grid: 0.06-0.1 s per call at q=0.01,
σ=1, T=1000 (128k grid points), plus ~55 ms per distinct (σ, q) run, each being discretised
(100 distinct runs: 5-6 s per call). Results are memoised per (history, δ), so
``epsilon_after`` followed by ``step`` with the same (σ, q) and ``epsilon`` computes once. ε
depends on the merged history only, so an accountant rebuilt with ``load_state_dict``
continues with identical values.

Known failure above ε≈10 (opacus#601, opacus#604, microsoft/prv_accountant#36): older releases
raised "Discrete mean differs significantly from continuous mean." for large ε. opacus 1.6.0
contains the fix (opacus#606: the integration grid of the truncated PRV's mean follows the
truncation bounds). Measured with 1.6.0: on a 150-point grid at δ=1e-5 (q 0.001-1, σ 0.3-2,
T 1-10000, ε up to ~57000) and on 746 random draws with grids up to 3M points (q 1e-4-1,
σ 0.3-3, T 1-10000, δ 1e-9-1e-4) that error never occurred, and every finite ε was within
2% + 0.011 of PLD. What goes wrong now at large ε is the grid, whose size grows like
ε·sqrt(T)/eps_error: q=0.05, σ=0.5, T=10000 (ε=310) needs 24M points and 19 s; q=0.5, σ=0.5,
T=1000 (ε≈880, 20M points) silently returned inf after 13 s; q=1, σ=0.3, T=10000 raised
MemoryError (29.5 GiB); most cases with ε > 300 ran past 20 s (up to 85 s). Hence two guards,
checked before the composition runs (both cheap, from the cached RDP curves), raising
``ValueError``: the RDP upper bound on ε must be at most ``max_epsilon`` (100; the message
points to rdp, since PldAccountant refuses such ε too), and the grid at most
``max_grid_points`` (1e7 points, ~10 s and ~2 GB per call; the message points to pld, which is
fast there: q=0.01, σ=0.7, T=50000, 7.9M points, ε=39.4 takes 9.6 s with PRV and 0.9 s with
PLD). Any exception from the composition, or a non-finite ε, is re-raised as ``ValueError``
naming pld. Small ε: the +eps_error makes the bound loose in relative terms (+0.5% at ε≈1.8,
+3% at ε≈0.3, +100% at ε≈0.01, compared with PLD).

Assumptions: Poisson sampling of clients and add/remove-one adjacency (opacus's PRV of the
Poisson-subsampled Gaussian). A fixed-size cohort drawn without replacement is accounted with
the same q = m/N, as an approximation. A round with q = 0 releases nothing; a round with σ = 0
and q > 0 is not private (ε = ∞).
"""

from __future__ import annotations

import math

import numpy as np

from privacy.pld import HistoryAccountant, Runs, extended
from privacy.prv_grid import grid_points, prv_epsilon
from privacy.rdp import validated

DEFAULT_EPS_ERROR = 0.01  # opacus's default
DEFAULT_MAX_EPSILON = 100.0
DEFAULT_MAX_GRID_POINTS = 10_000_000


class PrvAccountant(HistoryAccountant):
    name = "prv"
    refusal = "the PRV grid grows with ε and fails or runs out of memory there."

    def __init__(
        self,
        eps_error: float = DEFAULT_EPS_ERROR,
        max_epsilon: float = DEFAULT_MAX_EPSILON,
        max_grid_points: int = DEFAULT_MAX_GRID_POINTS,
        fallback_to_rdp: bool = False,
    ) -> None:
        super().__init__(max_epsilon, fallback_to_rdp)
        self.eps_error = float(eps_error)
        self.max_grid_points = int(max_grid_points)

    def _compute(self, history: Runs, delta: float) -> float:
        runs = tuple(run for run in history if run[1] > 0.0 and run[2] > 0)
        if not runs:
            return 0.0
        where = f"{len(runs)} run(s), {sum(r for _, _, r in runs)} rounds, δ={delta:g}"
        delta_error = delta / 1000
        points = grid_points(runs, self.eps_error, delta_error)
        if points > self.max_grid_points:
            raise ValueError(
                f"PRV accounting refused ({where}): the PRV grid would need {points:.3g} "
                f"points (> max_grid_points={self.max_grid_points:.3g}; it grows like "
                "ε·sqrt(rounds)/eps_error); use the pld accountant."
            )
        try:
            with np.errstate(divide="ignore"):  # q = 1 takes log(1 - q)
                eps = prv_epsilon(runs, delta, self.eps_error)
        except (ArithmeticError, MemoryError, RuntimeError, ValueError) as error:
            raise ValueError(
                f"PRV composition (opacus's algorithm) failed ({where}): "
                f"{type(error).__name__}: {error}; it is unreliable at large ε (opacus#604); "
                "use the pld accountant."
            ) from error
        if not math.isfinite(eps):
            raise ValueError(
                f"PRV composition (opacus's algorithm) returned ε={eps} ({where}); it is "
                "unreliable at large ε (opacus#604); use the pld accountant."
            )
        return eps

    def step(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> None:
        """Compose ``rounds`` releases of the q-subsampled Gaussian with multiplier σ."""
        sigma, q, rounds = validated(noise_multiplier, sample_rate, rounds)
        if rounds:
            self.history = list(extended(tuple(self.history), sigma, q, rounds))

    def _settings(self) -> tuple:
        return (self.eps_error, self.max_epsilon, self.max_grid_points, self.fallback_to_rdp)
