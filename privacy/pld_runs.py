"""PLDs of runs of identical rounds at a per-round cost that does not grow with the run's length.

A run of t rounds at (σ, q) is the t-fold self-composition of the one-round PLD (dp-accounting's
``PrivacyLossDistribution.self_compose``: the pmf raised to the t-th power in the Fourier domain,
truncated to the losses that carry more than 10⁻¹⁵ of tail mass by a Chernoff bound). Two costs
of doing that once per round grow or repeat needlessly:

- the Chernoff bound needs the one-round pmf's log-moment-generating function at 40 orders, an
  O(40·L₁) pass over its L₁ points, recomputed by the library on every call. It depends only on
  (σ, q, interval), so ``chernoff_moments`` computes it once; ``self_composed`` is the
  library's self-composition step for step (same bounds, FFT length and truncation, so
  bit-identical), reusing it;
- the composed pmf's support grows with t (q = 0.2, σ = 1 at interval 10⁻⁴: 88k points after one
  round, 493k after 100, 1.3M after 1,000), and the FFT and the ε look-up with it.
  ``discretization_for`` therefore doubles the interval (10⁻⁴·2ᵏ, the smallest k) until the
  composed support fits in ``SUPPORT_CAP`` points. A pessimistic discretisation is an upper bound
  at every interval, so ε stays a valid bound; the interval only grows where the support is wide,
  i.e. where ε is large and a coarser grid costs little relative precision (measured in the
  README's accounting section: ≤ 1.2·10⁻⁵ relative). It finds that k from a cheap estimate at
  a coarse probe interval, so that it builds the one-round PLD at the interval it picks and
  rarely at a finer one (not at every finer one: 1.7 + 0.57 s wasted at q = 0.1, σ = 0.95,
  T = 200, where 4·10⁻⁴ is picked).

``discretization_for`` decides from the run history alone (the Chernoff support, O(40) per run), so
ε stays a deterministic function of the merged (σ, q, rounds) history and a resumed accountant
continues with bit-identical values.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import fft, special

SUPPORT_CAP = 2**17  # points per direction of a composed PLD before the interval doubles
MAX_DOUBLINGS = 12
PROBE_DOUBLINGS = 6  # discretization_for's first, cheap estimate: at finest·2⁶
RATIO_SLACK = 0.15  # a finer interval is checked where its support could be < 2/1.15 × this one's
TAIL_MASS_TRUNCATION = 1e-15  # dp-accounting's default for self_compose

Runs = tuple[tuple[float, float, int], ...]  # merged (σ, q, rounds) history


@lru_cache(maxsize=32)
def subsampled_gaussian_pld(
    noise_multiplier: float, sample_rate: float, interval: float
) -> pld_lib.PrivacyLossDistribution:
    """PLD of one q-subsampled Gaussian release, built as ``PLDAccountant`` builds it."""
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        value_discretization_interval=interval,
        sampling_prob=sample_rate,
    )


def _pmfs(pld: pld_lib.PrivacyLossDistribution) -> list[pld_pmf.DensePLDPmf]:
    """The dense pmf of each direction (remove, and add where the PLD is not symmetric)."""
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    return [pmf.to_dense_pmf() for pmf in pmfs]


@lru_cache(maxsize=32)
def chernoff_moments(sigma: float, q: float, interval: float) -> tuple:
    """Per direction: (orders, log-MGFs, pmf length), as ``common.self_convolve`` computes them."""
    moments = []
    for pmf in _pmfs(subsampled_gaussian_pld(sigma, q, interval)):
        length = len(pmf._probs)
        orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / length
        log_mgfs = [special.logsumexp(np.arange(length) * order, b=pmf._probs) for order in orders]
        moments.append((orders, log_mgfs, length))
    return tuple(moments)


def _bounds(moments: tuple, times: int) -> tuple[int, int]:
    """``common.compute_self_convolve_bounds`` from cached moments: [lower, upper] indices."""
    orders, log_mgfs, length = moments
    upper, lower = (length - 1) * times, 0
    for order, log_mgf in zip(orders, log_mgfs, strict=True):
        bound = (times * log_mgf + math.log(2 / TAIL_MASS_TRUNCATION)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper = min(upper, math.ceil(bound))
        if order < 0:
            lower = max(lower, math.floor(bound))
    return lower, upper


@lru_cache(maxsize=4096)
def _support(sigma: float, q: float, interval: float, times: int) -> int:
    """Points of the wider direction of the ``times``-fold self-composition (no FFT). Cached:
    ``discretization_for`` asks for every run of the history every round, and a closed run's
    answer never changes (its moments may have left ``chernoff_moments``'s cache)."""
    return max(
        upper - lower + 1
        for lower, upper in (_bounds(m, times) for m in chernoff_moments(sigma, q, interval))
    )


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

    The support shrinks as the interval grows, about as 1/interval (×2.0–2.13 per doubling
    where it is near the cap). Each exact support costs a one-round PLD at that interval
    (≈1.7 s at q = 0.1, σ = 0.95, 10⁻⁴, half that per doubling), so the search starts from
    the estimate of ``_estimated_doublings``, climbs while the exact support does not fit, and
    only checks a finer interval exactly where it could fit: where the support at k is at most
    ``SUPPORT_CAP``·(1 + ``RATIO_SLACK``)/2. The answer is the exhaustive search's from k = 0
    wherever one doubling at least divides the support by 2/(1 + ``RATIO_SLACK``) ≈ 1.74
    (tests/test_accountants_pld_prv.py checks it against the exhaustive search).
    """
    runs = [(sigma, q, t) for sigma, q, t in history if q > 0.0 and sigma > 0.0 and t > 0]
    k = _estimated_doublings(runs, finest)
    while k < MAX_DOUBLINGS and _history_support(runs, finest * 2**k) > SUPPORT_CAP:
        k += 1
    while (
        k > 0
        and _history_support(runs, finest * 2**k) <= SUPPORT_CAP * (1 + RATIO_SLACK) / 2
        and _history_support(runs, finest * 2 ** (k - 1)) <= SUPPORT_CAP
    ):
        k -= 1
    return finest * 2**k


def _self_composed_pmf(pmf: pld_pmf.DensePLDPmf, moments: tuple, times: int):
    """``DensePLDPmf.self_compose(times)`` with the Chernoff moments given (same result)."""
    lower, upper = _bounds(moments, times)
    output_len = upper - lower + 1
    fast_len = fft.next_fast_len(max(output_len, len(pmf._probs)))
    convolution = np.real(fft.ifft(fft.fft(pmf._probs, fast_len) ** times))
    probs = np.array(np.roll(convolution, -lower)[:output_len])
    infinity_mass = TAIL_MASS_TRUNCATION - math.expm1(times * math.log1p(-pmf._infinity_mass))
    return pld_pmf.DensePLDPmf(
        pmf._discretization,
        pmf._lower_loss * times + lower,
        probs,
        infinity_mass,
        pmf._pessimistic_estimate,
    )


def self_composed(
    sigma: float, q: float, interval: float, times: int
) -> pld_lib.PrivacyLossDistribution:
    """``subsampled_gaussian_pld(σ, q, interval).self_compose(times)``, moments cached."""
    pld = subsampled_gaussian_pld(sigma, q, interval)
    pmfs = [
        _self_composed_pmf(pmf, moments, times)
        for pmf, moments in zip(_pmfs(pld), chernoff_moments(sigma, q, interval), strict=True)
    ]
    return pld_lib.PrivacyLossDistribution(*pmfs)
