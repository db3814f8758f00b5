"""ε against a server that sees every client's upload and knows which clients were sampled.

Under client-placed noise each client of a round adds its share of the noise, N(0, σ_c²S²) with
σ_c = σ/√C_n (C_n the cohort the noise is sized for). The sum's ε (the run's ``epsilon``) holds
against an observer of the sum only (secure aggregation, honest clients). A server that sees
each upload faces one Gaussian mechanism per participation, with multiplier σ_c and no
amplification by sampling within a round: it knows the cohort.

Participation does not depend on the data: a client takes part in n ~ Binomial(T, q) of T
rounds. Given n, its uploads are an adaptive composition of n Gaussian mechanisms with
sensitivity Δ and noise std σ_c·S, which is exactly μ-GDP with μ = √n·Δ/(σ_c·S) (Dong, Roth &
Su 2019, Cor. 3.3). The privacy profile of μ-GDP is the Gaussian mechanism's
(Balle & Wang 2018, Thm 8)

    δ_μ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2),

and by joint convexity of the hockey-stick divergence over the data-independent participation

    δ(ε) = Σ_n Binom(n; T, q) · δ_{√n·μ₁}(ε),

which is solved for ε by bisection (δ is decreasing in ε). Cost: O(T) per evaluation.

Adjacency: the server sees who takes part, so removing a participant is not a neighbour it
could fail to notice; the neighbour is the client's data replaced. ``sensitivity_factor`` 1 is
*zero-out* (its update replaced by zero, Δ = S; the analogue of add/remove), 2 is replace-one
(Δ = 2S).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr


def gaussian_delta(epsilon: float, mu: np.ndarray) -> np.ndarray:
    """δ(ε) of μ-GDP (the Gaussian mechanism with sensitivity/std = μ), elementwise in μ."""
    mu = np.asarray(mu, dtype=np.float64)
    out = np.zeros_like(mu)
    pos = mu > 0
    m = mu[pos]
    first = np.exp(log_ndtr(-epsilon / m + m / 2))
    second = np.exp(epsilon + log_ndtr(-epsilon / m - m / 2))
    out[pos] = np.clip(first - second, 0.0, 1.0)
    return out


def participation_delta(
    epsilon: float, noise_multiplier: float, sample_rate: float, rounds: int, factor: float = 1.0
) -> float:
    """δ(ε) of T rounds, participation n ~ Binomial(T, q), μ = √n·factor/σ_c per client."""
    # Imported here, not at module level: scipy.stats takes 1.1-1.3 s to import (``python -X
    # importtime``), which every run would pay at start-up (cluster.claims imports this module)
    # though only runs with client-placed noise call this function.
    from scipy.stats import binom

    n = np.arange(rounds + 1)
    weights = binom.pmf(n, rounds, sample_rate)
    mu = np.sqrt(n) * factor / noise_multiplier
    return float(np.dot(weights, gaussian_delta(epsilon, mu)))


def smallest_epsilon(delta_of, delta: float, tolerance: float = 1e-6) -> float:
    """The smallest ε ≥ 0 (to ``tolerance``, rounded up) with ``delta_of(ε)`` ≤ δ, for a
    decreasing ``delta_of``; inf beyond 1e6."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if delta_of(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            return math.inf
    while hi - lo > tolerance * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if delta_of(mid) <= delta else (mid, hi)
    return hi


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of one Gaussian release with sensitivity/std = μ (exact, Balle & Wang 2018)."""
    return smallest_epsilon(lambda eps: float(gaussian_delta(eps, np.array([mu]))[0]), delta)


def epsilon_vs_server(
    noise_multiplier: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    sensitivity_factor: float = 1.0,
) -> float:
    """ε after ``rounds`` rounds against a server that sees each upload (module docstring)."""
    if rounds == 0 or sample_rate == 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    return smallest_epsilon(
        lambda eps: participation_delta(
            eps, noise_multiplier, sample_rate, rounds, sensitivity_factor
        ),
        delta,
    )
