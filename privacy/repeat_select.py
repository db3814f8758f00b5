"""RDP curves and a random number of trials: the arithmetic under ``privacy.tuning``.

``summed_curve`` composes RDP curves (the sum on their common orders), ``max_curve`` bounds
several by their pointwise maximum. A search that runs a random number K of trials, K drawn
independently of the data from a Poisson or a truncated negative binomial distribution
(Papernot & Steinke, ICLR 2022), and outputs only the best: ``draw_num_trials`` draws K,
``expected_num_trials`` is E[K], and ``repeat_and_select_rdp`` is the RDP of that output from
one trial's curve (Thm 2 for the truncated negative binomial, Thm 6 for Poisson; the formulas
are in ``privacy.tuning``'s docstring).
"""

from __future__ import annotations

import math

import numpy as np

DISTRIBUTIONS = ("poisson", "truncated_negative_binomial")


def summed_curve(curves) -> tuple[np.ndarray, np.ndarray]:
    """The sum of RDP curves on their common orders (composition)."""
    orders = curves[0][0]
    for other, _ in curves[1:]:
        orders = np.intersect1d(orders, other)
    if orders.size == 0:
        raise ValueError("the trials' RDP curves share no order")
    total = np.zeros(orders.size)
    for own, values in curves:
        total = total + values[np.searchsorted(own, orders)]
    return orders, total


def max_curve(curves) -> tuple[np.ndarray, np.ndarray]:
    """The pointwise maximum of RDP curves on their common orders."""
    orders, _ = summed_curve(curves)
    stacked = np.stack([values[np.searchsorted(own, orders)] for own, values in curves])
    return orders, stacked.max(axis=0)


def check_num_trials_distribution(distribution: dict) -> None:
    """ValueError naming the field, value and fix of a malformed distribution of the number
    of trials: ``{"kind": "poisson", "mean": μ ≥ 1}`` or ``{"kind":
    "truncated_negative_binomial", "eta": η > −1, "gamma": γ ∈ (0, 1)}``."""
    if not isinstance(distribution, dict):
        raise ValueError(
            f"num_trials_distribution = {distribution!r}: must be a mapping, e.g. "
            '{"kind": "poisson", "mean": 4}'
        )
    kind = distribution.get("kind")
    expected = {
        "poisson": {"kind", "mean"},
        "truncated_negative_binomial": {"kind", "eta", "gamma"},
    }
    if kind not in expected:
        raise ValueError(
            f"num_trials_distribution.kind = {kind!r}: must be one of {', '.join(DISTRIBUTIONS)}"
        )
    if set(distribution) != expected[kind]:
        raise ValueError(
            f"num_trials_distribution = {distribution!r}: {kind} takes exactly the keys "
            f"{', '.join(sorted(expected[kind]))}"
        )
    checks = {
        # μ ≥ 1, as dp-accounting's RepeatAndSelectDpEvent requires
        "mean": (lambda v: 1 <= v < math.inf, "must be a finite number >= 1, e.g. 4"),
        "eta": (lambda v: -1 < v < math.inf, "must be a finite number > -1 (1: geometric)"),
        "gamma": (lambda v: 0 < v < 1, "must be in (0, 1), e.g. 0.2"),
    }
    for name in expected[kind] - {"kind"}:
        value = distribution[name]
        test, fix = checks[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not test(value):
            raise ValueError(f"num_trials_distribution.{name} = {value!r}: {fix}")


def describe(distribution: dict) -> str:
    if distribution["kind"] == "poisson":
        return f"Poisson(μ = {distribution['mean']:g})"
    return (
        f"a truncated negative binomial (η = {distribution['eta']:g}, "
        f"γ = {distribution['gamma']:g}, E[K] = {expected_num_trials(distribution):.4g})"
    )


def expected_num_trials(distribution: dict) -> float:
    """E[K]: μ (Poisson); η(1 − γ)/(γ(1 − γ^η)), or (1/γ − 1)/log(1/γ) at η = 0 (truncated
    negative binomial, Papernot & Steinke 2022, Def. 1)."""
    if distribution["kind"] == "poisson":
        return float(distribution["mean"])
    eta, gamma = float(distribution["eta"]), float(distribution["gamma"])
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


def draw_num_trials(distribution: dict, rng: np.random.Generator) -> int:
    """K drawn from ``distribution`` with ``rng``: Poisson(μ), or the truncated negative
    binomial by inversion of its cdf (P[K = 1] = (1 − γ)·η/(γ^(−η) − 1), or (1 − γ)/log(1/γ)
    at η = 0; P[K = k + 1] = P[K = k]·(1 − γ)·(k + η)/(k + 1))."""
    check_num_trials_distribution(distribution)
    if distribution["kind"] == "poisson":
        return int(rng.poisson(distribution["mean"]))
    eta, gamma = float(distribution["eta"]), float(distribution["gamma"])
    if eta == 0:
        pmf = (1 - gamma) / math.log(1 / gamma)
    else:
        pmf = (1 - gamma) * eta / math.expm1(-eta * math.log(gamma))
    u, k, cdf = rng.random(), 1, pmf
    while cdf < u:
        pmf *= (1 - gamma) * (k + eta) / (k + 1)
        k += 1
        cdf += pmf
    return k


def repeat_and_select_rdp(orders, rdp, distribution: dict) -> np.ndarray:
    """ε'(λ) at every order > 1 (inf at the others) of the best of K runs of a mechanism with
    RDP curve ``rdp``: Thm 2 (truncated negative binomial) or Thm 6 (Poisson), module
    docstring; then lowered to the least ε' at any larger order (RDP is monotone in λ)."""
    order = np.argsort(orders)
    orders = np.asarray(orders, dtype=np.float64)[order]
    rdp = np.asarray(rdp, dtype=np.float64)[order]
    mean = expected_num_trials(distribution)
    above = orders > 1
    out = np.full(orders.size, np.inf)
    if distribution["kind"] == "poisson":
        # Imported here, not at module level: dp-accounting's import costs ~2.7 s at every
        # run's start-up (privacy.sample_level).
        from dp_accounting.rdp.rdp_privacy_accountant import compute_delta

        for i in np.flatnonzero(above):
            eps_hat = math.log1p(1 / (orders[i] - 1))
            delta_hat, _ = compute_delta(orders, rdp, eps_hat)
            out[i] = rdp[i] + mean * delta_hat + math.log(mean) / (orders[i] - 1)
    else:
        eta, gamma = float(distribution["eta"]), float(distribution["gamma"])
        hat = orders >= 1
        constant = (1 + eta) * np.min(
            (1 - 1 / orders[hat]) * rdp[hat] + math.log(1 / gamma) / orders[hat]
        )
        out[above] = rdp[above] + constant + math.log(mean) / (orders[above] - 1)
    lowered = np.minimum.accumulate(out[::-1])[::-1]
    return lowered[np.argsort(order)]  # in the caller's order
