"""ε of composed Poisson-subsampled Gaussians by PRV composition, in NumPy/SciPy.

Opacus 1.6's ``PRVAccountant.get_epsilon`` (Gopi, Lee & Wutschitz 2021, after
microsoft/prv_accountant; Apache 2.0) step for step, so that the values are Opacus's
(``tests/test_privacy_numpy.py``), without importing Opacus, whose package imports torch:

1. the domain [−L, L]: L from the RDP bounds of the whole history at δ_err/4 and of each
   single round at δ_err/(8T), at least ``eps_error``, plus 3; mesh eps_error/√(T·log(12/δ_err)/2);
2. each run's privacy loss random variable, truncated to the domain, discretised from its cdf
   (Gopi et al. Prop. B4) and shifted so that its mean is the continuous one;
3. each run self-composed T_i times by FFT, the runs convolved pairwise;
4. ε read off the composed pmf at δ − δ_err, plus ``eps_error`` (the upper end of the
   estimate's interval).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import integrate
from scipy.fft import irfft, rfft
from scipy.special import erfc

from privacy.rdp import rdp_epsilon

_SQRT2 = np.sqrt(2)


def domain_half_width(history, eps_error: float, delta_error: float) -> float:
    """L of the discretisation domain [−L, L] (opacus's ``compute_safe_domain_size``)."""
    total = sum(rounds for _, _, rounds in history)
    half_width = rdp_epsilon(history, delta_error / 4)
    for sigma, q, _ in history:
        half_width = max(half_width, rdp_epsilon(((sigma, q, 1),), delta_error / (8 * total)))
    return max(half_width, eps_error) + 3


def mesh_size(history, eps_error: float, delta_error: float) -> float:
    total = sum(rounds for _, _, rounds in history)
    return eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)


def _prv_cdf(q: float, sigma: float, t):
    """cdf of one Poisson-subsampled Gaussian's privacy loss (Gopi et al. Prop. B4)."""
    above = t > np.log(1 - q)
    z = np.log(np.where(above, (np.exp(t) + q - 1) / q, 1))
    return np.where(
        above,
        -q * erfc((2 * z * sigma**2 - 1) / (2 * _SQRT2 * sigma)) / 2
        - (1 - q) * erfc((2 * z * sigma**2 + 1) / (2 * _SQRT2 * sigma)) / 2
        + 1.0,
        0.0,
    )


def _truncated_cdf(q: float, sigma: float, t_min: float, t_max: float):
    """The cdf of the privacy loss conditioned on [t_min, t_max)."""
    low = _prv_cdf(q, sigma, t_min)
    mass = _prv_cdf(q, sigma, t_max) - low

    def cdf(t):
        inside = np.where(t < t_max, (_prv_cdf(q, sigma, t) - low) / mass, 1.0)
        return np.where(t < t_min, 0.0, inside)

    return cdf


def _mean(cdf, t_min: float, t_max: float) -> float:
    """∫ t dF by parts on opacus's pieces (log-spaced towards 0 on both sides)."""
    lower, upper = int(np.log10(np.abs(t_min))), int(np.log10(t_max))
    points = np.concatenate(
        [
            [t_min],
            -np.logspace(start=lower, stop=-5, num=10),
            [0],
            np.logspace(start=-5, stop=upper, num=10),
            [t_max],
        ]
    )
    mean = 0.0
    for left, right in zip(points[:-1], points[1:], strict=True):
        integral, _ = integrate.quad(cdf, left, right, limit=500)
        mean += right * cdf(right) - left * cdf(left) - integral
    return mean


class _Grid:
    """An even number of points t_min + i·dt (opacus's ``Domain``), and its total shift."""

    def __init__(self, t_min: float, t_max: float, size: int, shifts: float = 0.0) -> None:
        self.t_min, self.t_max, self.size, self.shifts = t_min, t_max, size, shifts

    @classmethod
    def aligned(cls, half_width: float, dt: float) -> _Grid:
        t_min, t_max = np.floor(-half_width / dt) * dt, np.ceil(half_width / dt) * dt
        size = int(np.round((t_max - t_min) / dt)) + 1
        if size % 2 == 1:
            size, t_max = size + 1, t_max + dt
        return cls(t_min, t_max, size)

    @property
    def dt(self) -> float:
        return (self.t_max - self.t_min) / (self.size - 1)

    @property
    def ts(self) -> np.ndarray:
        return np.linspace(self.t_min, self.t_max, self.size)

    def shifted(self, dt: float) -> _Grid:
        return _Grid(self.t_min + dt, self.t_max + dt, self.size, self.shifts + dt)


