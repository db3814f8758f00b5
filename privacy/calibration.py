"""Noise calibration and round budgets for the subsampled Gaussian mechanism.

Both searches use any accountant class with the ``RdpAccountant`` interface, so the answer is
in the same terms as the ε the run will report. A probe whose ε the accountant refuses
(``ValueError``: PLD/PRV beyond their range, ε ≳ 100) counts as ε = ∞, which meets no finite
budget:

- ``calibrate_sigma``: the smallest σ (to a relative tolerance) with ε(σ; q, T, δ) ≤ ε*,
  by regula falsi (Illinois) on log ε against log σ — ε is decreasing in σ and log ε nearly
  linear in log σ near the answer, so a bracket [σ that fails, σ that meets] shrinks to the
  tolerance in ≈ 8 accountant calls where bisection took ≈ 16 (each a T-round PLD
  composition: 0.6–2 s at T = 1000). The returned σ always meets the target.
- ``max_rounds``: the largest T with ε(T; σ, q, δ) ≤ ε*, by doubling then bisection
  (``privacy.search.largest_meeting``) — ε is increasing in T.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from privacy.accountant import RdpAccountant
from privacy.search import largest_meeting

AccountantFactory = Callable[[], object]


def as_run_accountant(cls: type) -> AccountantFactory:
    """A factory of accountant ``cls`` as runs use it: where the tight accountant refuses (ε
    beyond its range) it returns the RDP bound instead, still an upper bound on ε."""
    return lambda: cls(fallback_to_rdp=True)


def ceil_significant(value: float, digits: int = 4) -> float:
    """``value`` rounded *up* to ``digits`` significant digits (a printed σ never undershoots)."""
    if value <= 0 or not math.isfinite(value):
        return value
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale - 1e-9) / scale


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


def _epsilon_or_inf(
    noise_multiplier: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    accountant: AccountantFactory,
) -> float:
    """ε, a refused ε counting as ∞ (arguments the accountant rejects still raise)."""
    acc = _composed(noise_multiplier, sample_rate, rounds, accountant)
    try:
        return acc.epsilon(delta)
    except ValueError:
        return math.inf


def _within(
    target_epsilon: float,
    noise_multiplier: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    accountant: AccountantFactory,
) -> bool:
    """ε ≤ ε*, a refused ε counting as ∞."""
    epsilon = _epsilon_or_inf(noise_multiplier, sample_rate, rounds, delta, accountant)
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
    """Smallest σ (within ``rel_tol``: σ meets ε* and σ / (1 + rel_tol) does not, up to the
    bracket's last step) whose ε after ``rounds`` rounds is at most ε*."""
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")
    if rounds <= 0 or sample_rate <= 0:  # ε is 0 at every σ: there is no smallest one
        raise ValueError(f"nothing to calibrate: {rounds} rounds at q={sample_rate:g} spend no ε")

    def excess(log_sigma: float) -> float:
        """log ε − log ε* at σ = e^log_sigma: ≤ 0 meets the target; ∞ where refused."""
        epsilon = _epsilon_or_inf(math.exp(log_sigma), sample_rate, rounds, delta, accountant)
        return math.log(epsilon / target_epsilon) if epsilon > 0 else -math.inf

    hi = math.log(sigma_max)
    f_hi = excess(hi)
    if f_hi > 0:
        raise ValueError(
            f"no σ ≤ {sigma_max:g} reaches ε={target_epsilon:g} at δ={delta:g}, q={sample_rate:g}, "
            f"{rounds} rounds; raise the budget, lower q or the number of rounds"
        )
    lo = math.log(1e-2)
    f_lo = excess(lo)
    while f_lo <= 0:  # invariant from here: σ = e^lo fails, σ = e^hi meets
        hi, f_hi, lo = lo, f_lo, lo - math.log(10)
        f_lo = excess(lo)
    kept = 0  # which end the last step kept: +1 hi, -1 lo
    while hi - lo > math.log1p(rel_tol):
        width = hi - lo
        if math.isfinite(f_lo) and math.isfinite(f_hi):
            x = hi - f_hi * width / (f_hi - f_lo)  # where the chord crosses log ε*
            x = min(max(x, lo + 0.01 * width), hi - 0.01 * width)  # progress from both ends
        else:
            x = lo + width / 2
        f = excess(x)
        if f <= 0:
            hi, f_hi = x, f
            if kept == -1:  # lo kept twice: halve its weight, or the chord stalls there
                f_lo /= 2
            kept = -1
        else:
            lo, f_lo = x, f
            if kept == 1:
                f_hi /= 2
            kept = 1
    return math.exp(hi)


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
