"""The privacy audit runs the real presets, passes accounted ones and flags broken ones.

Sizes are the documented ones (docs/privacy.md, Privacy audit): 1,000 trials per world,
dimension 16, 95% confidence; at that size the audit flags noise scaled by ≤ 0.82 (its reported
power).
"""

import math

import numpy as np
import pytest
from helpers import small_config

from algorithms.presets import CLIENT_LEVEL_PRESETS, SKETCH_PRESETS
from cluster.cli.audit import audit_config
from cluster.cli.main import main
from privacy.audit import clopper_pearson, detectable_noise_scale, epsilon_from_rates
from privacy.audit_sample import audit_sample_round

TRIALS, DIM = 1000, 16
DP = ("algorithm.clip_norm=1.0", "algorithm.noise_multiplier=1.0")
# A fixed cohort of 10 of 100 (replace-one), as the client-placed presets need.
BASE = ("data.num_clients=100", "cohort.size=10", *DP)
# DP-FedSAM-top_k's paper settings: 50 of 500 clients, σ = 0.95, C = 0.2, p = 0.4, noise on
# the clients.
PAPER = (
    "data.num_clients=500",
    "cohort.size=50",
    "algorithm.name=dp_fedsam_topk",
    "algorithm.clip_norm=0.2",
    "algorithm.noise_multiplier=0.95",
)


def _audit(store_root, *overrides, trials=TRIALS, scale=1.0):
    config = small_config(store_root, *overrides)
    return audit_config(
        config, trials=trials, confidence=0.95, dim=DIM, seed=0, noise_scale_for_testing=scale
    )


# The sketched presets are audited with the sketch's own canary in tests/test_sketch.py.
ACCOUNTED = sorted(CLIENT_LEVEL_PRESETS - SKETCH_PRESETS) + [
    "dp_fedavg layer clip",
    "dp_fedavg poisson",
]


@pytest.mark.parametrize("preset", ACCOUNTED)
def test_every_accounted_preset_stays_below_its_claim(store_root, preset):
    name, _, variant = preset.partition(" ")
    extra = {
        "layer clip": ("algorithm.clip_scope=layer",),
        "poisson": ("cohort.sampling=poisson", "algorithm.noise_placement=server"),
    }.get(variant, ())
    result = _audit(store_root, *BASE, f"algorithm.name={name}", *extra, trials=600)
    assert result.dp_valid and result.claimed_epsilon > 0
    assert result.consistent, result


def test_noise_scaled_by_0_6_is_caught_and_the_power_is_reported(store_root):
    result = _audit(store_root, *BASE, "algorithm.name=dp_fedavg", scale=0.6)
    assert result.epsilon_lower_bound > result.claimed_epsilon, result
    # The reported power: at this size, noise ≤ 0.82 × the claim is flagged (σ = 1, 2S).
    assert result.detectable_noise_scale == pytest.approx(0.82, abs=0.02)
    assert detectable_noise_scale(2.0, 4 * TRIALS, 0.95) > result.detectable_noise_scale


def test_an_unaccounted_server_rule_makes_the_audit_claim_no_epsilon(store_root):
    """BLUR+LUS's realised denominator: the mechanism's noise is as claimed, but the release
    divides by a count without noise, so the audit reports its claim as not DP-valid."""
    # dp_valid is the claim's (the bound algorithm's unaccounted reason), not the trials':
    # the audit's minimum size checks it (1,000 trials per world took 20-120 s for nothing).
    realised = ("algorithm.name=dp_fedavg_blurs", "algorithm.mean_denominator=realised")
    assert not _audit(store_root, *BASE, *realised, trials=20).dp_valid
    assert _audit(store_root, *BASE, "algorithm.name=dp_fedavg_blurs", trials=20).dp_valid


# Both literal variants' audits (50 clients a round at the paper's settings: 23-40 s each, the
# suite's slowest audits) run with the slow tests; in CI,
# test_mechanism.py::test_paper_literal_topk_is_under_noised_and_unaccounted catches both
# variants' under-noising (χ²) and their unaccounted claim.
@pytest.mark.slow
@pytest.mark.parametrize("literal", ["algorithm.noise_support=kept", "algorithm.mask_source=noisy"])
def test_paper_literal_topk_is_flagged_at_the_paper_settings(store_root, literal):
    result = _audit(store_root, *PAPER, literal)
    assert not result.dp_valid
    assert result.epsilon_lower_bound > result.claimed_epsilon, result


