"""Subsampling-without-replacement RDP and DP-SCAFFOLD's two-level accountant (spec 004 §3)."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from privacy.subsampling_wor import (
    TwoLevelSampleAccountant,
    dpscaffold_delta,
    gaussian_rdp,
    rdp_subsampled_without_replacement,
)

ORDERS = np.arange(2, 101)
SYNTHETIC_DELTA = dpscaffold_delta(100, 4000)

# Table 1 of the paper (M=100, R_train=4000, l=0.05, s=0.2, ε=3): T for K = 1, 5, 10, 20, 40.
TABLE1_T = {
    10: [542, 488, 428, 324, 72],
    20: [545, 502, 451, 352, 83],
    40: [546, 505, 457, 360, 86],
    80: [546, 506, 458, 362, 87],
    160: [546, 506, 458, 362, 87],
}
TABLE1_K = [1, 5, 10, 20, 40]


def _direct_bound(eps: dict[int, float], alpha: int, q: float) -> float:
    """Thm 9 evaluated term by term in plain floats (only safe for small α and ε)."""
    total = 1.0 + q**2 * math.comb(alpha, 2) * min(4 * math.expm1(eps[2]), 2 * math.exp(eps[2]))
    for j in range(3, alpha + 1):
        total += 2 * q**j * math.comb(alpha, j) * math.exp((j - 1) * eps[j])
    return math.log(total) / (alpha - 1)


def test_delta_is_one_over_users_times_train_records():
    assert dpscaffold_delta(100, 4000) == pytest.approx(2.5e-6)
    assert dpscaffold_delta(60, 800) == pytest.approx(1 / 48_000)


def test_gaussian_rdp():
    np.testing.assert_allclose(gaussian_rdp(2.0, np.array([2, 8])), [0.25, 1.0])


@pytest.mark.parametrize("sigma", [10, 20, 40, 80])
def test_table1_max_rounds_match_the_paper_exactly(sigma):
    got = [
        TwoLevelSampleAccountant(100, 0.05, 0.2, k, sigma).max_rounds(3.0, SYNTHETIC_DELTA)
        for k in TABLE1_K
    ]
    assert got == TABLE1_T[sigma]


def test_table1_sigma_160_within_one_round_of_the_paper():
    # spec 004 §3: the re-implementation differs by 1 in three cells of this row
    got = [
        TwoLevelSampleAccountant(100, 0.05, 0.2, k, 160).max_rounds(3.0, SYNTHETIC_DELTA)
        for k in TABLE1_K
    ]
    assert got == [546, 507, 459, 363, 87]
    assert all(abs(a - b) <= 1 for a, b in zip(got, TABLE1_T[160], strict=True))


@pytest.mark.parametrize(
    ("clients", "train_records", "client_rate", "steps", "sigma", "rounds", "expected"),
    [
        (100, 4000, 0.2, 50, 60, 400, 12.91),  # synthetic (paper: 13)
        (100, 4000, 0.05, 50, 60, 400, 4.15),  # synthetic, l=0.05 (paper: 4.2)
        (40, 2000, 0.2, 50, 30, 400, 11.36),  # FEMNIST (paper: 11.4)
        (40, 2000, 0.2, 100, 30, 400, 11.43),  # FEMNIST, K=100 (paper: 11.5)
        (60, 800, 0.2, 50, 30, 100, 7.15),  # MNIST (paper: 7.2)
    ],
)
def test_epsilon_of_the_main_runs(
    clients, train_records, client_rate, steps, sigma, rounds, expected
):
    acc = TwoLevelSampleAccountant(clients, client_rate, 0.2, steps, sigma)
    eps = acc.epsilon(rounds, dpscaffold_delta(clients, train_records))
    assert eps == pytest.approx(expected, abs=0.01)


def test_epsilon_floor_as_sigma_goes_to_infinity():
    # Caveat of spec 004 §3, asserted as documentation: the bound does not vanish with σ.
    huge = TwoLevelSampleAccountant(100, 0.2, 0.2, 50, 1e6).epsilon(400, SYNTHETIC_DELTA)
    paper = TwoLevelSampleAccountant(100, 0.2, 0.2, 50, 60).epsilon(400, SYNTHETIC_DELTA)
    assert huge == pytest.approx(12.90, abs=0.01)
    assert paper - huge < 0.01
    # one level with ε ≡ 0: the limit (1/(α−1))·log(1 + 2·Σ_{j≥3} q^j·C(α, j))
    q, orders = 0.2, np.arange(2, 30)
    limit = [
        math.log(1 + 2 * sum(q**j * math.comb(a, j) for j in range(3, a + 1))) / (a - 1)
        for a in orders
    ]
    got = rdp_subsampled_without_replacement(np.zeros(orders.max() - 1), orders, q)
    np.testing.assert_allclose(got, limit, rtol=1e-12)
    assert np.all(got[1:] > 0)


@pytest.mark.parametrize("q", [0.01, 0.2, 0.7, 1.0])
@pytest.mark.parametrize("sigma", [0.8, 3.0])
def test_bound_matches_the_formula_term_by_term(q, sigma):
    orders = np.arange(2, 21)
    base = gaussian_rdp(sigma, orders)
    eps = {int(a): float(e) for a, e in zip(orders, base, strict=True)}
    expected = [_direct_bound(eps, int(a), q) for a in orders]
    got = rdp_subsampled_without_replacement(base, orders, q)
    np.testing.assert_allclose(got, expected, rtol=1e-10)


def test_full_sampling_is_not_below_the_base_mechanism():
    for sigma in [0.1, 1.0, 10.0, 100.0]:
        base = gaussian_rdp(sigma, ORDERS)
        bound = rdp_subsampled_without_replacement(base, ORDERS, 1.0)
        assert bound[0] >= base[0]  # α = 2
        assert np.all(bound >= base)


def test_bound_increases_with_q():
    base = gaussian_rdp(2.0, ORDERS)
    grid = np.linspace(0.0, 1.0, 21)
    curves = np.stack([rdp_subsampled_without_replacement(base, ORDERS, q) for q in grid])
    assert np.all(curves[0] == 0.0)
    assert np.all(np.diff(curves, axis=0) > 0)


def test_orders_may_be_any_subset_and_large_values_do_not_overflow():
    base = gaussian_rdp(0.5, ORDERS)  # ε(100) = 200: e^{99·200} overflows without log space
    full = rdp_subsampled_without_replacement(base, ORDERS, 0.3)
    assert np.all(np.isfinite(full))
    subset = rdp_subsampled_without_replacement(base, np.array([50, 3, 100]), 0.3)
    np.testing.assert_array_equal(subset, full[[48, 1, 98]])
    with_inf = base.copy()
    with_inf[10:] = np.inf  # ε(j) = ∞ for j ≥ 12
    out = rdp_subsampled_without_replacement(with_inf, ORDERS, 0.3)
    np.testing.assert_array_equal(out[:10], full[:10])
    assert np.all(np.isposinf(out[10:]))


def test_invalid_inputs_are_rejected():
    base = gaussian_rdp(1.0, ORDERS)
    with pytest.raises(ValueError):
        rdp_subsampled_without_replacement(base, np.array([1, 2]), 0.1)
    with pytest.raises(ValueError):
        rdp_subsampled_without_replacement(base, np.array([2.5]), 0.1)
    with pytest.raises(ValueError):
        rdp_subsampled_without_replacement(base[:5], ORDERS, 0.1)
    with pytest.raises(ValueError):
        rdp_subsampled_without_replacement(base, ORDERS, 1.5)
    with pytest.raises(ValueError):
        TwoLevelSampleAccountant(100, 0.0, 0.2, 1, 10.0)


def test_epsilon_grows_with_rounds_and_max_rounds_is_the_boundary():
    acc = TwoLevelSampleAccountant(100, 0.05, 0.2, 10, 10.0)
    eps = [acc.epsilon(t, SYNTHETIC_DELTA) for t in (0, 1, 100, 400, 800)]
    assert eps[0] == 0.0
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False))
    t = acc.max_rounds(3.0, SYNTHETIC_DELTA)
    assert acc.epsilon(t, SYNTHETIC_DELTA) <= 3.0 < acc.epsilon(t + 1, SYNTHETIC_DELTA)
    assert acc.max_rounds(3.0, SYNTHETIC_DELTA, limit=100) == 100
    assert acc.max_rounds(1e-3, SYNTHETIC_DELTA) == 0


def test_privacy_package_imports_neither_ray_nor_mlflow():
    code = (
        "import sys, privacy.subsampling_wor; "
        "assert not {'ray', 'mlflow', 'scipy'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
