"""Memory checks before any work (cluster/runtime/memory.py): the largest arrays a run would
hold at once, against this machine's memory (here a stand-in size)."""

import pytest

from cluster.config import ConfigError, load_config
from cluster.runtime import memory
from cluster.runtime.store import check_synthetic_fits

GIB = 2**30
FETCHSGD = [
    "algorithm.name=fetchsgd",
    "algorithm.local={lr: 1.0, momentum: 0.0, local_steps: 1}",
]
SMALL_SYNTHETIC = ["data.num_clients=10", "cohort.size=5", "data.synthetic.samples_per_user=10"]
DRAWN = "data.partition={method: dirichlet, alpha: 0.5, samples_per_client: 1000}"


@pytest.fixture
def one_gib(monkeypatch):
    """This machine, as the checks see it, has 1 GiB."""
    monkeypatch.setattr(memory, "physical_memory", lambda: GIB)


def _config(*overrides):
    return load_config(None, ["executor.kind=local", *overrides])


@pytest.mark.parametrize(
    ("check", "overrides", "field", "fits"),
    [
        # 4 tables × 5 × 10⁷ counters × 8 bytes = 1.6 GB; the defaults (5 × 500000) take 80 MB
        (
            memory.check_sketch_fits,
            [*FETCHSGD, "algorithm.sketch_cols=10000000"],
            "algorithm.sketch_cols",
            FETCHSGD,
        ),
        # three 2000 × 30000 float64 model arrays: 1.44 GB (2000 × 2000: 96 MB)
        (
            check_synthetic_fits,
            [
                *SMALL_SYNTHETIC,
                "data.synthetic.num_features=2000",
                "data.synthetic.num_classes=30000",
            ],
            "data.synthetic",
            [
                *SMALL_SYNTHETIC,
                "data.synthetic.num_features=2000",
                "data.synthetic.num_classes=2000",
            ],
        ),
        # 100 clients × 1000 rows × (784 + 8) bytes = 79 MB fits; 2000 clients: 1.58 GB
        (
            memory.check_drawn_rows_fit,
            ["task=mnist_cnn", "data.source=mnist", DRAWN, "data.num_clients=2000"],
            "data.partition.samples_per_client",
            ["task=mnist_cnn", "data.source=mnist", DRAWN, "data.num_clients=100"],
        ),
        # 5 actor processes × at least 250 MB: 1.22 GiB; 4 fit
        (
            memory.check_actor_processes_fit,
            ["executor.kind=ray", "executor.num_actors=5", "executor.cpus_per_actor=0.1"],
            "executor.num_actors",
            ["executor.kind=ray", "executor.num_actors=4", "executor.cpus_per_actor=0.1"],
        ),
    ],
    ids=["sketch tables", "synthetic model arrays", "drawn rows", "actor processes"],
)
def test_what_does_not_fit_is_refused_naming_the_field(check, overrides, field, fits, one_gib):
    with pytest.raises(ConfigError) as refused:
        check(_config(*overrides))
    assert refused.value.field_path == field
    assert "this machine has 1 GiB" in str(refused.value)
    check(_config(*fits))


@pytest.mark.parametrize(
    "preset",
    [
        ["algorithm.name=dp_fedavg", "algorithm.clip_norm=1.0"],
        [
            "algorithm.name=dpsfl",
            "algorithm.clip_norm=1.0",
            "algorithm.local={lr: 1.0, momentum: 0.0, local_steps: 1}",
        ],
    ],
    ids=["dp_fedavg", "dpsfl"],
)
def test_an_uncalibrated_config_is_checked_before_its_sigma_is_known(preset, one_gib):
    """``run`` checks before it calibrates: σ unset must not stop the sketch check."""
    config = _config(
        *preset,
        "algorithm.noise_multiplier=null",
        "privacy.calibrate=sigma",
        "privacy.target_epsilon=8.0",
    )
    assert config.algorithm.noise_multiplier is None
    memory.check_sketch_fits(config)


def test_a_container_limit_below_the_machine_is_the_memory_checked(tmp_path, monkeypatch):
    limit, unlimited, missing = tmp_path / "v2", tmp_path / "v1", tmp_path / "none"
    limit.write_text("1073741824\n")
    unlimited.write_text("max\n")
    assert memory.cgroup_limit(limit) == GIB
    assert memory.cgroup_limit(unlimited) is None and memory.cgroup_limit(missing) is None
    monkeypatch.setattr(memory, "CGROUP_LIMIT_FILES", (unlimited, missing))
    machine = memory.physical_memory()
    assert machine > GIB
    monkeypatch.setattr(memory, "CGROUP_LIMIT_FILES", (unlimited, limit))
    assert memory.physical_memory() == GIB
