"""How a run's privacy is planned: accountant and assumption, noise cohort, calibration."""

import math

import pytest
import torch
from helpers import run_local, small_config

from algorithms.aggregate import PartialAggregate
from algorithms.server import MeanServerRule, ServerContext
from cluster.claims.calibration import calibrated
from cluster.claims.privacy_plan import privacy_claim
from cluster.config import ConfigError
from privacy.accountant import RdpAccountant, WorRdpAccountant, accountant_class
from privacy.calibration import epsilon_for
from privacy.pld import PldAccountant
from privacy.rdp import rdp_epsilon

DP = ("algorithm.name=dp_fedavg", "algorithm.clip_norm=1.0", "algorithm.noise_multiplier=1.0")


def _accountant(config):
    return privacy_claim(config, config.build_algorithm()).new_accountant()


def test_the_accountant_follows_the_cohort_sampler(store_root):
    fixed = small_config(store_root, *DP)
    assert (fixed.sampling_assumption, fixed.accountant_name) == ("without_replacement", "rdp")
    assert isinstance(_accountant(fixed), WorRdpAccountant)
    poisson = small_config(store_root, *DP, "cohort.sampling=poisson")
    assert isinstance(_accountant(poisson), PldAccountant)
    for config in (fixed, poisson):
        assert privacy_claim(config, config.build_algorithm()).dp_valid


def test_accounting_another_sampler_than_the_cohorts_has_no_epsilon(store_root):
    """DP-FedSAM's fixed cohort accounted as Poisson: runs, dp_valid=false, no ε, no budget."""
    as_paper = small_config(store_root, *DP, "privacy.sampling=poisson")
    claim = privacy_claim(as_paper, as_paper.build_algorithm())
    assert not claim.dp_valid and claim.new_accountant() is None
    assert "sampled fixed but privacy.sampling accounts poisson" in claim.unaccounted_reason
    assert claim.tags()["privacy.dp_valid"] == "false"
    with pytest.raises(ConfigError, match="privacy.sampling: match"):
        small_config(store_root, *DP, "privacy.sampling=poisson", "privacy.target_epsilon=5")
    # A noise cohort of the cohort's own size describes no deployment: still no ε.
    same = f"privacy.noise_cohort_size={as_paper.cohort.size}"
    no_op = small_config(store_root, *DP, "privacy.sampling=poisson", same)
    assert no_op.deployment is None
    assert not privacy_claim(no_op, no_op.build_algorithm()).dp_valid
    # A noise cohort claims ε for the deployment it describes, sampled as assumed.
    deployment = small_config(
        store_root,
        *DP,
        "privacy.sampling=poisson",
        "privacy.noise_cohort_size=200",
        "privacy.population=20000",
    )
    claim = privacy_claim(deployment, deployment.build_algorithm())
    assert claim.dp_valid and claim.deployment == "200 of 20,000 clients per round"
    assert "not this simulation's cohort" in claim.accounting_text
    assert any("whose own ε" in notice for notice in claim.notices())
    assert claim.tags()["privacy.epsilon_for"] == "200 of 20,000 clients per round"
    plain = small_config(store_root, *DP)
    assert privacy_claim(plain, plain.build_algorithm()).tags()["privacy.epsilon_for"] == "this run"


def test_without_replacement_costs_more_than_poisson_at_the_same_rate():
    # Replace-one adjacency doubles the sensitivity of the sum (2C): an honest fixed-cohort ε
    # is above the Poisson add/remove one, at any rounds; both grow with T.
    for rounds in (1, 10, 100):
        wor = epsilon_for(2.0, 0.1, rounds, 1e-5, WorRdpAccountant)
        poisson = epsilon_for(2.0, 0.1, rounds, 1e-5, RdpAccountant)
        assert wor > poisson
    assert epsilon_for(2.0, 0.1, 100, 1e-5, WorRdpAccountant) > epsilon_for(
        2.0, 0.1, 10, 1e-5, WorRdpAccountant
    )
    acc = WorRdpAccountant()
    acc.step(2.0, 0.1, 7)
    copy = WorRdpAccountant()
    copy.load_state_dict(acc.state_dict())
    assert copy.epsilon(1e-5) == acc.epsilon(1e-5)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            (
                "algorithm.name=dp_fedavg",
                "algorithm.clip_norm=1",
                "algorithm.noise_multiplier=1",
                "privacy.accountant=pld",
            ),
            "privacy.accountant",
        ),
        (("privacy.calibrate=sigma", *DP), "privacy.calibrate"),
        (("privacy.noise_cohort_size=50", *DP), "privacy.noise_cohort_size"),
        (("privacy.population=10", *DP), "privacy.population"),
    ],
)
def test_privacy_config_errors_name_the_field(store_root, overrides, field):
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *overrides)
    assert error.value.field_path == field


