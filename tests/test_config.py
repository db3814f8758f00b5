"""Bad configs fail before any work, naming the field, the value and the fix."""

import pytest

from cluster.claims.privacy_plan import privacy_warnings
from cluster.config import ConfigError, load_config
from cluster.config.runtime import ray_endpoint
from cluster.runtime.preflight import ray_address

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
            "algorithm.name=dp_fedpgn",
            "algorithm.local.local_steps=5",
            "algorithm.local.lr_scaling=inverse_sk",
        ],
        "algorithm.local.lr_scaling",
        "leaves part of the drift in the update",
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
    (
        [
            "algorithm.name=dp_fedavg_sample",
            "algorithm.clip_norm=1.0",
            "algorithm.noise_multiplier=1.0",
            "algorithm.local.batch_sampling=poisson",
            "algorithm.adjacency=add_remove",
            "algorithm.noise_placement=null",
            "privacy.delta=1e-12",
        ],
        "privacy.delta",
        "record-level pld accountant's float64 convolution",
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
    (["executor.gpus_per_actor=1.5"], "executor.gpus_per_actor", "a fraction in [0.0001, 1]"),
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
    [warning] = privacy_warnings(config, sizes)
    assert "≥ 1/R = 0.000166667 (R = 6000 training records)" in warning
    strict = load_config(paper, ["privacy.delta=1e-4"])
    assert privacy_warnings(strict, sizes) == []
    # Standing for a deployment of 6,000 such clients, R is 600,000 records: 1e-4 is weak.
    deployment = [
        "algorithm.name=dp_fedavg_sample",
        "algorithm.warm_start=null",
        "privacy.population=6000",
    ]
    *_, warning = privacy_warnings(load_config(paper, ["privacy.delta=1e-4", *deployment]), sizes)
    assert "≥ 1/R = 1.66667e-06 (R = 600000 training records)" in warning


@pytest.mark.parametrize(
    "paper",
    ["configs/papers/dpscaffold_mnist_mlp.yaml", "configs/papers/dpscaffold_femnist_logreg.yaml"],
)
def test_the_papers_preparation_fits_public_data_by_default_and_its_own_is_unaccounted(paper):
    """DP-SCAFFOLD's PCA and standardisation fit statistics to every user's rows, outside DP:
    by default (the source's test split unused, each user holding its own test rows) they fit
    the source's test split and the run's ε holds; ``statistics_from: training``, the paper's,
    runs dp_valid=false, naming the steps."""
    from cluster.claims.privacy_plan import privacy_claim

    sizes = [800] * 60
    public = load_config(paper)
    assert public.data.resolved_statistics_from == "source_test"
    assert public.data.source_options()["statistics_from"] == "source_test"  # keys the store
    assert privacy_claim(public, public.build_algorithm(), sizes).dp_valid
    literal = load_config(paper, ["data.statistics_from=training"])
    assert "statistics_from" not in literal.data.source_options()  # the stores built before
    claim = privacy_claim(literal, literal.build_algorithm(), sizes)
    assert not claim.dp_valid and claim.epsilon_text(1.0) == "ε n/a (dp_valid=false)"
    assert "data.statistics_from: training" in claim.unaccounted_reason
    assert "standardize_unit_norm" in claim.unaccounted_reason
    assert ("pca_components" in claim.unaccounted_reason) == ("mnist_mlp" in paper)
    assert literal.unaccounted_reason == claim.unaccounted_reason
    with pytest.raises(ConfigError, match="privacy.target_epsilon"):  # no ε to calibrate to
        load_config(paper, ["data.statistics_from=training", "privacy.target_epsilon=5"])
    # A checkpoint written before the option fitted the training rows: it resumes so.
    from cluster.config import config_from_dict
    from cluster.runtime.checkpoint import _written_before_statistics_from

    old = public.to_dict()
    del old["data"]["statistics_from"]
    _written_before_statistics_from(old)
    assert config_from_dict(old).data.resolved_statistics_from == "training"


def test_synthetic_data_is_standardised_with_the_generators_own_statistics():
    """The synthetic source standardises with its distribution's mean and variance by default
    (no record moves another row), and with all users' pooled rows only as an option that
    states no ε; each keys its own store."""
    from cluster.claims.privacy_plan import privacy_claim

    default = load_config(None, DP)
    assert default.data.resolved_statistics_from == "population"
    assert default.data.source_options()["statistics_from"] == "population"
    claim = privacy_claim(default, default.build_algorithm())
    assert claim.dp_valid and default.unaccounted_reason is None
    pooled = load_config(None, [*DP, "data.statistics_from=training"])
    assert "statistics_from" not in pooled.data.source_options()  # the stores built before
    claim = privacy_claim(pooled, pooled.build_algorithm())
    assert not claim.dp_valid and claim.epsilon_text(1.0) == "ε n/a (dp_valid=false)"
    assert "statistics_from: population" in claim.unaccounted_reason
    for bad in ("source_test", "public"):
        with pytest.raises(ConfigError, match="for source synthetic: population") as error:
            load_config(None, [*DP, f"data.statistics_from={bad}"])
        assert error.value.field_path == "data.statistics_from"
    with pytest.raises(ConfigError, match="population"):
        load_config(
            None,
            [
                *DP,
                "data.source=mnist",
                "task=mnist_cnn",
                "data.pca_components=9",
                "data.statistics_from=population",
            ],
        )


def test_a_task_that_frames_its_images_refuses_feature_rows():
    """emnist_cnn_crop_flips pads uint8 images with black pixels (the authors' 32×32): rows of
    standardised features would pass unframed into a model built for 32×32."""
    framed = ["task=emnist_cnn_crop_flips", "data.source=emnist", *DP]
    with pytest.raises(ConfigError, match="frames its images with black pixels") as error:
        load_config(None, [*framed, "data.standardize_unit_norm=true"])
    assert error.value.field_path == "data.standardize_unit_norm"
    assert "run task emnist_cnn" in str(error.value)
    load_config(None, framed)  # the images as stored: accepted


def test_femnist_test_split_is_its_writers_data_not_public():
    """FEMNIST's test split holds the training writers' other examples: never the public
    data the statistics could be fitted to."""
    femnist = [
        "task=femnist_cnn",
        "data.source=femnist",
        "data.standardize_unit_norm=true",
        "data.client_test_fraction=0.2",
        "data.partition.method=natural",
        *DP,
    ]
    config = load_config(None, femnist)
    assert config.data.resolved_statistics_from == "training"
    assert "standardize_unit_norm" in config.unaccounted_reason
    with pytest.raises(ConfigError, match="same writers' other examples"):
        load_config(None, [*femnist, "data.statistics_from=source_test"])


def test_store_root_is_absolute_for_actors(monkeypatch, tmp_path):
    monkeypatch.delenv("DPFL_STORE_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["data.store_root=shards"])
    assert config.data.resolved_store_root() == tmp_path.resolve() / "shards"
    monkeypatch.setenv("DPFL_STORE_ROOT", "elsewhere")
    assert config.data.resolved_store_root() == tmp_path.resolve() / "elsewhere"


def test_an_empty_directory_variable_is_unset_not_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in ("DPFL_STORE_ROOT", "DPFL_CHECKPOINT_DIR", "DPFL_DATA_ROOT"):
        monkeypatch.setenv(name, "")
    config = load_config(None, ["data.store_root=shards", "checkpoint.dir=ckpt", "data.root=raw"])
    assert config.data.resolved_store_root() == tmp_path.resolve() / "shards"
    assert config.checkpoint_dir == tmp_path.resolve() / "ckpt"
    assert config.data.resolved_data_root() == tmp_path.resolve() / "raw"


def test_a_quoted_number_is_read_as_written(tmp_path):
    """YAML 1.1 leaves '.5' and '.inf' quoted (and 1e-5) as strings: each is the number it
    spells, .inf only where it has a meaning."""
    c = load_config(None, [*DP, "algorithm.local.lr='.5'", "privacy.delta=1e-5"])
    assert c.algorithm.local.lr == 0.5 and c.privacy.delta == 1e-5
    c = load_config(None, [*DP, "algorithm.clip_norm='.inf'", "algorithm.noise_multiplier=0"])
    assert c.algorithm.clip_norm == float("inf")
    with pytest.raises(ConfigError, match=r"algorithm.local.lr = '-\.inf': must be 0 or"):
        load_config(None, ["algorithm.local.lr='-.inf'"])


@pytest.mark.parametrize("value", ["1e-300", "-1e-300", "4e38", ".nan"])
def test_a_float_outside_float32s_normal_range_is_refused(value):
    with pytest.raises(ConfigError, match=r"magnitude in \[1.2e-38, 3.4e\+38\]") as info:
        load_config(None, [f"algorithm.server_lr={value}"])
    assert info.value.field_path == "algorithm.server_lr"


def test_a_merge_key_may_be_overridden_but_not_a_key_twice(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  local:\n    <<: {lr: 0.2, batch_size: 4}\n    lr: 0.3\n")
    assert load_config(path).algorithm.local.lr == 0.3
    path.write_text("algorithm:\n  local:\n    lr: 0.2\n    lr: 0.3\n")
    with pytest.raises(ConfigError, match="line 4, column 5: duplicate key 'lr'.*line 3"):
        load_config(path)


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("10.0.0.1:6379", ("10.0.0.1", 6379)),
        ("head-svc.ray.svc:6379", ("head-svc.ray.svc", 6379)),
        ("ray://10.0.0.1:10001", ("10.0.0.1", 10001)),
        ("[::1]:6379", ("::1", 6379)),
        ("auto", None),
        ("local", None),
    ],
)
def test_the_accepted_ray_address_forms(address, endpoint):
    assert ray_endpoint("executor.address", address) == endpoint


@pytest.mark.parametrize("name", ["dpfl", "mnist dp-sweep (v2).1", "x" * 100, "é" * 50, "..."])
def test_names_that_are_one_file_name_are_kept(name):
    c = load_config(None, [f"tracking.experiment={name!r}", f"tracking.run_name={name!r}"])
    assert c.tracking.experiment == name == c.tracking.run_name


def test_a_symlink_loop_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("DPFL_CHECKPOINT_DIR", raising=False)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    config = load_config(None, [f"checkpoint.dir={tmp_path / 'loop' / 'x'}"])
    with pytest.raises(ConfigError, match="Symlink loop") as info:
        _ = config.checkpoint_dir
    assert info.value.field_path == "checkpoint.dir"


def test_ray_uses_executor_address_unless_unset_or_auto_and_ray_address_is_set(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    for given, expected in [
        (None, ("RAY_ADDRESS", "10.0.0.2:6379")),
        ("auto", ("RAY_ADDRESS", "10.0.0.2:6379")),
        ("10.0.0.1:6379", ("executor.address", "10.0.0.1:6379")),
    ]:
        overrides = [] if given is None else [f"executor.address={given}"]
        assert ray_address(load_config(None, overrides)) == expected
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address(load_config(None, ["executor.address=auto"])) == ("executor.address", "auto")


@pytest.mark.parametrize(
    "tagged",
    ["!!python/object/apply:os.system ['touch {mark}']", "!!python/name:os.system"],
)
def test_a_python_tag_in_a_config_or_an_override_is_refused_unrun(tmp_path, tagged):
    """Configs are read with a SafeLoader (``cluster.config.loading._StrictLoader``): a tag
    that would build a Python object or call a function is an error, never run."""
    mark = tmp_path / "ran"
    value = tagged.format(mark=mark)
    path = tmp_path / "tagged.yaml"
    path.write_text(f"rounds: {value}\n")
    for load in (lambda: load_config(path, []), lambda: load_config(None, [f"rounds={value}"])):
        with pytest.raises(ConfigError, match="could not determine a constructor for the tag"):
            load()
    assert not mark.exists()
