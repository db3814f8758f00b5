"""ε against a server that sees each upload: the participation mixture of Gaussian mechanisms."""

import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from cluster.cli.main import main
from privacy.participation import epsilon_vs_server, gaussian_epsilon, participation_delta


@pytest.mark.parametrize(("sigma", "rounds"), [(1.0, 1), (2.0, 10), (5.0, 50)])
def test_full_participation_is_the_composed_gaussian_of_dp_accounting(sigma, rounds):
    # q = 1: every round is one Gaussian release; T of them are one with σ/√T (GDP, exact).
    pld = pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=1e-4
    ).self_compose(rounds)
    reference = pld.get_epsilon_for_delta(1e-5)
    assert epsilon_vs_server(sigma, 1.0, rounds, 1e-5) == pytest.approx(reference, rel=2e-3)
    assert gaussian_epsilon(rounds**0.5 / sigma, 1e-5) == pytest.approx(reference, rel=2e-3)


def test_participation_mixture_is_monotone_and_replace_one_costs_more():
    eps = [epsilon_vs_server(2.0, q, 100, 1e-5) for q in (0.01, 0.1, 0.5, 1.0)]
    assert eps == sorted(eps) and eps[0] > 0
    assert epsilon_vs_server(2.0, 0.1, 100, 1e-5, 2.0) > eps[1]
    assert epsilon_vs_server(2.0, 0.1, 0, 1e-5) == 0.0
    # The mixture over n ~ Binomial(T, q): T = 2, q = 1/2 by hand.
    by_hand = (
        0.25 * 0
        + 0.5 * participation_delta(1.0, 1.0, 1.0, 1)
        + 0.25 * (participation_delta(1.0, 1.0, 1.0, 2))
    )
    assert participation_delta(1.0, 1.0, 0.5, 2) == pytest.approx(by_hand, rel=1e-12)


def test_calculator_prints_the_server_view_of_client_placed_noise(capsys):
    args = ["privacy", "--sigma", "1", "--q", "0.1", "--rounds", "100", "--delta", "1e-5"]
    assert main([*args, "--client-cohort", "10"]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split() for line in out.splitlines() if line.startswith(("zero-out", "repl")))
    assert float(rows["zero-out"]) == pytest.approx(
        epsilon_vs_server(1 / 10**0.5, 0.1, 100, 1e-5), rel=1e-3
    )
    assert float(rows["replace-one"]) > float(rows["zero-out"])


def test_record_level_replace_one_pld_is_the_gaussian_of_its_noise():
    """Replacing a record moves the clipped sum by ≤ 2C under noise 2Cσ_g: with every record
    in every step (s = l = K = 1) that is the Gaussian mechanism at μ = 1/σ_g."""
    from privacy.sample_level import SampleLevelPldAccountant

    sigma = 2.0
    accountant = SampleLevelPldAccountant(1.0, 1.0, 1, sigma, adjacency="replace_one")
    expected = gaussian_epsilon(1 / sigma, 1e-5)
    assert accountant.epsilon(1, 1e-5) == pytest.approx(expected, rel=2e-3)
