import pytest

from privacy.calibration import calibrate_sigma, epsilon_for, max_rounds


@pytest.mark.parametrize(
    ("target", "q", "rounds"), [(8.0, 0.1, 300), (2.0, 0.01, 1000), (4.0, 0.06, 300)]
)
def test_calibrated_sigma_round_trips_within_2_percent(target, q, rounds):
    sigma = calibrate_sigma(target, 1e-5, q, rounds)
    eps = epsilon_for(sigma, q, rounds, 1e-5)
    assert 0.98 * target <= eps <= target


def test_dpfedsam_budget_readings_of_spec_000():
    # spec 000 §3: at σ=0.95, q=0.1, δ=0.002, ε = 4/6/8/10 is reached at T ≈ 48/106/180/264
    found = [max_rounds(0.95, 0.1, 0.002, eps) for eps in (4, 6, 8, 10)]
    for got, expected in zip(found, (48, 106, 180, 264), strict=True):
        assert abs(got - expected) <= 2, found


def test_max_rounds_is_the_exact_boundary():
    t = max_rounds(1.0, 0.05, 1e-5, 3.0)
    assert epsilon_for(1.0, 0.05, t, 1e-5) <= 3.0 < epsilon_for(1.0, 0.05, t + 1, 1e-5)
    assert max_rounds(0.3, 1.0, 1e-5, 0.5) == 0
    assert max_rounds(50.0, 0.001, 1e-5, 10.0, limit=1000) == 1000


def test_unreachable_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="raise the budget"):
        calibrate_sigma(1e-4, 1e-9, 1.0, 10**6, sigma_max=10.0)