def test_noise_cohort_scales_the_noise_and_the_accounted_rate(store_root):
    config = small_config(
        store_root,
        *DP,
        "cohort.sampling=poisson",
        "privacy.noise_cohort_size=50",
        "privacy.population=1000",
        "privacy.accountant=rdp",
        "rounds=3",
    )
    assert config.accounting_sample_rate == 0.05 and config.delta == 1000**-1.1
    algorithm = config.build_algorithm()
    assert algorithm.mechanism.sum_noise_std == pytest.approx(1.0 * 1.0 * 5 / 50)  # σC·m/C_n
    # The mean over the m=5 simulated clients carries std σC/C_n = 0.02 (statistical, seeded).
    noise = algorithm.pipeline.server_noise(10**6, None, (0, 0), torch.Generator().manual_seed(0))
    ctx = ServerContext(5.0, 20, noise)
    mean = MeanServerRule().noisy_mean(PartialAggregate(), 10**6, ctx)
    assert float(mean.std()) == pytest.approx(0.02, rel=0.01)
    sim = run_local(config)
    assert sim.history[-1].epsilon == pytest.approx(
        epsilon_for(1.0, 0.05, 3, 1000**-1.1, RdpAccountant), rel=1e-12
    )


def test_calibrate_sigma_meets_the_budget_and_the_run_spends_it(store_root):
    config = small_config(
        store_root,
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=1.0",
        "cohort.sampling=poisson",
        "privacy.accountant=rdp",
        "privacy.calibrate=sigma",
        "privacy.target_epsilon=4.0",
        "rounds=6",
    )
    assert config.algorithm.noise_multiplier is None
    ready = calibrated(config)
    sigma = ready.algorithm.noise_multiplier
    eps = epsilon_for(sigma, 0.25, 6, config.delta, RdpAccountant)
    assert 0.98 * 4.0 <= eps <= 4.0
    sim = run_local(ready)
    assert len(sim.history) == 6 and sim.history[-1].epsilon == pytest.approx(eps)


def test_calibrate_rounds_is_the_largest_budgeted_number(store_root):
    config = small_config(
        store_root,
        *DP,
        "cohort.sampling=poisson",
        "privacy.calibrate=rounds",
        "privacy.target_epsilon=3.0",
    )
    rounds = calibrated(config).rounds
    cls = accountant_class("pld")
    assert epsilon_for(1.0, 0.25, rounds, config.delta, cls) <= 3.0
    assert epsilon_for(1.0, 0.25, rounds + 1, config.delta, cls) > 3.0
    impossible = small_config(
        store_root, *DP, "privacy.calibrate=rounds", "privacy.target_epsilon=0.01"
    )
    with pytest.raises(ConfigError, match="even one round"):
        calibrated(impossible)
    assert math.isfinite(rounds)


def test_an_rdp_fallback_is_labelled_rdp_not_the_refusing_accountant(store_root):
    """σ = 0.05: PLD refuses ε beyond its range and the run's accountant falls back to the RDP
    bound; the ε, the accounting text, the tags and the report name RDP as its source."""
    config = small_config(store_root, *DP, "cohort.sampling=poisson", "rounds=3")
    weak = small_config(
        store_root, *DP[:2], "algorithm.noise_multiplier=0.05", "cohort.sampling=poisson"
    )
    for cfg, source in ((config, "pld"), (weak, "rdp")):
        claim = privacy_claim(cfg, cfg.build_algorithm())
        accountant = claim.new_accountant()
        for round_index in range(3):
            claim.charge(accountant, round_index)
        assert accountant.produced_by(claim.delta) == source
        reported = claim.reported_by(accountant)
        assert reported.tags()["privacy.accountant"] == source
        if source == "pld":
            assert reported is claim
            continue
        runs = [(claim.noise_multiplier, claim.sample_rate, 3)]
        assert accountant.epsilon(claim.delta) == rdp_epsilon(runs, claim.delta)
        assert "client-level, rdp (pld refused: ε beyond its range)" in reported.accounting_text
        assert reported.tags()["privacy.accountant_refused"] == "pld"


def test_a_run_stopped_after_a_fallback_ends_tagged_with_the_rdp_accountant(store_root):
    """A run that fails after its accountant fell back keeps no stale ``pld`` tag: its end
    (``_abandon``) sets the claim's tags as its last ε's accountant reports them."""
    from types import SimpleNamespace

    from cluster.runtime.experiment import _abandon

    weak = small_config(
        store_root, *DP[:2], "algorithm.noise_multiplier=0.05", "cohort.sampling=poisson"
    )
    claim = privacy_claim(weak, weak.build_algorithm())
    accountant = claim.new_accountant()
    for round_index in range(3):
        claim.charge(accountant, round_index)
    ended = []
    run = SimpleNamespace(set_tags=ended.append, abandon=ended.append)
    sim = SimpleNamespace(claim=claim, accountant=accountant)
    _abandon(run, RuntimeError("round 4 failed"), weak, None, None, sim)
    assert claim.tags()["privacy.accountant"] == "pld"  # as the run's start tagged it
    assert ended[0]["privacy.accountant"] == "rdp"
    assert ended[0]["privacy.accountant_refused"] == "pld" and ended[1] == "FAILED"