def _discretised(q: float, sigma: float, grid: _Grid) -> tuple[np.ndarray, _Grid]:
    """The truncated privacy loss's pmf on ``grid``, and the grid shifted to keep its mean."""
    cdf = _truncated_cdf(q, sigma, grid.t_min, grid.t_max)
    pmf = cdf(grid.ts + grid.dt / 2) - cdf(grid.ts - grid.dt / 2)
    shift = _mean(cdf, grid.t_min, grid.t_max) - np.dot(grid.ts, pmf)
    if np.abs(shift) >= grid.dt / 2:
        raise RuntimeError("Discrete mean differs significantly from continuous mean.")
    return pmf, grid.shifted(shift)


def _self_composed(pmf: np.ndarray, grid: _Grid, times: int) -> tuple[np.ndarray, _Grid]:
    composed = irfft(rfft(pmf) ** times)
    roll = times - 1 + (len(composed) // 2 if times % 2 == 0 else 0)
    return np.roll(composed, roll), grid.shifted(grid.shifts * (times - 1))


def _convolved(parts: list[tuple[np.ndarray, _Grid]]) -> tuple[np.ndarray, _Grid]:
    """Neighbours convolved pairwise until one is left (an odd last one waits a level)."""
    if len(parts) == 1:
        return parts[0]
    # Imported here: scipy.signal imports scipy.stats (~1 s of CPU), which a history of one
    # run (the privacy calculator's) never needs.
    from scipy.signal import convolve

    while len(parts) > 1:
        level = [parts.pop()] if len(parts) % 2 == 1 else []
        for (left, grid), (right, other) in zip(parts[:-1:2], parts[1::2], strict=True):
            level.append((convolve(left, right, mode="same"), grid.shifted(other.shifts)))
        parts = level
    return parts[0]


def _epsilon_at(pmf: np.ndarray, ts: np.ndarray, delta: float) -> float:
    """The smallest ε whose δ(ε) on the discrete privacy loss is at most ``delta``."""
    d1 = np.flip(np.flip(pmf).cumsum())
    d2 = np.flip(np.flip(pmf * np.exp(-ts)).cumsum())
    i = np.searchsorted(np.exp(ts) * d2 - d1, -delta, side="left")
    if i <= 0:
        raise RuntimeError("Cannot compute epsilon")
    return float(np.log((d1[i] - delta) / d2[i]))


def prv_epsilon(history, delta: float, eps_error: float = 0.01) -> float:
    """Upper bound on ε at δ after a (σ, q, rounds) history of runs with q > 0 and rounds > 0:
    the estimate + ``eps_error``, with δ_err = δ/1000 (``PRVAccountant.get_epsilon``)."""
    if delta <= 0:
        return math.inf
    delta_error = delta / 1000
    half_width = domain_half_width(history, eps_error, delta_error)
    grid = _Grid.aligned(half_width, mesh_size(history, eps_error, delta_error))
    parts = [_self_composed(*_discretised(q, sigma, grid), rounds) for sigma, q, rounds in history]
    pmf, composed = _convolved(parts)
    if np.finfo(np.longdouble).eps * composed.size > delta - delta_error:
        raise ValueError(
            "Floating point errors will dominate for such small values of delta. "
            "Increase delta or reduce domain size."
        )
    # ε ≥ 0 by definition; the estimate's own value is negative where δ exceeds what the
    # mechanism needs even at ε = 0 (a review: −0.674 at δ = 0.5, σ=1, q=0.01, T=1000).
    return max(0.0, _epsilon_at(pmf, composed.ts, delta - delta_error) + eps_error)


def grid_points(history, eps_error: float, delta_error: float) -> int:
    """Size of the grid ``prv_epsilon`` discretises ``history`` on (checked before it runs)."""
    half_width = domain_half_width(history, eps_error, delta_error)
    if not math.isfinite(half_width):
        return np.iinfo(np.int64).max
    return int(2 * math.ceil(half_width / mesh_size(history, eps_error, delta_error))) + 2
