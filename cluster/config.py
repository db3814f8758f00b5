"""Experiment configuration: typed dataclasses loaded from YAML, with ``a.b=value`` overrides.

Everything is validated before any work starts. A ``ConfigError`` names the field, the bad value
and the fix, e.g. ``algorithm.clip_norm = -1.0: the clip norm C must be > 0 (e.g. 1.0)``.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import math
import os
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from algorithms.local import LocalTrainer
from algorithms.presets import (
    COMPRESSION_LEVELS,
    DEFAULT_PLACEMENT,
    FIXED_STEP_PRESETS,
    PRESET_OPTIONS,
    PRESETS,
    PRIVATE_PRESETS,
    SAMPLE_LEVEL_PRESETS,
    SKETCH_PRESETS,
    Algorithm,
    ClientDP,
    SampleDP,
    presets_taking,
)
from datasets.partition import PARTITION_METHODS
from datasets.sources import SOURCES
from datasets.tasks import TASKS
from datasets.vision import EMNIST_SPLITS
from privacy.accountant import accountants_for, assumption_for_sampler, default_accountant
from privacy.record_level import methods_for


class ConfigError(ValueError):
    def __init__(self, field_path: str, value: Any, fix: str):
        self.field_path, self.value, self.fix = field_path, value, fix
        super().__init__(f"config error: {field_path} = {value!r}: {fix}")


@dataclass
class SyntheticConfig:
    """DP-SCAFFOLD's synthetic(α, β) benchmark; one natural user per client."""

    alpha: float = 1.0
    beta: float = 1.0
    samples_per_user: int = 5000
    num_features: int = 40
    num_classes: int = 10
    label_noise: float = 0.05
    train_fraction: float = 0.8


@dataclass
class PartitionConfig:
    method: str = "natural"  # natural | iid | dirichlet | dirichlet_class | shards
    alpha: float | None = None  # Dirichlet concentration (dirichlet, dirichlet_class)
    min_size: int | None = None  # dirichlet_class: fewest rows per client (default 10)
    classes_per_client: int | None = None  # shards: k shards per client (default 2)
    # dirichlet: draws per client with class pools refilled (rows repeat; DP-FedPGN's code);
    # label_skew: rows per user
    samples_per_client: int | None = None
    iid_fraction: float | None = None  # label_skew: γ i.i.d., the rest from label u mod K


@dataclass
class DataConfig:
    source: str = "synthetic"
    num_clients: int = 100
    store_root: str = "shards"  # relative to the working directory, or $DPFL_STORE_ROOT
    store: str | None = None  # an existing store (path or URI, e.g. from `partition`)
    root: str = "data"  # raw dataset files (torchvision layout), or $DPFL_DATA_ROOT
    download: bool = False  # fetch missing raw files (needs internet)
    split: str | None = None  # emnist: byclass (default) | balanced | letters
    only_digits: bool = False  # femnist: the 10-class digits-only files
    pca_components: int | None = None  # mnist sources: features = top-k PCA of the pixels
    # Also evaluate on per-client test sets of this size in each client's label mix (DP-FedSAM)
    test_per_client: int | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)

    def resolved_store_root(self) -> Path:
        """Absolute: actors do not share the driver's working directory."""
        root = os.environ.get("DPFL_STORE_ROOT", self.store_root)
        return Path(os.path.expandvars(root)).expanduser().resolve()

    def resolved_data_root(self) -> Path:
        root = os.environ.get("DPFL_DATA_ROOT", self.root)
        return Path(os.path.expandvars(root)).expanduser().resolve()

    def source_options(self) -> dict:
        """The source's own options (they key the store)."""
        if self.source == "synthetic":
            return {**asdict(self.synthetic), "num_users": self.num_clients}
        if self.source == "emnist":
            return {"split": self.split or "byclass"}
        if self.source == "femnist":
            return {"only_digits": self.only_digits}
        if self.pca_components is not None:
            return {"pca_components": self.pca_components}
        return {}


@dataclass
class LocalConfig:
    lr: float = 0.1
    batch_size: int = 32
    local_steps: int | None = 10
    local_epochs: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_decay: float = 1.0  # per round: round t uses lr·lr_decay^t
    # epoch: permutations; fresh: B records without replacement afresh every step; poisson:
    # each record with probability B/n every step. null: fresh for sample-level presets.
    batch_sampling: Literal["epoch", "fresh", "poisson"] | None = None
    # inverse_sk: lr is η₀ and a client of n records trains with η_l = η₀/(sK), s = B/n
    lr_scaling: Literal["none", "inverse_sk"] = "none"


