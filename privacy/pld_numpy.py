"""The Poisson-subsampled Gaussian's privacy loss distribution (PLD) in NumPy and ``scipy.fft``.

The computation of ``dp_accounting.pld`` (Doroshenko et al. 2022, "Connect the Dots") for the one
mechanism the client-level accountant composes, without importing dp-accounting, whose package
imports ``scipy.stats`` (about a second of CPU: the privacy calculator's start-up). The steps and
their floating-point operations follow the library's, so the values are its values
(tests/test_pld_numpy.py compares them):

- ``subsampled_gaussian_pld``: the pessimistic connect-the-dots discretisation of the remove and
  add directions on the grid of losses k·h between the losses at the Gaussian's truncation
  points (tail mass e⁻⁵⁰ each side; the mass beyond goes to +∞);
- ``self_composed``: a pmf convolved with itself T times in the Fourier domain, truncated to the
  losses a Chernoff bound gives more than 10⁻¹⁵ of tail mass (the truncated mass goes to +∞);
- ``composed``: two pmfs convolved (FFT), tails of ≤ 10⁻¹⁵/2 each cut, the left one moved to the
  lowest kept loss and the right one to +∞ (both pessimistic);
- ``Pld.epsilon``: the smallest ε whose hockey-stick divergence is at most δ, the larger of the
  two directions.

A PLD of one direction is the law of the privacy loss L = ln(μ_upper(X)/μ_lower(X)), X ~ μ_upper,
for the Gaussian N(0, σ²) with sensitivity 1 subsampled with probability q:

- remove: μ_upper = (1−q)·N(0, σ²) + q·N(−1, σ²), μ_lower = N(0, σ²);
- add: μ_upper = N(0, σ²), μ_lower = (1−q)·N(0, σ²) + q·N(1, σ²).

At q = 1 the two coincide and only the remove direction is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft, special

LOG_MASS_TRUNCATION = -50.0  # ln of the Gaussian mass cut from the two tails together
TAIL_MASS_TRUNCATION = 1e-15  # mass a composition may move to +∞ (dp-accounting's default)
CHERNOFF_ORDERS = np.concatenate((np.arange(-20, 0), np.arange(1, 21)))  # ×1/length


@dataclass(frozen=True)
class LossPmf:
    """A discretised privacy loss: P(L = (lower + i)·interval) = probs[i], P(L = ∞) = infinity."""

    interval: float
    lower: int
    probs: np.ndarray
    infinity: float

    @property
    def upper(self) -> int:
        return self.lower + len(self.probs) - 1


@dataclass(frozen=True)
class Pld:
    """The remove and add directions' pmfs (one pmf where both are the same: q = 1)."""

    pmfs: tuple[LossPmf, ...]

    def composed_with(self, other: Pld) -> Pld:
        """The PLD of both mechanisms applied (each direction's pmfs convolved)."""
        if len(self.pmfs) == len(other.pmfs) == 1:
            return Pld((composed(self.pmfs[0], other.pmfs[0]),))
        pairs = zip(_remove_and_add(self), _remove_and_add(other), strict=True)
        return Pld(tuple(composed(mine, theirs) for mine, theirs in pairs))

    def epsilon(self, delta: float) -> float:
        """The smallest ε ≥ 0 with δ(ε) ≤ ``delta`` in both directions (∞ where none is)."""
        return max(epsilon_for_delta(pmf, delta) for pmf in self.pmfs)


def _remove_and_add(pld: Pld) -> tuple[LossPmf, LossPmf]:
    """(remove, add) pmfs; the same pmf twice where the PLD is symmetric."""
    return (pld.pmfs[0], pld.pmfs[-1])


def identity(interval: float) -> Pld:
    """The PLD of a mechanism that releases nothing: L = 0 with probability 1."""
    return Pld((LossPmf(interval, 0, np.array([1.0]), 0.0),))


# -- the subsampled Gaussian ---------------------------------------------------------------------


def _log_add(a, b):
    """ln(eᵃ + eᵇ), elementwise, from the larger argument."""
    low, high = np.minimum(a, b), np.maximum(a, b)
    return high + np.log1p(np.exp(low - high))


def _remove_loss(x: float, sigma: float, q: float) -> float:
    """The remove direction's loss at x: ln(1 − q + q·e^ℓ), ℓ = (−1/2 − x)/σ² the Gaussian's."""
    loss = (-0.5 - x) / sigma**2
    if q == 1.0:
        return loss
    if loss == 0:
        return np.log(q + (1 - q))
    return _log_add(loss + np.log(q), np.log(1 - q))


