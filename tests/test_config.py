"""Bad configs fail before any work, naming the field, the value and the fix."""

import pytest

from cluster.config import ConfigError, load_config
from cluster.privacy_plan import privacy_warnings

DP = ["algorithm.name=dp_fedavg", "algorithm.clip_norm=1.0", "algorithm.noise_multiplier=1.0"]

BAD_CONFIGS = [
    # (overrides, field named in the error, text of the fix)
    (["algoritm.name=dp_fedavg"], "algoritm", "did you mean 'algorithm'"),
    (["algorithm.clip_nrom=1"], "algorithm.clip_nrom", "did you mean 'clip_norm'"),
    (["algorithm.name=dp_fedavgg"], "algorithm.name", "did you mean 'dp_fedavg'"),
    (["algorithm.rho=0.5"], "algorithm.rho", "only for dp_fedsam"),
    (["algorithm.keep_fraction=0.4"], "algorithm.keep_fraction", "fedavg has no such option"),
    ([*DP, "algorithm.noise_multiplier=-0.5"], "algorithm.noise_multiplier", "must be >= 0"),
    ([*DP, "algorithm.clip_norm=0"], "algorithm.clip_norm", "must be > 0"),
    ([*DP, "algorithm.clip_norm=null"], "algorithm.clip_norm", "must be > 0"),
    (
        ["data.partition.method=dirichlet", "data.partition.alpha=0"],
        "data.partition.alpha",
        "must be > 0",
    ),
    (["data.partition.method=dirichlet"], "data.partition.alpha", "must be > 0"),
    (
        [
            "algorithm.name=dp_fedpgn",
            "algorithm.local.local_steps=5",
            "algorithm.local.momentum=0.9",
        ],
        "algorithm.local.momentum",
        "exact only without local momentum",
    ),
    (
        [
            "algorithm.name=dp_scaffold",
            "algorithm.noise_placement=null",
            "algorithm.local.momentum=0.5",
        ],
        "algorithm.local.momentum",
        "mean local gradient only for plain SGD",
    ),
    (["cohort.size=0"], "cohort.size", "must be > 0"),
    (["cohort.size=101"], "cohort.size", "cannot exceed the population of 100"),
    (["data.source=imagenet"], "data.source", "unknown data source"),
    (["data.source=cifar10"], "data.source", "task synthetic_logreg reads synthetic data"),
    (["data.split=letters"], "data.split", "only for source emnist"),
    (["data.partition.min_size=5"], "data.partition.min_size", "only used by method"),
    (
        ["data.partition.method=iid", "data.partition.samples_per_client=500"],
        "data.partition.samples_per_client",
        "only used by method: dirichlet",
    ),
    (
        [
            "data.partition.method=dirichlet",
            "data.partition.alpha=0.6",
            "data.partition.samples_per_client=0",
        ],
        "data.partition.samples_per_client",
        "must be >= 1",
    ),
    (["task=mnist_mlp"], "task", "unknown task"),
    (["task=mnist_cnn"], "data.source", "task mnist_cnn reads mnist or mnist_test_split data"),
    (["algorithm.name=fedavg"], "algorithm.clip_norm", "fedavg is non-private"),
    ([*DP, "privacy.delta=1.5"], "privacy.delta", "δ must be in (0, 1)"),
    (["rounds=ten"], "rounds", "must be an integer"),
    (["executor.kind=slurm"], "executor.kind", "must be one of 'local', 'ray'"),
    (["executor.gpus_per_actor=1.5"], "executor.gpus_per_actor", "fraction in [0, 1]"),
    (
        [*DP, "cohort.sampling=poisson", "algorithm.noise_placement=client"],
        "algorithm.noise_placement",
        "fixed-size cohort",
    ),
    (
        [*DP, "algorithm.noise_multiplier=0", "privacy.target_epsilon=4"],
        "privacy.target_epsilon",
        "no privacy to budget",
    ),
    ([*DP, "algorithm.weighting=samples"], "algorithm.weighting", "uniform"),
    (["algorithm.local.local_epochs=2"], "algorithm.local.local_steps", "exactly one"),
    (["data.synthetic.label_noise=2"], "data.synthetic.label_noise", "in [0, 1]"),
    (
        [
            "privacy.target_epsilon=8",
            "algorithm.name=scaffold",
            "algorithm.clip_norm=null",
            "algorithm.noise_multiplier=null",
            "algorithm.noise_placement=null",
        ],
        "privacy.target_epsilon",
        "non-private",
    ),
]


@pytest.mark.parametrize(("overrides", "field", "fix"), BAD_CONFIGS)
def test_bad_config_is_rejected_with_a_precise_message(overrides, field, fix):
    with pytest.raises(ConfigError) as info:
        load_config("configs/quickstart.yaml", overrides)
    assert info.value.field_path == field
    assert fix in str(info.value)
    assert field in str(info.value)


def test_missing_config_file_and_malformed_override():
    with pytest.raises(ConfigError, match="no such file"):
        load_config("configs/nope.yaml")
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config("configs/quickstart.yaml", ["rounds"])


def test_overrides_are_typed_and_applied():
    c = load_config(
        "configs/quickstart.yaml",
        [
            "rounds=7",
            "algorithm.clip_norm=.inf",
            "algorithm.noise_multiplier=0",
            "privacy.delta=1e-5",
            "cohort.sampling=poisson",
        ],
    )
    assert c.rounds == 7
    assert c.algorithm.clip_norm == float("inf")
    assert c.delta == 1e-5
    assert c.sample_rate == pytest.approx(0.2)
    default = load_config("configs/quickstart.yaml")
    assert default.delta == pytest.approx(100**-1.1)  # δ defaults to N^-1.1, below 1/N
    assert privacy_warnings(default, []) == []
    weak = load_config("configs/quickstart.yaml", ["privacy.delta=0.01"])
    assert "δ = 0.01 ≥ 1/N = 0.01 (N = 100 clients)" in privacy_warnings(weak, [])[0]


def test_a_sample_level_delta_is_weak_against_the_records_not_the_clients():
    """δ = 1e-3 is below 1/N for 60 clients but above 1/R for their 6,000 records."""
    sizes = [100] * 60
    paper = "configs/papers/dpscaffold_mnist_mlp.yaml"
    config = load_config(paper, ["privacy.delta=1e-3"])
    assert config.sample_level and config.data.num_clients == 60
    (warning,) = privacy_warnings(config, sizes)
    assert "≥ 1/R = 0.000166667 (R = 6000 training records)" in warning
    strict = load_config(paper, ["privacy.delta=1e-4"])
    assert privacy_warnings(strict, sizes) == []


def test_store_root_is_absolute_for_actors(monkeypatch, tmp_path):
    monkeypatch.delenv("DPFL_STORE_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["data.store_root=shards"])
    assert config.data.resolved_store_root() == tmp_path.resolve() / "shards"
    monkeypatch.setenv("DPFL_STORE_ROOT", "elsewhere")
    assert config.data.resolved_store_root() == tmp_path.resolve() / "elsewhere"
