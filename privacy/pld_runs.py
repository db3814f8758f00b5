"""PLDs of runs of identical rounds at a per-round cost that does not grow with the run's length.

A run of t rounds at (σ, q) is the t-fold self-composition of the one-round PLD
(``privacy.pld_numpy.self_composed``, dp-accounting's ``PrivacyLossDistribution.self_compose``:
the pmf raised to the t-th power in the Fourier domain, truncated to the losses that carry more
than 10⁻¹⁵ of tail mass by a Chernoff bound). Two costs of doing that once per round grow or
repeat needlessly:

- the Chernoff bound needs the one-round pmf's log-moment-generating function at 40 orders, an
  O(40·L₁) pass over its L₁ points, recomputed by dp-accounting on every call. It depends only
  on (σ, q, interval), so ``chernoff_moments`` computes it once and ``self_composed`` reuses it;
- the composed pmf's support grows with t (q = 0.2, σ = 1 at interval 10⁻⁴: 88k points after one
  round, 493k after 100, 1.3M after 1,000), and the FFT and the ε look-up with it.
  ``discretization_for`` therefore doubles the interval (10⁻⁴·2ᵏ, the smallest k) until the
  composed support fits in ``SUPPORT_CAP`` points. A pessimistic discretisation is an upper bound
  at every interval, so ε stays a valid bound; the interval only grows where the support is wide,
  i.e. where ε is large and a coarser grid costs little relative precision (measured in the
  README's accounting section: ≤ 1.2·10⁻⁵ relative). It finds that k from a cheap estimate at
  a coarse probe interval, so that it builds the one-round PLD at the interval it picks and
  rarely at a finer one (not at every finer one: 1.7 + 0.57 s wasted at q = 0.1, σ = 0.95,
  T = 200, where 4·10⁻⁴ is picked, with dp-accounting's construction; ``privacy.pld_numpy``'s
  takes 23–31× less CPU, benchmarks/NOTES.md).

``discretization_for`` decides from the run history alone (the Chernoff support, O(40) per run), so
ε stays a deterministic function of the merged (σ, q, rounds) history and a resumed accountant
continues with bit-identical values.
"""

from __future__ import annotations

from functools import lru_cache

from privacy import pld_numpy
from privacy.pld_numpy import Pld

SUPPORT_CAP = 2**17  # points per direction of a composed PLD before the interval doubles
MAX_DOUBLINGS = 12
PROBE_DOUBLINGS = 6  # discretization_for's first, cheap estimate: at finest·2⁶

Runs = tuple[tuple[float, float, int], ...]  # merged (σ, q, rounds) history


@lru_cache(maxsize=32)
def subsampled_gaussian_pld(noise_multiplier: float, sample_rate: float, interval: float) -> Pld:
    """PLD of one q-subsampled Gaussian release (σ > 0, 0 < q ≤ 1) at ``interval``."""
    return pld_numpy.subsampled_gaussian_pld(noise_multiplier, sample_rate, interval)


@lru_cache(maxsize=32)
def chernoff_moments(sigma: float, q: float, interval: float) -> tuple:
    """Per direction of the one-round PLD: (its Chernoff moments, its pmf's length)."""
    pmfs = subsampled_gaussian_pld(sigma, q, interval).pmfs
    return tuple((pld_numpy.log_moments(pmf), len(pmf.probs)) for pmf in pmfs)


@lru_cache(maxsize=4096)
def _support(sigma: float, q: float, interval: float, times: int) -> int:
    """Points of the wider direction of the ``times``-fold self-composition (no FFT). Cached:
    ``discretization_for`` asks for every run of the history every round, and a closed run's
    answer never changes (its moments may have left ``chernoff_moments``'s cache)."""
    bounds = (
        pld_numpy.chernoff_bounds(moments, length, times)
        for moments, length in chernoff_moments(sigma, q, interval)
    )
    return max(upper - lower + 1 for lower, upper in bounds)


def _history_support(runs: list, interval: float) -> int:
    """Points of the composed PLD of ``runs`` (the sum over the runs) at ``interval``."""
    return sum(_support(sigma, q, interval, t) for sigma, q, t in runs)


def _estimated_doublings(runs: list, finest: float) -> int:
    """k at which the support, scaled as 1/interval from the probe interval finest·2^PROBE,
    first fits ``SUPPORT_CAP`` (the probe's one-round PLD has ~1/64 of the finest's points)."""
    probe = _history_support(runs, finest * 2**PROBE_DOUBLINGS)
    k = 0
    while k < MAX_DOUBLINGS and probe * 2 ** (PROBE_DOUBLINGS - k) > SUPPORT_CAP:
        k += 1
    return k


def discretization_for(history: Runs, finest: float) -> float:
    """The interval ``finest``·2ᵏ, smallest k, at which the history's PLD fits ``SUPPORT_CAP``
    (``finest``·2^``MAX_DOUBLINGS`` where none below does).

    The support never grows with the interval (it shrinks about as 1/interval). Each exact
    support costs a one-round PLD at that interval (the finest the dearest), so the search
    starts from the cheap estimate of ``_estimated_doublings``, climbs while the exact support
    does not fit, then steps down while the next finer interval fits. Since the support is
    monotone, that is the exhaustive search's answer from k = 0, whatever the history
    (tests/test_accountants_pld_prv.py checks it against the exhaustive search, including a
    history whose support shrinks by far less than 2 per doubling).
    """
    runs = [(sigma, q, t) for sigma, q, t in history if q > 0.0 and sigma > 0.0 and t > 0]
    k = _estimated_doublings(runs, finest)
    while k < MAX_DOUBLINGS and _history_support(runs, finest * 2**k) > SUPPORT_CAP:
        k += 1
    while k > 0 and _history_support(runs, finest * 2 ** (k - 1)) <= SUPPORT_CAP:
        k -= 1
    return finest * 2**k


def self_composed(sigma: float, q: float, interval: float, times: int) -> Pld:
    """The one-round PLD at (σ, q, interval) self-composed ``times`` times, moments cached."""
    pld = subsampled_gaussian_pld(sigma, q, interval)
    moments = chernoff_moments(sigma, q, interval)
    return Pld(
        tuple(
            pld_numpy.self_composed(pmf, pmf_moments, times)
            for pmf, (pmf_moments, _) in zip(pld.pmfs, moments, strict=True)
        )
    )
