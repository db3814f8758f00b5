"""Noise calibration and round budgets for the subsampled Gaussian mechanism.

Both searches use any accountant class with the ``RdpAccountant`` interface, so the answer is
in the same terms as the ε the run will report. A probe whose ε the accountant refuses
(``ValueError``: PLD/PRV beyond their range, ε ≳ 100) counts as ε = ∞, which meets no finite
budget:

- ``calibrate_sigma``: the smallest σ (to a relative tolerance) with ε(σ; q, T, δ) ≤ ε*,
  by bisection on log σ — ε is decreasing in σ. The returned σ always meets the target.
- ``max_rounds``: the largest T with ε(T; σ, q, δ) ≤ ε*, by doubling then bisection
  (``privacy.search.largest_meeting``) — ε is increasing in T.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from privacy.accountant import RdpAccountant
from privacy.search import largest_meeting

AccountantFactory = Callable[[], object]


def _composed(
    noise_multiplier: float, sample_rate: float, rounds: int, accountant: AccountantFactory
):
    """A new accountant charged ``rounds`` rounds at (σ, q); none for ``rounds`` ≤ 0."""
    acc = accountant()
    if rounds > 0:
        acc.step(noise_multiplier, sample_rate, rounds)
    return acc


def epsilon_for(
    noise_multiplier: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    accountant: AccountantFactory = RdpAccountant,
) -> float:
    """ε after ``rounds`` identical rounds of the q-subsampled Gaussian with multiplier σ.

    Raises:
        ValueError: where the accountant refuses to compute (PLD/PRV beyond their range,
            ε ≳ 100, unless built with ``fallback_to_rdp``) or rejects an argument.
    """
    return _composed(noise_multiplier, sample_rate, rounds, accountant).epsilon(delta)


def _within(
    target_epsilon: float,
    noise_multiplier: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    accountant: AccountantFactory,
) -> bool:
    """ε ≤ ε*, a refused ε counting as ∞ (arguments the accountant rejects still raise)."""
    acc = _composed(noise_multiplier, sample_rate, rounds, accountant)
    try:
        epsilon = acc.epsilon(delta)
    except ValueError:
        epsilon = math.inf
    return epsilon <= target_epsilon


def calibrate_sigma(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    rounds: int,
    accountant: AccountantFactory = RdpAccountant,
    rel_tol: float = 1e-3,
    sigma_max: float = 1e4,
) -> float:
    """Smallest σ (within ``rel_tol``) whose ε after ``rounds`` rounds is at most ε*."""
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")

    def meets(sigma: float) -> bool:
        return _within(target_epsilon, sigma, sample_rate, rounds, delta, accountant)

    if not meets(sigma_max):
        raise ValueError(
            f"no σ ≤ {sigma_max:g} reaches ε={target_epsilon:g} at δ={delta:g}, q={sample_rate:g}, "
            f"{rounds} rounds; raise the budget, lower q or the number of rounds"
        )
    lo, hi = 1e-2, sigma_max  # invariant: meets(hi)
    while meets(lo):
        lo, hi = lo / 10, lo
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if meets(mid) else (mid, hi)
    return hi


def max_rounds(
    noise_multiplier: float,
    sample_rate: float,
    delta: float,
    target_epsilon: float,
    accountant: AccountantFactory = RdpAccountant,
    limit: int = 10**7,
) -> int:
    """Largest T ≤ ``limit`` with ε(T) ≤ ε* (0 when even one round exceeds it)."""

    def meets(rounds: int) -> bool:
        return _within(target_epsilon, noise_multiplier, sample_rate, rounds, delta, accountant)

    return largest_meeting(meets, limit)