def _unsubsampled(losses: np.ndarray, q: float) -> np.ndarray:
    """The Gaussian's loss ℓ under each subsampled loss L = ln(1 − q + q·e^ℓ) > ln(1 − q):
    ℓ = ln(a·e^L + c) with a = 1/q, c = 1 − 1/q < 0, i.e. ln(a·e^L) + ln(1 − e^(ln(−c) −
    ln(a·e^L))); at L = 0 ln(a + c), the rounding of 0 that dp-accounting's formula gives."""
    if q == 1.0:
        return losses
    a, c = 1 / q, 1 - 1 / q
    shifted = losses + np.log(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(
            losses == 0, np.log(a + c), shifted + np.log1p(-np.exp(np.log(-c) - shifted))
        )


def _remove_inverse(losses: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """The largest x whose remove-direction loss is at least each loss (all > ln(1 − q)):
    x = −1/2 − σ²ℓ inverts the Gaussian's ℓ = (−1/2 − x)/σ²; at L = ln(1 − q) (ℓ = −∞), ∞."""
    x = -0.5 - _unsubsampled(losses, q) * sigma**2
    if q == 1.0:
        return x
    return np.where(_isclose(losses, math.log(1 - q)), np.inf, x)


def _add_inverse(losses: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """The largest x whose add-direction loss is at least each loss (all < −ln(1 − q)).

    The add loss at x is minus the remove loss at −x, so the Gaussian's loss is −ℓ(−L) and x
    its inverse shifted by the sensitivity: 1 + (−1/2 + σ²ℓ(−L)); at L = −ln(1 − q), −∞.
    """
    gaussian = -_unsubsampled(-losses, q)
    x = 1.0 + (-0.5 - gaussian * sigma**2)
    if q == 1.0:
        return x
    return np.where(_isclose(losses, -math.log(1 - q)), -np.inf, x)


def _isclose(values: np.ndarray, target: float) -> np.ndarray:
    """``math.isclose`` elementwise (relative tolerance 10⁻⁹)."""
    return np.abs(values - target) <= 1e-9 * np.maximum(np.abs(values), abs(target))


def _hockey_stick(epsilons: np.ndarray, sigma: float, q: float, remove: bool) -> np.ndarray:
    """δ(ε) = P_upper(X ≤ x) − e^ε·P_lower(X ≤ x), x the inverse loss at ε, in [0, 1].

    The loss decreases in x, so {L ≥ ε} = {X ≤ x(ε)}. Remove: below ε = ln(1 − q) every outcome
    has loss above ε and δ = 1 − e^ε. Add: from ε = −ln(1 − q) up no outcome has and δ = 0.
    """
    deltas = np.zeros_like(epsilons, dtype=float)
    if q == 1.0:
        inside = np.full_like(epsilons, True, dtype=bool)
    elif remove:
        inside = epsilons > math.log1p(-q)
        deltas[~inside] = -np.expm1(epsilons[~inside])
    else:
        inside = epsilons < -math.log1p(-q)
    eps = epsilons[inside]
    x = (_remove_inverse if remove else _add_inverse)(eps, sigma, q)
    if remove:
        upper = special.ndtr(np.add(x, 1.0) / sigma)
        if q < 1.0:
            upper = (1 - q) * special.ndtr(x / sigma) + q * upper
        log_lower = special.log_ndtr(x / sigma)
    else:
        upper = special.ndtr(x / sigma)
        log_lower = special.log_ndtr(np.add(x, -1.0) / sigma)
        if q < 1.0:
            log_lower = np.logaddexp(
                np.log1p(-q) + special.log_ndtr(x / sigma), np.log(q) + log_lower
            )
    deltas[inside] = upper - np.exp(eps + log_lower)
    return np.clip(deltas, 0, 1)


def _loss_range(sigma: float, q: float, remove: bool) -> tuple[float, float]:
    """(smallest, largest) loss over the Gaussian's truncation points: X ~ N(0, σ²) beyond
    ±x₀, P(X < −x₀) = e^``LOG_MASS_TRUNCATION``/2, widened by the sensitivity on the side of
    the shifted component (left for remove, right for add)."""
    left = special.ndtri(0.5 * math.exp(LOG_MASS_TRUNCATION)) * sigma
    right = -left
    if remove:
        left -= 1.0
        return _remove_loss(right, sigma, q), _remove_loss(left, sigma, q)
    right += 1.0
    return -_remove_loss(-right, sigma, q), -_remove_loss(-left, sigma, q)


def connect_the_dots(interval: float, lower: int, deltas: np.ndarray) -> LossPmf:
    """The pessimistic connect-the-dots pmf on the losses k·h, k = lower … lower + n − 1.

    With δᵢ = δ(εᵢ) the mechanism's hockey-stick divergence at εᵢ = (lower + i)·h, the pmf
    pᵢ whose divergence interpolates the δᵢ (Doroshenko et al. 2022, Alg. 1) is
    p₁ = 1 − δ₁ + (δ₂ − δ₁)/(eʰ − 1), pᵢ = ((δᵢ₊₁ − δᵢ) − eʰ(δᵢ − δᵢ₋₁))/(eʰ − 1),
    pₙ = (δₙ − δₙ₋₁)/(e⁻ʰ − 1), with mass δₙ at +∞; the δᵢ are first made non-increasing and
    negative pᵢ (rounding) set to 0. One point: p₁ = 1 − δ₁.
    """
    if len(deltas) == 1:
        return LossPmf(interval, lower, np.array([1 - deltas[0]]), float(deltas[0]))
    deltas = np.minimum.accumulate(deltas)
    steps = np.diff(deltas)
    probs = np.zeros_like(deltas)
    probs[0] = 1 - deltas[0] + steps[0] / math.expm1(interval)
    probs[1:-1] = (steps[1:] - steps[:-1] * math.exp(interval)) / math.expm1(interval)
    probs[-1] = steps[-1] / math.expm1(-interval)
    return LossPmf(interval, lower, np.maximum(0.0, probs), float(deltas[-1]))


def _direction(sigma: float, q: float, interval: float, remove: bool) -> LossPmf:
    """One direction's pmf on the grid from ⌊min loss/h⌋ to ⌈max loss/h⌉."""
    smallest, largest = _loss_range(sigma, q, remove)
    lower, upper = math.floor(smallest / interval), math.ceil(largest / interval)
    epsilons = np.arange(lower, upper + 1) * interval
    return connect_the_dots(interval, lower, _hockey_stick(epsilons, sigma, q, remove))


def subsampled_gaussian_pld(sigma: float, q: float, interval: float) -> Pld:
    """PLD of one release of the q-Poisson-subsampled Gaussian with noise multiplier σ > 0,
    0 < q ≤ 1, at loss interval h (``from_gaussian_mechanism(σ, sampling_prob=q)``)."""
    remove = _direction(sigma, q, interval, remove=True)
    if q == 1.0:
        return Pld((remove,))
    return Pld((remove, _direction(sigma, q, interval, remove=False)))


# -- composition ---------------------------------------------------------------------------------


def log_moments(pmf: LossPmf) -> tuple[np.ndarray, np.ndarray]:
    """(orders t, ln Σᵢ pᵢ·e^(t·i)) at the 40 orders ±1/n … ±20/n (n = len(probs)): the
    index's log-moment-generating function, for the Chernoff bound of ``chernoff_bounds``."""
    length = len(pmf.probs)
    orders = CHERNOFF_ORDERS / length
    index = np.arange(length)
    log_mgfs = np.array([special.logsumexp(index * order, b=pmf.probs) for order in orders])
    return orders, log_mgfs


def chernoff_bounds(moments: tuple, length: int, times: int) -> tuple[int, int]:
    """(lowest, highest) index of the ``times``-fold sum S of pmf indices worth keeping.

    Chernoff: P(S ≥ s) ≤ e^(T·K(t) − t·s) for t > 0 and P(S ≤ s) ≤ the same for t < 0, K the
    log-MGF; each bound is at most ``TAIL_MASS_TRUNCATION``/2 from s = (T·K(t) + ln(2/τ))/t on,
    the tightest over the orders taken (non-finite bounds skipped).
    """
    orders, log_mgfs = moments
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


def self_composed(pmf: LossPmf, moments: tuple, times: int) -> LossPmf:
    """The pmf of the sum of ``times`` independent losses of ``pmf``, by FFT.

    The pmf's transform of length N ≥ the kept support (``scipy.fft.next_fast_len``) raised to
    the T-th power is the T-fold circular convolution; outside the Chernoff bounds at most
    ``TAIL_MASS_TRUNCATION`` is cut, so the kept window does not wrap around. The cut mass and
    1 − (1 − p∞)ᵀ, the chance that some round's loss is infinite, go to +∞.
    """
    lower, upper = chernoff_bounds(moments, len(pmf.probs), times)
    output_len = upper - lower + 1
    fast_len = fft.next_fast_len(max(output_len, len(pmf.probs)))
    convolution = np.real(fft.ifft(fft.fft(pmf.probs, fast_len) ** times))
    probs = np.array(np.roll(convolution, -lower)[:output_len])
    infinity = TAIL_MASS_TRUNCATION - math.expm1(times * math.log1p(-pmf.infinity))
    return LossPmf(pmf.interval, pmf.lower * times + lower, probs, infinity)


def _convolution(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The linear convolution (``scipy.signal.fftconvolve``'s: a real FFT of the next fast
    length; a one-point factor only scales)."""
    if len(first) == 1 or len(second) == 1:
        return first * second
    length = len(first) + len(second) - 1
    fast_len = fft.next_fast_len(length, True)
    product = fft.rfftn(first, [fast_len]) * fft.rfftn(second, [fast_len])
    return fft.irfftn(product, [fast_len])[:length].copy()


def _prefix_within(probs: np.ndarray, mass: float) -> int:
    """The length of the prefix before the running sum first exceeds ``mass`` (FFT rounding
    can leave tiny negative probabilities, so the running sum need not be monotone)."""
    above = np.cumsum(probs) > mass
    return int(np.argmax(above)) if above.any() else len(probs)


def composed(first: LossPmf, second: LossPmf) -> LossPmf:
    """The pmf of the sum of independent losses of ``first`` and ``second``, tails cut.

    The longest prefix and suffix of at most ``TAIL_MASS_TRUNCATION``/2 each are cut; the
    prefix's mass is added to the lowest kept loss, the suffix's goes to +∞ (pessimistic).
    L₁ + L₂ = ∞ with probability p∞₁ + p∞₂ − p∞₁·p∞₂.
    """
    probs = _convolution(first.probs, second.probs)
    half = TAIL_MASS_TRUNCATION / 2
    left = _prefix_within(probs, half)
    right = max(len(probs) - _prefix_within(np.flip(probs), half), left + 1)
    left_mass, right_mass = np.sum(probs[:left]), np.sum(probs[right:])
    kept = probs[left:right]
    kept[0] += left_mass
    infinity = first.infinity + second.infinity - first.infinity * second.infinity
    return LossPmf(first.interval, first.lower + second.lower + left, kept, infinity + right_mass)


def epsilon_for_delta(pmf: LossPmf, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) = p∞ + Σ_{ℓ > ε} p_ℓ·(1 − e^(ε−ℓ)) ≤ ``delta``.

    Scanning the losses from the top, with U = p∞ + Σ p_ℓ and W = Σ p_ℓe^(−ℓ) over the losses
    above the current one, δ(ε) = U − e^ε·W for ε between the current loss and the next one up,
    so the answer is ln((U − δ)/W) at the first loss ℓ (from the top) with ln((U − δ)/W) ≥ ℓ,
    ∞ where p∞ > δ, and 0 where δ(0) ≤ δ. The losses are the top one minus multiples of h
    accumulated one step at a time, as dp-accounting's scan does.
    """
    if pmf.infinity > delta:
        return math.inf
    probs = np.flip(pmf.probs)
    top = pmf.upper * pmf.interval
    losses = np.cumsum(np.concatenate(([top], np.full(len(probs) - 1, -pmf.interval))))
    upper_mass = np.cumsum(np.concatenate(([pmf.infinity], probs)))
    lower_mass = np.cumsum(np.concatenate(([0.0], np.exp(-losses) * probs)))
    reached = (upper_mass[1:] >= delta) & (lower_mass[1:] == 0)
    # A quotient past float range (W denormal, at losses ≳ 700) reads ∞, so the scan stops
    # there with ε = ∞, as dp-accounting's float division does: a bound, loose, not a warning.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        candidate = np.log((upper_mass[:-1] - delta) / lower_mass[:-1])
    stop = (upper_mass[:-1] > delta) & (lower_mass[:-1] > 0) & (candidate >= losses)
    first_stop = int(np.argmax(stop)) if stop.any() else len(probs)
    if reached[:first_stop].any():
        return max(0.0, float(losses[int(np.argmax(reached[:first_stop]))]))
    mass_upper, mass_lower = upper_mass[first_stop], lower_mass[first_stop]
    if mass_upper <= mass_lower + delta:
        return 0.0
    return float(math.log((mass_upper - delta) / mass_lower))