@dataclass
class AlgorithmConfig:
    name: str = "fedavg"
    local: LocalConfig = field(default_factory=LocalConfig)
    clip_norm: float | None = None  # C; dp presets only
    noise_multiplier: float | None = None  # σ; dp presets only
    # Options of some presets (null: the preset's paper default; see algorithms/presets.py)
    noise_placement: Literal["server", "client"] | None = None
    clip_scope: Literal["flat", "layer"] | None = None
    keep_fraction: float | None = None  # p of top-k / rand-k (0.4)
    mask_scope: Literal["layer", "global"] | None = None
    mask_source: Literal["clean", "noisy"] | None = None  # dp_fedsam_topk's mask
    # top-k presets: dense (DP) or kept (the papers' noise on kept coordinates; unaccounted)
    noise_support: Literal["dense", "kept"] | None = None
    rho: float | None = None  # SAM radius ρ (0.5, DP-FedSAM)
    sam_adaptive: bool | None = None  # ASAM (the DP-FedSAM authors' code) instead of SAM
    blur_lambda: float | None = None  # BLUR coefficient λ (0.4)
    blur_bound: float | None = None  # BLUR radius S (default: clip_norm)
    lus_sparsity: float | None = None  # LUS: fraction c of each layer dropped (0.7)
    lus_gradient: Literal["data", "batch"] | None = None  # LUS score's gradient (all data)
    pgn_beta: float | None = None  # DP-FedPGN mixing β (0.3)
    pgn_rho: float | None = None  # DP-FedPGN perturbation radius ρ (0.2)
    ls_sigma: float | None = None  # Laplacian smoothing σ_ls (0.01)
    server_momentum: float | None = None  # server momentum μ (any preset; off by default)
    # Sample-level presets (dp_fedavg_sample, dp_scaffold): DP-SGD in every local step
    adjacency: Literal["replace_one", "add_remove"] | None = None  # replace_one (the paper)
    clip_rule: Literal["fixed", "median"] | None = None  # median: the authors' code; no ε
    warm_start: bool | None = None  # dp_scaffold: ⌈4/l⌉ warm-up rounds computing c_i⁰
    # paper: warm-up before the rounds; authors_code: inside them, c_i⁰ of all at round 0
    warm_start_variant: Literal["paper", "authors_code"] | None = None
    # Sketched presets (fetchsgd, dpsfl, dpsfl_ac): count sketch l × m, top-k, momentum β
    sketch_rows: int | None = None  # l (5)
    sketch_cols: int | None = None  # m (500000)
    sketch_top_k: int | None = None  # k (50000)
    sketch_momentum: float | None = None  # β (0.9; the paper does not say)
    sketch_seed: int | None = None  # the hashes' seed, shared by clients and server (42)
    compression_level: int | None = None  # DPSFL's CL1–5: sets sketch_top_k and sketch_cols
    # zero: FetchSGD's code (zero S_e, S_u where Δ hashes); subtract: S_e −= S(Δ) (the papers)
    sketch_feedback: Literal["zero", "subtract"] | None = None
    # dense: noise on the clipped vector, then sketch (DP); paper: C√l per counter (no ε)
    sketch_noise: Literal["dense", "paper"] | None = None
    paper_epsilon: float | None = None  # sketch_noise paper: the ε its ρ is read from (4)
    # dpsfl_ac: C ← C·exp(−η_C(b̄ − γ)), b_i = 1{‖g_i‖ ≤ C/(1−θ)} + N(0, σ_b²)
    clip_target_quantile: float | None = None  # γ (0.9)
    clip_error_tolerance: float | None = None  # θ (0.5)
    clip_count_noise: float | None = None  # σ_b per client (0.1)
    clip_lr: float | None = None  # η_C (0.01)
    server_lr: float = 1.0
    weighting: Literal["uniform", "samples"] = "uniform"

    def preset_options(self) -> dict[str, Any]:
        """The preset options that are set (not null), by name."""
        return {
            name: getattr(self, name)
            for name in PRESET_OPTION_FIELDS
            if getattr(self, name) is not None
        }


# AlgorithmConfig fields passed, when set, as keyword arguments of the preset function, which
# accepts its own (its signature holds the papers' defaults): every option some preset takes.
PRESET_OPTION_FIELDS = tuple(f.name for f in fields(AlgorithmConfig) if f.name in PRESET_OPTIONS)
if set(PRESET_OPTION_FIELDS) != PRESET_OPTIONS:
    missing = sorted(PRESET_OPTIONS - set(PRESET_OPTION_FIELDS))
    raise TypeError(f"AlgorithmConfig lacks fields for the preset options {missing}")


DP_OPTION_FIELDS = ("noise_placement", "clip_scope")  # client-level presets (ClientDP)
SAMPLE_DP_OPTION_FIELDS = ("clip_scope", "adjacency", "clip_rule")  # sample-level (SampleDP)
DP_FIELDS = ("clip_norm", "noise_multiplier", *DP_OPTION_FIELDS, "adjacency", "clip_rule")


@dataclass
class CohortConfig:
    size: int = 20  # fixed: exactly this many; poisson: this many in expectation (q = size/N)
    sampling: Literal["fixed", "poisson"] = "fixed"


@dataclass
class PrivacyConfig:
    delta: float | None = None  # default population^-1.1
    target_epsilon: float | None = None  # stop before a round would exceed it
    # auto: pld under Poisson sampling, rdp without replacement (see default_accountant);
    # sample level: pld for Poisson batches, rdp for fixed-size ones; paper: DP-SCAFFOLD's own
    accountant: Literal["auto", "rdp", "pld", "prv", "paper"] = "auto"
    # match: the assumption of the cohort sampler (poisson → poisson, fixed → without_replacement)
    sampling: Literal["match", "poisson", "without_replacement"] = "match"
    # sigma: the smallest σ reaching target_epsilon after `rounds`; rounds: the most rounds at σ
    calibrate: Literal["none", "sigma", "rounds"] = "none"
    # Noise and accounting as if each cohort had this many clients (pfl-research's noise cohort)
    noise_cohort_size: int | None = None
    population: int | None = None  # clients the ε is claimed for; default data.num_clients


@dataclass
class ExecutorConfig:
    kind: Literal["local", "ray"] = "ray"
    num_actors: int = 2
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    address: str | None = None  # Ray address; None = $RAY_ADDRESS or an embedded Ray


