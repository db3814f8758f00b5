import pytest

from privacy.accountant import RdpAccountant


def test_dpfedsam_setting_gives_eps_8_5_after_200_rounds():
    # spec 000 §3: σ=0.95, q=0.1, δ=1/M=0.002, T=200 → ε ≈ 8.51 (Balle et al. conversion)
    acc = RdpAccountant()
    acc.step(0.95, 0.1, rounds=200)
    assert acc.epsilon(0.002) == pytest.approx(8.51, rel=0.01)
    assert acc.rounds == 200
    acc.step(0.95, 0.1, rounds=100)
    assert acc.epsilon(0.002) == pytest.approx(10.80, rel=0.01)  # T = 300


def test_epsilon_grows_with_rounds_and_q_and_falls_with_sigma():
    def eps(sigma, q, rounds):
        a = RdpAccountant()
        a.step(sigma, q, rounds)
        return a.epsilon(1e-5)

    assert eps(1.0, 0.1, 100) < eps(1.0, 0.1, 200)
    assert eps(1.0, 0.05, 100) < eps(1.0, 0.1, 100)
    assert eps(2.0, 0.1, 100) < eps(1.0, 0.1, 100)


def test_epsilon_after_does_not_compose_and_state_round_trips():
    acc = RdpAccountant()
    acc.step(1.0, 0.2, rounds=10)
    peek = acc.epsilon_after(1.0, 0.2, 1e-3)
    assert acc.rounds == 10
    restored = RdpAccountant()
    restored.load_state_dict(acc.state_dict())
    assert restored.epsilon(1e-3) == acc.epsilon(1e-3)
    restored.step(1.0, 0.2)
    assert restored.epsilon(1e-3) == pytest.approx(peek)


def test_matches_opacus_reference_and_composes_heterogeneous_rounds():
    from opacus.accountants import RDPAccountant as OpacusRDP

    ours, reference = RdpAccountant(), OpacusRDP()
    for sigma, q, rounds in [(1.1, 0.05, 30), (0.8, 0.1, 20), (1.1, 0.05, 10)]:
        ours.step(sigma, q, rounds)
        for _ in range(rounds):
            reference.step(noise_multiplier=sigma, sample_rate=q)
    assert ours.rounds == 60
    assert ours.epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize(
    ("q", "rounds", "delta", "classic", "balle"),
    [  # spec 001 §3 (rdp_check.py, integer orders 2..256): the classic and the Balle columns
        (0.04, 1000, 1 / 3400, (2.85, 1.62, 1.23, 1.04), (2.38, 1.46, 1.15, 0.98)),
        (0.06, 300, 1 / 1000, (2.26, 1.36, 1.07, 0.92), None),
    ],
)
def test_classic_rdp_conversion_reproduces_the_blur_specs_sigma_column(
    q, rounds, delta, classic, balle
):
    """``rdp_classic`` converts with Mironov's Prop. 3 (the moments accountant's bound), the
    reading the BLUR+LUS spec calls its main one; ``rdp`` with Balle et al.'s, its other
    column. Both within the spec's ±5% (its script uses integer orders, we Opacus's)."""
    from privacy.accountant import ClassicRdpAccountant, accountant_class
    from privacy.calibration import calibrate_sigma, epsilon_for

    assert accountant_class("rdp_classic") is ClassicRdpAccountant
    for target, expected in zip((2, 4, 6, 8), classic, strict=True):
        sigma = calibrate_sigma(target, delta, q, rounds, ClassicRdpAccountant)
        assert sigma == pytest.approx(expected, rel=0.05)
        # The classic bound is looser: at the same σ it gives the larger ε.
        loose = epsilon_for(sigma, q, rounds, delta, ClassicRdpAccountant)
        assert loose > epsilon_for(sigma, q, rounds, delta, RdpAccountant)
    for target, expected in zip((2, 4, 6, 8), balle or (), strict=False):
        assert calibrate_sigma(target, delta, q, rounds, RdpAccountant) == pytest.approx(
            expected, rel=0.05
        )


def test_the_specs_other_reference_epsilons_and_sigma_readings():
    """Spec 000 §3 and §7 (DP-FedSAM's accountant: RDP at fractional orders, Balle et al.'s
    conversion): ε ≈ 10.80 at T = 300, 7.77 at δ = 5e-3 (the authors' repo example); spec 003
    (DP-FedPGN, σ = 0.8): ε ≈ 15.5 at R = 300 and 8.3 at R = 100. Both specs' σ for ε = 4/6/8/10
    at T = 300 (1.70/1.31/1.15/1.00) are read at integer orders 2..256: Opacus's grid, finer
    below 11, gives σ at most 3.5% below them, never above."""
    from privacy.calibration import calibrate_sigma, epsilon_for

    assert epsilon_for(0.95, 0.1, 300, 0.002, RdpAccountant) == pytest.approx(10.80, rel=0.01)
    assert epsilon_for(0.95, 0.1, 200, 5e-3, RdpAccountant) == pytest.approx(7.77, rel=0.01)
    assert epsilon_for(0.8, 0.1, 300, 0.002, RdpAccountant) == pytest.approx(15.5, rel=0.01)
    assert epsilon_for(0.8, 0.1, 100, 0.002, RdpAccountant) == pytest.approx(8.3, rel=0.01)
    for target, integer_orders in zip((4, 6, 8, 10), (1.70, 1.31, 1.15, 1.00), strict=True):
        sigma = calibrate_sigma(target, 0.002, 0.1, 300, RdpAccountant)
        assert integer_orders * 0.965 <= sigma <= integer_orders


def test_without_sampling_one_round_is_the_gaussian_mechanisms_rdp():
    """q = 1: the subsampled Gaussian's RDP is the Gaussian's, α/(2σ²), at every order."""
    import numpy as np

    from privacy.rdp import ORDERS, round_rdp

    np.testing.assert_allclose(round_rdp(1.7, 1.0), np.asarray(ORDERS) / (2 * 1.7**2), rtol=1e-12)
