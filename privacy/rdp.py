"""RDP of the Poisson-subsampled Gaussian and its (ε, δ) conversion, in NumPy/SciPy.

Opacus 1.6's ``opacus.accountants.analysis.rdp`` (itself TF Privacy's ``rdp_accountant``,
Apache 2.0; Mironov, Talwar & Zhang 2019, §3.3) step for step — same sums in the same order,
so the values are Opacus's (``tests/test_privacy_numpy.py`` checks them to 1e-10 relative) —
without importing Opacus, whose package imports torch (seconds): the privacy calculator and
the PLD/PRV accountants' RDP guards need only this.

- ``subsampled_gaussian_rdp(q, σ, orders)``: ε(α) of one release at each order (Opacus's
  ``compute_rdp`` with ``steps=1``);
- ``epsilon_from_rdp(orders, rdp, δ)``: Balle et al. 2020, Thm 21 (Opacus's
  ``get_privacy_spent``), minimised over the orders;
- ``ORDERS``: Opacus's ``RDPAccountant.DEFAULT_ALPHAS``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def _log_add(logx: float, logy: float) -> float:
    """log(e^x + e^y)."""
    a, b = min(logx, logy), max(logx, logy)
    if a == -np.inf:
        return b
    return math.log1p(math.exp(a - b)) + b


def _log_sub(logx: float, logy: float) -> float:
    """log(e^x − e^y), x ≥ y."""
    if logx < logy:
        raise ValueError("The result of subtraction must be non-negative.")
    if logy == -np.inf:
        return logx
    if logx == logy:
        return -np.inf
    try:
        return math.log(math.expm1(logx - logy)) + logy
    except OverflowError:
        return logx


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    """log A_α for an integer α: a binomial sum."""
    log_a = -np.inf
    for i in range(alpha + 1):
        log_binom = math.log(special.binom(alpha, i))
        log_coef = log_binom + i * math.log(q) + (alpha - i) * math.log(1 - q)
        log_a = _log_add(log_a, log_coef + (i * i - i) / (2 * (sigma**2)))
    return float(log_a)


def _log_erfc(x: float) -> float:
    return math.log(2) + special.log_ndtr(-x * 2**0.5)


def _log_a_frac(q: float, sigma: float, alpha: float) -> float:
    """log A_α for a fractional α: the two integrals over (−∞, z₀] and [z₀, ∞), series
    summed until their terms fall below e^−30."""
    log_a0, log_a1 = -np.inf, -np.inf
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    i = 0
    while True:
        coef = special.binom(alpha, i)
        log_coef = math.log(abs(coef))
        j = alpha - i
        log_t0 = log_coef + i * math.log(q) + j * math.log(1 - q)
        log_t1 = log_coef + j * math.log(q) + i * math.log(1 - q)
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * (sigma**2)) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * (sigma**2)) + log_e1
        combine = _log_add if coef > 0 else _log_sub
        log_a0, log_a1 = combine(log_a0, log_s0), combine(log_a1, log_s1)
        i += 1
        if max(log_s0, log_s1) < -30:
            return _log_add(log_a0, log_a1)


def validated(noise_multiplier: float, sample_rate: float, rounds: int = 1) -> tuple:
    """(σ, q, rounds) as (float, float, int), or ValueError for values no accountant accepts
    (a NaN or infinite σ or q would never end ``_log_a_frac``'s series)."""
    sigma, q = float(noise_multiplier), float(sample_rate)
    if not (sigma >= 0.0 and math.isfinite(sigma)):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
    if int(rounds) != rounds or rounds < 0:
        raise ValueError(f"rounds must be a non-negative integer, got {rounds}")
    return sigma, q, int(rounds)


def validated_delta(delta: float) -> float:
    """δ as a float, or ValueError outside (0, 1) (NaN included): no (ε, δ) bound has one."""
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return float(delta)


def _order_rdp(q: float, sigma: float, alpha: float) -> float:
    if q == 0:
        return 0.0
    if sigma == 0:
        return np.inf
    if q == 1.0:
        return alpha / (2 * sigma**2)
    if np.isinf(alpha):
        return np.inf
    if float(alpha).is_integer():
        return _log_a_int(q, sigma, int(alpha)) / (alpha - 1)
    return _log_a_frac(q, sigma, alpha) / (alpha - 1)


def subsampled_gaussian_rdp(sample_rate: float, noise_multiplier: float, orders) -> np.ndarray:
    """RDP ε(α) of one Poisson-subsampled Gaussian release (rate q, multiplier σ) at each
    order, add/remove-one adjacency; ∞ where σ = 0 < q."""
    noise_multiplier, sample_rate, _ = validated(noise_multiplier, sample_rate)
    return np.array([_order_rdp(sample_rate, noise_multiplier, a) for a in orders], np.float64)


@lru_cache(maxsize=256)
def round_rdp(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """``subsampled_gaussian_rdp`` at ``ORDERS``, cached per (σ, q)."""
    return subsampled_gaussian_rdp(sample_rate, noise_multiplier, ORDERS)


def epsilon_from_rdp(orders, rdp, delta: float) -> float:
    """(ε, δ) from an RDP curve, Balle et al. 2020 Thm 21, minimised over the orders (∞
    where every order is; at least 0: the bound can dip below where a curve is near 0, and no
    mechanism has ε < 0)."""
    delta = validated_delta(delta)
    alphas = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    curve = np.atleast_1d(np.asarray(rdp, dtype=np.float64))
    if alphas.shape != curve.shape:
        raise ValueError(f"orders and rdp differ in length: {alphas.size} and {curve.size}")
    eps = curve - (np.log(delta) + np.log(alphas)) / (alphas - 1) + np.log((alphas - 1) / alphas)
    if np.isnan(eps).all():
        return math.inf
    return max(0.0, float(eps[np.nanargmin(eps)]))


def rdp_epsilon(history, delta: float) -> float:
    """RDP upper bound on ε after a (σ, q, rounds) history (cached per-(σ, q) curves)."""
    curve = sum((rounds * round_rdp(s, q) for s, q, rounds in history), np.zeros(len(ORDERS)))
    return epsilon_from_rdp(ORDERS, curve, delta)
