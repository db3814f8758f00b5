"""The privacy audit runs the real mechanism and catches an under-noised one."""

import math

import numpy as np
import pytest
from helpers import small_config

from cluster.audit_cli import audit_config
from cluster.cli import main
from privacy.audit import clopper_pearson, epsilon_from_rates

# 100 clients, cohort 20: q = 0.2, δ = 0.01, as in the quickstart.
BASE = (
    "data.num_clients=100",
    "cohort.size=20",
    "algorithm.name=dp_fedavg",
    "algorithm.clip_norm=1.0",
)
SETTINGS = {
    "poisson, server noise σ=1": ("cohort.sampling=poisson", "algorithm.noise_multiplier=1.0"),
    "fixed, client noise σ=5": (
        "cohort.sampling=fixed",
        "algorithm.noise_placement=client",
        "algorithm.noise_multiplier=5.0",
    ),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_correct_mechanism_stays_below_the_accountant(store_root, setting):
    config = small_config(store_root, *BASE, *SETTINGS[setting])
    for seed in range(3):
        result = audit_config(config, trials=600, confidence=0.95, dim=8, seed=seed)
        assert result.accountant_epsilon > 0
        assert result.consistent, (seed, result)


@pytest.mark.parametrize("setting", SETTINGS)
def test_ten_times_too_little_noise_is_detected(store_root, setting):
    config = small_config(store_root, *BASE, *SETTINGS[setting])
    result = audit_config(
        config, trials=1000, confidence=0.95, dim=8, seed=0, noise_scale_for_testing=0.1
    )
    assert result.epsilon_lower_bound > result.accountant_epsilon, result


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


def test_audit_cli_exit_codes(store_root, capsys):
    args = ["audit", "configs/quickstart.yaml", "--trials", "400", "--dim", "4"]
    sets = ["--set", f"data.store_root={store_root}"]
    assert main([*args, *sets]) == 0
    assert "consistent" in capsys.readouterr().out
    assert main([*args, *sets, "--noise-scale-for-testing", "0.1"]) == 1
    assert "VIOLATION" in capsys.readouterr().out
    # σ left to calibration is audited at the calibrated σ.
    calibrate = ["algorithm.noise_multiplier=null", "privacy.calibrate=sigma"]
    calibrate.append("privacy.target_epsilon=5")
    assert main([*args, *sets, *(x for c in calibrate for x in ("--set", c))]) == 0
    assert "consistent" in capsys.readouterr().out
    code = main([*args, *sets, "--set", "algorithm.noise_multiplier=0"])
    assert code == 2 and "the audit needs a DP preset" in capsys.readouterr().err