def test_clopper_pearson_and_the_rate_bound():
    low, high = clopper_pearson(0, 100, 0.95)
    assert low == 0 and high == pytest.approx(1 - 0.025 ** (1 / 100), rel=1e-9)
    low, high = clopper_pearson(50, 100, 0.95)
    assert low < 0.5 < high and high - low == pytest.approx(0.2, abs=0.01)
    # Coverage: over 2000 binomial draws, the 90% interval misses p about 10% of the time.
    rng = np.random.default_rng(0)
    draws = rng.binomial(200, 0.3, size=2000)
    misses = sum(not (lo <= 0.3 <= hi) for lo, hi in (clopper_pearson(k, 200, 0.9) for k in draws))
    assert misses / 2000 <= 0.1
    assert epsilon_from_rates(0.5, 0.5, 0.0) == 0.0
    assert epsilon_from_rates(0.9, 0.1, 0.0) == pytest.approx(math.log(9))


@pytest.mark.parametrize(
    ("option", "expect"),
    [
        (["--confidence", "nan"], "--confidence = nan: out of range; give a confidence level"),
        (["--confidence", "1.5"], "--confidence = 1.5"),
        (["--trials", "5"], "--trials = 5: out of range; give at least 20 trials per world"),
        (["--dim", "0"], "--dim = 0"),
        (["--seed", "-1"], "--seed = -1"),
        (["--noise-scale-for-testing", "inf"], "--noise-scale-for-testing = inf"),
    ],
)
def test_audit_cli_refuses_out_of_range_options(option, expect, tmp_path, capsys):
    """Before the config is read (a path that does not exist is never reached)."""
    assert main(["audit", str(tmp_path / "absent.yaml"), *option]) == 2
    out, err = capsys.readouterr()
    assert expect in err and out == "", (out, err)


def test_audit_cli_exit_codes(store_root, capsys):
    args = ["audit", "configs/quickstart.yaml", "--trials", "300", "--dim", "8"]
    sets = ["--set", f"data.store_root={store_root}"]
    assert main([*args, *sets]) == 0
    out = capsys.readouterr().out
    assert "consistent" in out and "power: at this size" in out
    assert main([*args, *sets, "--noise-scale-for-testing", "0.3"]) == 1
    assert "VIOLATION" in capsys.readouterr().out
    # σ left to calibration is audited at the calibrated σ.
    calibrate = ["algorithm.noise_multiplier=null", "privacy.calibrate=sigma"]
    calibrate.append("privacy.target_epsilon=5")
    assert main([*args, *sets, *(x for c in calibrate for x in ("--set", c))]) == 0
    assert "consistent" in capsys.readouterr().out
    code = main([*args, *sets, "--set", "algorithm.noise_multiplier=0"])
    assert code == 2 and "the audit needs a DP preset" in capsys.readouterr().err


SAMPLE = (
    "algorithm.name=dp_scaffold",
    *DP,
    "algorithm.local.local_steps=3",
    "algorithm.local.lr_scaling=inverse_sk",
)


@pytest.mark.parametrize(
    "variant",
    [
        (),
        ("algorithm.clip_scope=layer",),
        ("algorithm.adjacency=add_remove", "algorithm.local.batch_sampling=poisson"),
        ("algorithm.name=dp_fedavg_sample",),
    ],
)
def test_sample_level_round_stays_below_its_claim(variant):
    algorithm = small_config("unused", *SAMPLE, *variant).build_algorithm()
    result = audit_sample_round(algorithm, trials=TRIALS, dim=DIM)
    # μ = √K/σ_g = √3: the claim at the chosen δ; the bound comes close, as a draw: over seeds
    # 0–11 it was 0.30–0.83 of the claim across these variants, 8–9 of 12 above half (seed 0:
    # 0.41, 0.41, 0.63, 0.41); a vacuous audit gives ≈ 0.
    assert result.dp_valid and result.consistent, result
    assert result.epsilon_lower_bound > 0.25 * result.claimed_epsilon, result


def test_sample_level_audit_catches_halved_noise_and_runs_from_the_cli(capsys):
    algorithm = small_config("unused", *SAMPLE).build_algorithm()
    result = audit_sample_round(algorithm, trials=TRIALS, dim=DIM, noise_scale_for_testing=0.5)
    assert result.epsilon_lower_bound > result.claimed_epsilon, result
    sets = ("tracking.enabled=false", "algorithm.noise_placement=null", *SAMPLE)
    sets = [x for s in sets for x in ("--set", s)]
    assert main(["audit", "configs/quickstart.yaml", "--trials", "400", *sets]) == 0
    out = capsys.readouterr().out
    assert "canary record in every batch" in out and "consistent" in out