@dataclass
class CheckpointConfig:
    every: int = 10  # rounds between checkpoints; 0 = only at the end
    dir: str = "checkpoints"  # relative to the working directory, or $DPFL_CHECKPOINT_DIR

    def resolved_dir(self) -> Path:
        root = os.environ.get("DPFL_CHECKPOINT_DIR", self.dir)
        return Path(os.path.expandvars(root)).expanduser().resolve()


@dataclass
class TrackingConfig:
    enabled: bool = True
    experiment: str = "dpfl"
    run_name: str | None = None


@dataclass
class ExperimentConfig:
    task: str = "synthetic_logreg"
    seed: int = 0
    rounds: int = 100
    eval_every: int = 1
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    cohort: CohortConfig = field(default_factory=CohortConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    # Derived quantities used by the driver and the actors.
    @property
    def sample_rate(self) -> float:
        return self.cohort.size / self.data.num_clients

    @property
    def population(self) -> int:
        return self.privacy.population or self.data.num_clients

    @property
    def noise_cohort_size(self) -> int:
        """C_n: the cohort the noise and the accounting are for (default: the cohort itself)."""
        return self.privacy.noise_cohort_size or self.cohort.size

    @property
    def accounting_sample_rate(self) -> float:
        """q the accountant is charged: noise cohort (or cohort) size over the population."""
        return self.noise_cohort_size / self.population

    @property
    def noise_scale(self) -> float:
        """m / noise_cohort_size: the sum's noise std is σC·m/C_n, as if C_n clients took part."""
        return self.cohort.size / self.noise_cohort_size

    @property
    def sampling_assumption(self) -> str:
        if self.privacy.sampling == "match":
            return assumption_for_sampler(self.cohort.sampling)
        return self.privacy.sampling

    @property
    def sample_level(self) -> bool:
        """Record-level DP (DP-SGD in the clients) rather than client-level."""
        return self.algorithm.name in SAMPLE_LEVEL_PRESETS

    @property
    def warm_start_variant(self) -> str | None:
        if not self.algorithm.warm_start:
            return None
        return self.algorithm.warm_start_variant or "paper"

    @property
    def warmup_rounds(self) -> int:
        """DP-SCAFFOLD-warm's warm-up rounds: ⌈4/l⌉ (paper), round(4/l) (authors' code)."""
        variant = self.warm_start_variant
        if variant is None:
            return 0
        if variant == "authors_code":
            return max(1, round(4 / self.sample_rate))
        return math.ceil(4 / self.sample_rate - 1e-9)

    @property
    def total_rounds(self) -> int:
        """Rounds the driver runs: the paper's warm-up, then ``rounds`` training rounds (the
        authors' code counts its warm-up inside ``rounds``)."""
        if self.warm_start_variant == "authors_code":
            return self.rounds
        return self.warmup_rounds + self.rounds

    @property
    def batch_sampling(self) -> str:
        """How local batches are drawn: the config's choice, else fresh for sample level."""
        if self.algorithm.local.batch_sampling is not None:
            return self.algorithm.local.batch_sampling
        return "fresh" if self.sample_level else "epoch"

    @property
    def accountant_name(self) -> str:
        if self.privacy.accountant != "auto":
            return self.privacy.accountant
        if self.sample_level:
            return methods_for(self.batch_sampling, self.algorithm.adjacency or "replace_one")[0]
        return default_accountant(self.sampling_assumption)

    @property
    def delta(self) -> float:
        """δ: the configured one, else N^-1.1 for a population of N (below 1/N, which would
        allow a mechanism that publishes one client's data outright)."""
        if self.privacy.delta is not None:
            return self.privacy.delta
        return self.population**-1.1

    @property
    def delta_warning(self) -> str | None:
        """Why the configured δ is weak: δ ≥ 1/N permits releasing some client's data."""
        if self.privacy.delta is None or self.privacy.delta < 1 / self.population:
            return None
        return (
            f"privacy: δ = {self.privacy.delta:g} ≥ 1/N = {1 / self.population:g}: a mechanism "
            "that publishes one random client's data in the clear meets such a δ; prefer "
            f"δ ≤ N^-1.1 = {self.population**-1.1:.3g} (the default when privacy.delta is unset)"
        )

    @property
    def noise_placement(self) -> str:
        """Where the noise is added: the config's choice, else the preset's paper default."""
        if self.algorithm.noise_placement is not None:
            return self.algorithm.noise_placement
        return DEFAULT_PLACEMENT.get(self.algorithm.name, "server")

    @property
    def paper_sketch_noise(self) -> bool:
        """DPSFL's own noise: sized from algorithm.paper_epsilon, not a noise multiplier."""
        return self.algorithm.sketch_noise == "paper"

    def build_algorithm(self) -> Algorithm:
        a = self.algorithm
        if a.name in PRIVATE_PRESETS and a.noise_multiplier is None and not self.paper_sketch_noise:
            # privacy.calibrate: sigma leaves σ unset; building before calibrating would
            # silently train without noise.
            raise ConfigError(
                "algorithm.noise_multiplier",
                None,
                "not calibrated yet: pass the config through "
                "cluster.privacy_plan.calibrated() first (run_experiment does)",
            )
        return self._build_algorithm(a.noise_multiplier)

    @property
    def unaccounted_reason(self) -> str | None:
        """Why the configured preset's mechanism has no ε (read off its pipeline), else None."""
        if self.algorithm.name not in PRIVATE_PRESETS:
            return None
        return self._build_algorithm(1.0).unaccounted_reason  # structural: any σ > 0

    def _build_algorithm(self, noise_multiplier: float | None) -> Algorithm:
        a, local = self.algorithm, self.algorithm.local
        trainer = LocalTrainer(
            lr=local.lr,
            batch_size=local.batch_size,
            local_steps=local.local_steps,
            local_epochs=local.local_epochs,
            momentum=local.momentum,
            weight_decay=local.weight_decay,
            lr_decay=local.lr_decay,
            batch_sampling=self.batch_sampling,
            lr_scaling=local.lr_scaling,
        )
        preset = PRESETS[a.name]
        accepted = inspect.signature(preset).parameters
        kwargs: dict[str, Any] = {"server_lr": a.server_lr, **a.preset_options()}
        if "weighting" in accepted:
            kwargs["weighting"] = a.weighting
        if "dp" in accepted:
            kwargs["dp"] = ClientDP(
                a.clip_norm,
                noise_multiplier,
                self.noise_placement,
                self.noise_scale,
                a.clip_scope or "flat",
            )
        if "sample_dp" in accepted:
            kwargs["sample_dp"] = SampleDP(
                math.nan if a.clip_norm is None else a.clip_norm,  # median: chosen per step
                noise_multiplier,
                a.clip_scope or "flat",
                a.adjacency or "replace_one",
                a.clip_rule or "fixed",
            )
        algorithm = preset(trainer, **kwargs)
        if a.server_momentum:
            algorithm = replace(
                algorithm, server=replace(algorithm.server, momentum=a.server_momentum)
            )
        return algorithm

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (dataclass, Optional, Literal, scalar)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(path, value, f"must be one of {', '.join(map(repr, choices))}")
        return value
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(path, value, f"must be a mapping of {tp.__name__} fields")
        return _from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" and "inf" as strings
            try:
                return float(value.strip().lstrip("."))
            except ValueError:
                raise ConfigError(path, value, "must be a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, value, "must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "must be a string")
        return value
    raise TypeError(f"unsupported config type {_type_name(tp)} at {path}")


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in data:
        if key not in known:
            path = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            fix = (
                f"did you mean {close[0]!r}?"
                if close
                else f"known keys: {', '.join(sorted(known))}"
            )
            raise ConfigError(path, data[key], f"unknown key; {fix}")
    kwargs = {}
    for f in fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        if f.name in data:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], path)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(path, None, "is required")
    return cls(**kwargs)


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override (value parsed as YAML) to a raw config mapping."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ConfigError("--set", assignment, "write overrides as key.path=value, e.g. rounds=10")
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(key, assignment, f"{part!r} is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(text)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> ExperimentConfig:
    """Read YAML (or start from defaults), apply overrides, then validate everything."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                "CONFIG",
                str(path),
                "no such file; pass a YAML file such as configs/quickstart.yaml",
            )
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError("CONFIG", str(path), "the file must hold a YAML mapping")
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict, overrides: list[str] = ()) -> ExperimentConfig:
    """Build and validate a config from a mapping (e.g. one stored in a checkpoint)."""
    raw = copy.deepcopy(raw)
    for assignment in overrides:
        apply_override(raw, assignment)
    config = _from_dict(ExperimentConfig, raw)
    validate(config)
    return config


# ----------------------------------------------------------------------------- validation


def _choice(path: str, value: str, choices, what: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, list(choices), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(path, value, f"unknown {what}; {hint}known: {', '.join(sorted(choices))}")


def _positive(path: str, value: float | int | None, example: str) -> None:
    if value is None or not value > 0:
        raise ConfigError(path, value, f"must be > 0 (e.g. {example})")


def validate(c: ExperimentConfig) -> None:
    """Every check that can fail before any data is built or any actor is started."""
    _choice("task", c.task, TASKS, "task")
    _choice("data.source", c.data.source, SOURCES, "data source")
    if c.data.source not in TASKS[c.task].sources:
        raise ConfigError(
            "data.source",
            c.data.source,
            f"task {c.task} reads {' or '.join(TASKS[c.task].sources)} data",
        )
    _choice("data.partition.method", c.data.partition.method, PARTITION_METHODS, "partition")
    _choice("algorithm.name", c.algorithm.name, PRESETS, "algorithm")
    _positive("rounds", c.rounds, "100")
    _positive("eval_every", c.eval_every, "1")
    _positive("data.num_clients", c.data.num_clients, "100")
    validate_data(c)
    _validate_algorithm(c)
    _validate_cohort(c)
    _validate_warm_start(c)
    _validate_privacy(c)
    _validate_executor(c)
    if c.checkpoint.every < 0:
        raise ConfigError("checkpoint.every", c.checkpoint.every, "must be >= 0 (0: at the end)")


def validate_data(c: ExperimentConfig) -> None:
    s, p = c.data.synthetic, c.data.partition
    if c.data.split is not None and (
        c.data.source != "emnist" or c.data.split not in EMNIST_SPLITS
    ):
        raise ConfigError(
            "data.split",
            c.data.split,
            f"only for source emnist, one of {', '.join(EMNIST_SPLITS)}; remove it otherwise",
        )
    if c.data.test_per_client is not None and c.data.test_per_client < 1:
        raise ConfigError(
            "data.test_per_client", c.data.test_per_client, "must be >= 1 (e.g. 100) or null"
        )
    if c.data.pca_components is not None and (
        c.data.source not in ("mnist", "mnist_test_split") or c.data.pca_components < 1
    ):
        raise ConfigError(
            "data.pca_components",
            c.data.pca_components,
            "only for sources mnist and mnist_test_split, >= 1 (DP-SCAFFOLD: 60)",
        )
    if c.data.only_digits and c.data.source != "femnist":
        raise ConfigError("data.only_digits", True, "only for source femnist; remove it")
    if c.data.source == "synthetic":
        for name in ("alpha", "beta"):
            if getattr(s, name) < 0:
                raise ConfigError(f"data.synthetic.{name}", getattr(s, name), "must be >= 0")
        _positive("data.synthetic.samples_per_user", s.samples_per_user, "5000")
        _positive("data.synthetic.num_features", s.num_features, "40")
        if s.num_classes < 2:
            raise ConfigError("data.synthetic.num_classes", s.num_classes, "must be >= 2")
        if not 0 <= s.label_noise <= 1:
            raise ConfigError("data.synthetic.label_noise", s.label_noise, "must be in [0, 1]")
        if not 0 < s.train_fraction < 1:
            raise ConfigError(
                "data.synthetic.train_fraction", s.train_fraction, "must be in (0, 1), e.g. 0.8"
            )
    validate_partition(p)


# Which partition options each method reads.
PARTITION_OPTIONS = {
    "alpha": ("dirichlet", "dirichlet_class"),
    "min_size": ("dirichlet_class",),
    "classes_per_client": ("shards",),
    "samples_per_client": ("dirichlet", "label_skew"),
    "iid_fraction": ("label_skew",),
}


def validate_partition(p: PartitionConfig) -> None:
    """Partition options: each only for the methods that read it, with valid values."""
    for name, methods in PARTITION_OPTIONS.items():
        value = getattr(p, name)
        if value is not None and p.method not in methods:
            raise ConfigError(
                f"data.partition.{name}",
                value,
                f"only used by method: {' or '.join(methods)} (method is {p.method!r}); remove it",
            )
    if p.method in PARTITION_OPTIONS["alpha"] and (p.alpha is None or not p.alpha > 0):
        raise ConfigError(
            "data.partition.alpha", p.alpha, "the Dirichlet concentration α must be > 0 (e.g. 0.3)"
        )
    if p.method == "label_skew" and (p.iid_fraction is None or not 0 <= p.iid_fraction <= 1):
        raise ConfigError(
            "data.partition.iid_fraction",
            p.iid_fraction,
            "label_skew needs the i.i.d. fraction γ in [0, 1] (DP-SCAFFOLD: 0, 0.1 or 1)",
        )
    if p.min_size is not None and p.min_size < 0:
        raise ConfigError("data.partition.min_size", p.min_size, "must be >= 0, e.g. 10")
    if p.classes_per_client is not None and p.classes_per_client < 1:
        raise ConfigError(
            "data.partition.classes_per_client", p.classes_per_client, "must be >= 1, e.g. 2"
        )
    if p.samples_per_client is not None and p.samples_per_client < 1:
        raise ConfigError(
            "data.partition.samples_per_client",
            p.samples_per_client,
            "must be >= 1 (e.g. 500), or null for an equal split without repeats",
        )


def _validate_algorithm(c: ExperimentConfig) -> None:
    a, local = c.algorithm, c.algorithm.local
    _positive("algorithm.local.lr", local.lr, "0.1")
    _positive("algorithm.local.batch_size", local.batch_size, "32")
    if (local.local_steps is None) == (local.local_epochs is None):
        raise ConfigError(
            "algorithm.local.local_steps",
            local.local_steps,
            "set exactly one of local_steps and local_epochs (the other to null)",
        )
    if local.local_steps is not None:
        _positive("algorithm.local.local_steps", local.local_steps, "10")
    if local.local_epochs is not None:
        _positive("algorithm.local.local_epochs", local.local_epochs, "1")
    if not 0 <= local.momentum < 1:
        raise ConfigError("algorithm.local.momentum", local.momentum, "must be in [0, 1)")
    if local.weight_decay < 0:
        raise ConfigError("algorithm.local.weight_decay", local.weight_decay, "must be >= 0")
    if not 0 < local.lr_decay <= 1:
        raise ConfigError(
            "algorithm.local.lr_decay",
            local.lr_decay,
            "must be in (0, 1]: round t uses lr·lr_decay^t (1 = constant, the papers use 0.998)",
        )
    _positive("algorithm.server_lr", a.server_lr, "1.0")
    if a.local.batch_sampling == "poisson" and not c.sample_level:
        raise ConfigError(
            "algorithm.local.batch_sampling",
            "poisson",
            "Poisson batches are for the sample-level presets (dp_fedavg_sample, dp_scaffold); "
            "use epoch or fresh",
        )
    if a.name in PRIVATE_PRESETS:
        if a.clip_rule == "median":
            if a.clip_norm is not None:
                raise ConfigError(
                    "algorithm.clip_norm",
                    a.clip_norm,
                    "clip_rule median picks C from every batch; remove clip_norm",
                )
        elif a.clip_norm is None or not a.clip_norm > 0:
            raise ConfigError(
                "algorithm.clip_norm",
                a.clip_norm,
                "the clip norm C must be > 0 (e.g. 1.0; .inf disables clipping)",
            )
        sigma_is_calibrated = c.privacy.calibrate == "sigma" and a.noise_multiplier is None
        if c.paper_sketch_noise:
            sigma_is_calibrated = True  # σ comes from paper_epsilon (checked with the sketch)
        if not sigma_is_calibrated and (a.noise_multiplier is None or a.noise_multiplier < 0):
            raise ConfigError(
                "algorithm.noise_multiplier",
                a.noise_multiplier,
                "the noise multiplier σ must be >= 0 (e.g. 1.0)",
            )
        noised = sigma_is_calibrated or a.noise_multiplier > 0
        if noised and a.clip_norm is not None and math.isinf(a.clip_norm):
            raise ConfigError(
                "algorithm.clip_norm",
                a.clip_norm,
                "noise needs a finite clip norm to bound sensitivity; set C > 0",
            )
        if a.weighting != "uniform":
            raise ConfigError(
                "algorithm.weighting",
                a.weighting,
                "DP needs uniform weighting (sample counts are private); use uniform",
            )
        if c.sample_level:
            _validate_sample_level(c)
        elif (
            c.noise_placement == "client"
            and c.cohort.sampling == "poisson"
            and not c.paper_sketch_noise  # DPSFL's own noise: every client, whole (local)
        ):
            raise ConfigError(
                "algorithm.noise_placement",
                c.noise_placement,
                "client-placed noise sums to σC only over a fixed-size cohort; "
                "use cohort.sampling: fixed or noise_placement: server",
            )
        if not c.sample_level:
            _validate_noise_support(c)
    else:
        for name in ("clip_norm", "noise_multiplier"):
            if getattr(a, name) is not None:
                raise ConfigError(
                    f"algorithm.{name}",
                    getattr(a, name),
                    f"{a.name} is non-private; remove it or use dp_fedavg",
                )
    _validate_preset_options(a)
    if a.name in SKETCH_PRESETS:
        _validate_sketch(c)


def _validate_sketch(c: ExperimentConfig) -> None:
    """fetchsgd, dpsfl, dpsfl_ac: one batch gradient per client, a valid sketch and clip loop."""
    a, local = c.algorithm, c.algorithm.local
    plain_sgd = {"local_steps": 1, "lr": 1.0, "momentum": 0.0, "lr_decay": 1.0}
    for name, value in plain_sgd.items():
        if getattr(local, name) != value:
            raise ConfigError(
                f"algorithm.local.{name}",
                getattr(local, name),
                f"{a.name} clients upload one batch gradient (u = −g): set local_steps: 1, "
                "lr: 1.0, momentum: 0, lr_decay: 1; the step size is algorithm.server_lr (η) "
                "and the momentum algorithm.sketch_momentum (β)",
            )
    if local.lr_scaling != "none":
        raise ConfigError(
            "algorithm.local.lr_scaling", local.lr_scaling, f"{a.name} takes no lr; remove it"
        )
    if a.weighting != "uniform":
        raise ConfigError(
            "algorithm.weighting",
            a.weighting,
            f"{a.name} averages the sketches uniformly over the cohort; use uniform",
        )
    if a.compression_level is not None:
        if a.compression_level not in COMPRESSION_LEVELS:
            raise ConfigError(
                "algorithm.compression_level", a.compression_level, "must be 1, 2, 3, 4 or 5"
            )
        for name in ("sketch_cols", "sketch_top_k"):
            if getattr(a, name) is not None:
                raise ConfigError(
                    f"algorithm.{name}",
                    getattr(a, name),
                    "compression_level sets sketch_top_k and sketch_cols; remove one or the other",
                )
    for name in ("sketch_rows", "sketch_cols", "sketch_top_k"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise ConfigError(f"algorithm.{name}", getattr(a, name), "must be >= 1")
    if a.sketch_momentum is not None and not 0 <= a.sketch_momentum < 1:
        raise ConfigError(
            "algorithm.sketch_momentum", a.sketch_momentum, "must be in [0, 1), e.g. 0.9"
        )
    if a.paper_epsilon is not None and (not a.paper_epsilon > 0 or not c.paper_sketch_noise):
        raise ConfigError(
            "algorithm.paper_epsilon",
            a.paper_epsilon,
            "only with sketch_noise: paper, and > 0 (the paper: 2 to 10, default 4)",
        )
    if c.paper_sketch_noise:
        for name in ("noise_multiplier", "noise_placement"):
            if getattr(a, name) is not None:
                raise ConfigError(
                    f"algorithm.{name}",
                    getattr(a, name),
                    "sketch_noise: paper adds the paper's N(0, C²l/(2ρ)) on every client's "
                    "counters, ρ from algorithm.paper_epsilon; remove it",
                )
    _validate_adaptive_clip(c)


def _validate_adaptive_clip(c: ExperimentConfig) -> None:
    a = c.algorithm
    ranges = {
        "clip_target_quantile": (0.0, 1.0, "0.9"),
        "clip_error_tolerance": (0.0, 1.0, "0.5"),
    }
    for name, (low, high, example) in ranges.items():
        value = getattr(a, name)
        if value is not None and not low < value < high:
            raise ConfigError(f"algorithm.{name}", value, f"must be in (0, 1), e.g. {example}")
    for name, example in (("clip_count_noise", "0.1"), ("clip_lr", "0.01")):
        if getattr(a, name) is not None:
            _positive(f"algorithm.{name}", getattr(a, name), example)


def _validate_sample_level(c: ExperimentConfig) -> None:
    """DP-SGD presets: what the record-level accountant needs to describe the run."""
    a = c.algorithm
    if a.local.local_steps is None:
        raise ConfigError(
            "algorithm.local.local_epochs",
            a.local.local_epochs,
            "sample-level accounting charges K noisy steps per round: set local_steps (and "
            "local_epochs: null)",
        )
    if c.batch_sampling == "epoch":
        raise ConfigError(
            "algorithm.local.batch_sampling",
            "epoch",
            "the record-level accountant analyses independent subsamples per step: use fresh "
            "(B records without replacement, the paper) or poisson",
        )
    if a.noise_placement is not None:
        raise ConfigError(
            "algorithm.noise_placement",
            a.noise_placement,
            f"{a.name} adds its noise in every local DP-SGD step of the clients; remove it",
        )
    if c.privacy.noise_cohort_size is not None or c.privacy.sampling != "match":
        field_name = (
            "privacy.noise_cohort_size"
            if c.privacy.noise_cohort_size is not None
            else "privacy.sampling"
        )
        raise ConfigError(
            field_name,
            getattr(c.privacy, field_name.split(".")[1]),
            "client-level accounting option; the record-level ε holds for either cohort "
            "sampler (only the participation rate l enters): remove it",
        )
    adjacency = a.adjacency or "replace_one"
    methods = methods_for(c.batch_sampling, adjacency)
    if not methods:
        raise ConfigError(
            "algorithm.adjacency",
            adjacency,
            "fixed-size batches (fresh) are analysed under replace-one adjacency; use "
            "replace_one, or algorithm.local.batch_sampling: poisson",
        )
    if c.accountant_name not in methods:
        raise ConfigError(
            "privacy.accountant",
            c.privacy.accountant,
            f"no analysis of {c.batch_sampling} batches under {adjacency} adjacency; use "
            f"{' or '.join(m for m in methods if m != 'aggregate')} (or auto)",
        )


def _validate_warm_start(c: ExperimentConfig) -> None:
    a = c.algorithm
    if a.warm_start_variant is not None and not a.warm_start:
        raise ConfigError(
            "algorithm.warm_start_variant",
            a.warm_start_variant,
            "only with algorithm.warm_start: true; remove it",
        )
    if c.warm_start_variant == "authors_code" and c.privacy.calibrate != "none":
        raise ConfigError(
            "algorithm.warm_start_variant",
            "authors_code",
            "the authors' warm start is for reproducing their runs, not for calibration; use "
            "warm_start_variant: paper (or a cold start) with privacy.calibrate",
        )
    if c.warm_start_variant == "authors_code" and c.rounds <= c.warmup_rounds:
        raise ConfigError(
            "rounds",
            c.rounds,
            f"the authors' warm start spends the first {c.warmup_rounds} of the rounds on c_i⁰; "
            f"set rounds > {c.warmup_rounds}",
        )


def _validate_noise_support(c: ExperimentConfig) -> None:
    """The papers' literal top-k variants: noise that follows a client's mask is added by it."""
    a = c.algorithm
    if a.mask_source == "noisy" and a.noise_support == "kept":
        raise ConfigError(
            "algorithm.noise_support",
            a.noise_support,
            "mask_source: noisy takes the top-k of a densely noised update; remove noise_support",
        )
    literal = {"noise_support": "kept", "mask_source": "noisy"}
    for name, value in literal.items():
        if getattr(a, name) == value and c.noise_placement != "client":
            raise ConfigError(
                f"algorithm.{name}",
                value,
                "this paper-literal variant masks each client's own noise, so the clients must "
                "add it: set algorithm.noise_placement: client (and a fixed cohort)",
            )


def _validate_preset_options(a: AlgorithmConfig) -> None:
    accepted = inspect.signature(PRESETS[a.name]).parameters
    for name, value in a.preset_options().items():
        if name not in accepted:
            users = sorted(presets_taking(name))
            raise ConfigError(
                f"algorithm.{name}",
                value,
                f"{a.name} has no such option; only for {', '.join(users)}; remove it",
            )
    for name in DP_OPTION_FIELDS + SAMPLE_DP_OPTION_FIELDS:
        if getattr(a, name) is not None and a.name not in PRIVATE_PRESETS:
            raise ConfigError(
                f"algorithm.{name}", getattr(a, name), f"{a.name} is non-private; remove it"
            )
    for name in ("adjacency", "clip_rule"):
        if getattr(a, name) is not None and a.name not in SAMPLE_LEVEL_PRESETS:
            raise ConfigError(
                f"algorithm.{name}",
                getattr(a, name),
                f"a DP-SGD option; {a.name} is client-level: remove it, or use "
                f"{' or '.join(sorted(SAMPLE_LEVEL_PRESETS))}",
            )
    for name in ("blur_lambda", "blur_bound"):
        if getattr(a, name) is not None and getattr(a, name) < 0:
            raise ConfigError(f"algorithm.{name}", getattr(a, name), "must be >= 0")
    if a.pgn_beta is not None and not 0 < a.pgn_beta <= 1:
        raise ConfigError("algorithm.pgn_beta", a.pgn_beta, "must be in (0, 1] (0.3 in the paper)")
    for name in ("pgn_rho", "ls_sigma"):
        if getattr(a, name) is not None and getattr(a, name) < 0:
            raise ConfigError(f"algorithm.{name}", getattr(a, name), "must be >= 0")
    if a.server_momentum is not None and not 0 <= a.server_momentum < 1:
        raise ConfigError(
            "algorithm.server_momentum", a.server_momentum, "must be in [0, 1), e.g. 0.9"
        )
    if a.name in FIXED_STEP_PRESETS and a.local.local_steps is None:
        raise ConfigError(
            "algorithm.local.local_steps",
            None,
            f"{a.name} scales its server step by η·K: set local_steps (and local_epochs: null)",
        )
    if a.lus_sparsity is not None and not 0 <= a.lus_sparsity < 1:
        raise ConfigError(
            "algorithm.lus_sparsity", a.lus_sparsity, "must be in [0, 1) (0.7 in the paper)"
        )
    if a.rho is not None and a.rho < 0:
        raise ConfigError("algorithm.rho", a.rho, "the SAM radius must be >= 0 (0.5 in DP-FedSAM)")
    if a.keep_fraction is not None and not 0 < a.keep_fraction <= 1:
        raise ConfigError(
            "algorithm.keep_fraction", a.keep_fraction, "must be in (0, 1] (0.4 in the papers)"
        )


def _validate_cohort(c: ExperimentConfig) -> None:
    _positive("cohort.size", c.cohort.size, "20")
    if c.cohort.size > c.data.num_clients:
        raise ConfigError(
            "cohort.size",
            c.cohort.size,
            f"the cohort cannot exceed the population of {c.data.num_clients} "
            f"clients; lower cohort.size or raise data.num_clients",
        )


def _validate_privacy(c: ExperimentConfig) -> None:
    p = c.privacy
    if p.delta is not None and not 0 < p.delta < 1:
        raise ConfigError(
            "privacy.delta", p.delta, f"δ must be in (0, 1), e.g. {c.population**-1.1:.3g}"
        )
    if p.population is not None and p.population < c.data.num_clients:
        raise ConfigError(
            "privacy.population",
            p.population,
            f"the population the ε is claimed for must include the {c.data.num_clients} "
            "simulated clients; raise it or remove it",
        )
    if p.noise_cohort_size is not None and not 1 <= p.noise_cohort_size <= c.population:
        raise ConfigError(
            "privacy.noise_cohort_size",
            p.noise_cohort_size,
            f"must be in [1, {c.population}] (the population); raise privacy.population to "
            "claim ε for a larger deployment",
        )
    if c.accountant_name == "paper" and not c.sample_level:
        raise ConfigError(
            "privacy.accountant",
            "paper",
            "DP-SCAFFOLD's accountant is for the sample-level presets; use auto, rdp, pld or prv",
        )
    if not c.sample_level and c.accountant_name not in accountants_for(c.sampling_assumption):
        raise ConfigError(
            "privacy.accountant",
            p.accountant,
            f"{p.accountant} has no analysis of sampling without replacement (the fixed-size "
            "cohort's assumption); use accountant: rdp or auto, cohort.sampling: poisson, or "
            "privacy.sampling: poisson to account the fixed cohort as Poisson (approximation)",
        )
    if p.calibrate != "none" and p.target_epsilon is None:
        raise ConfigError(
            "privacy.calibrate", p.calibrate, "calibration needs privacy.target_epsilon, e.g. 8.0"
        )
    budgeted = p.calibrate != "none" or p.target_epsilon is not None
    reason = c.unaccounted_reason if budgeted else None
    if reason is not None:
        field_name = "privacy.calibrate" if p.calibrate != "none" else "privacy.target_epsilon"
        raise ConfigError(
            field_name,
            getattr(p, field_name.split(".")[1]),
            f"{c.algorithm.name} as configured has no ε to calibrate or budget ({reason}); "
            "remove it and set algorithm.noise_multiplier, or use the accounted variant "
            + (
                "(clip_rule: fixed with a clip_norm)"
                if c.sample_level
                else "(noise_support: dense, mask_source: clean)"
            ),
        )
    if p.calibrate == "rounds" and c.algorithm.noise_multiplier is None:
        raise ConfigError(
            "privacy.calibrate",
            p.calibrate,
            "calibrating rounds needs algorithm.noise_multiplier; or use calibrate: sigma",
        )
    if p.target_epsilon is not None:
        _positive("privacy.target_epsilon", p.target_epsilon, "8.0")
        if c.algorithm.name not in PRIVATE_PRESETS:
            raise ConfigError(
                "privacy.target_epsilon",
                p.target_epsilon,
                f"{c.algorithm.name} is non-private; use dp_fedavg or remove it",
            )
        if not c.algorithm.noise_multiplier and p.calibrate != "sigma":
            raise ConfigError(
                "privacy.target_epsilon",
                p.target_epsilon,
                "σ = 0 gives no privacy to budget; set algorithm.noise_multiplier > 0",
            )


def _validate_executor(c: ExperimentConfig) -> None:
    e = c.executor
    _positive("executor.num_actors", e.num_actors, "2")
    _positive("executor.cpus_per_actor", e.cpus_per_actor, "1")
    g = e.gpus_per_actor
    if g < 0 or (g > 1 and g != int(g)):
        raise ConfigError(
            "executor.gpus_per_actor",
            g,
            "must be a fraction in [0, 1] or a whole number of GPUs, e.g. 0.25",
        )
    if e.num_actors > c.data.num_clients:
        raise ConfigError(
            "executor.num_actors",
            e.num_actors,
            f"more actors than the {c.data.num_clients} clients; lower it",
        )
