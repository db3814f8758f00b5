"""``validate``: every check of the whole experiment before any work starts. Here too the checks
of ``data:``, ``cohort:``, ``privacy:`` and the runtime sections that read other sections (the
algorithm's: ``algorithm_checks``); a section's checks of itself stay with its schema."""

from __future__ import annotations

import math
from dataclasses import asdict

from algorithms.presets import CLIENT_LEVEL_PRESETS, PRESETS, PRIVATE_PRESETS
from cluster.config.algorithm_checks import validate_algorithm
from cluster.config.data import (
    DataConfig,
    validate_partition,
    validate_preparation,
    validate_validation,
)
from cluster.config.errors import ConfigError, check_seed, choice, positive
from cluster.config.experiment import ExperimentConfig
from cluster.config.families import validate_warm_start
from cluster.config.runtime import (
    ExecutorConfig,
    check_name,
    in_ray_job,
    ray_endpoint,
    starts_embedded_ray,
)
from datasets.glue import GLUE_SOURCES, folder_problem
from datasets.partition import PARTITION_METHODS
from datasets.sources import SOURCES, source_shape
from datasets.tasks import TASKS
from datasets.vision import EMNIST_SPLITS, SOURCE_NAMES, image_shape
from models import PRETRAINED_LOADERS, input_problem
from privacy.accountant import accountants_for
from privacy.pld import DEFAULT_MAX_EPSILON, MIN_DELTA


def validate(c: ExperimentConfig) -> None:
    """Every check that can fail before any data is built or any actor is started."""
    choice("task", c.task, TASKS, "task")
    choice("data.source", c.data.source, SOURCES, "data source")
    if c.data.source not in TASKS[c.task].sources:
        raise ConfigError(
            "data.source",
            c.data.source,
            f"task {c.task} reads {' or '.join(TASKS[c.task].sources)} data",
        )
    choice("data.partition.method", c.data.partition.method, PARTITION_METHODS, "partition")
    choice("algorithm.name", c.algorithm.name, PRESETS, "algorithm")
    check_seed("seed", c.seed)
    check_seed("stream_seed", c.stream_seed)
    check_seed("algorithm.sketch_seed", c.algorithm.sketch_seed)
    positive("rounds", c.rounds, "100")
    positive("eval_every", c.eval_every, "1")
    if c.stop_at_bytes is not None:
        positive("stop_at_bytes", c.stop_at_bytes, "2e9: bytes up and down, all clients, or null")
    positive("data.num_clients", c.data.num_clients, "100")
    validate_data(c)
    validate_algorithm(c)
    validate_cohort(c)
    validate_warm_start(c)
    validate_privacy(c)
    validate_runtime(c)


def validate_data(c: ExperimentConfig) -> None:
    s, p = c.data.synthetic, c.data.partition
    c.data.configured_store_root()  # a malformed URI is refused with the config
    c.data.store_location()
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
    validate_preparation(c.data)
    validate_pretrained(c)
    if c.data.only_digits and c.data.source != "femnist":
        raise ConfigError("data.only_digits", True, "only for source femnist; remove it")
    check_source_options(c.data)
    if c.data.source == "synthetic":
        for name in ("alpha", "beta"):
            if getattr(s, name) < 0:
                raise ConfigError(f"data.synthetic.{name}", getattr(s, name), "must be >= 0")
        positive("data.synthetic.samples_per_user", s.samples_per_user, "5000")
        positive("data.synthetic.num_features", s.num_features, "40")
        if s.num_classes < 2:
            raise ConfigError("data.synthetic.num_classes", s.num_classes, "must be >= 2")
        if not 0 <= s.label_noise <= 1:
            raise ConfigError("data.synthetic.label_noise", s.label_noise, "must be in [0, 1]")
        train_rows = round(s.train_fraction * s.samples_per_user)  # each user's, as generated
        if not 0 < train_rows < s.samples_per_user:
            raise ConfigError(
                "data.synthetic.train_fraction",
                s.train_fraction,
                f"must leave each user at least one training and one test row of its "
                f"{s.samples_per_user} (samples_per_user); e.g. 0.8",
            )
    validate_partition(p)
    if c.data.validation is not None:
        validate_validation(c.data.validation, c.data.num_clients)
    check_model_input(c)  # last: the source's row shape needs its options checked


def fields_set(section) -> list[tuple[str, object]]:
    """(name, value) of each field of the config section ``section`` (a dataclass whose fields
    all have defaults) that is set away from its default, in the section's order."""
    default = type(section)()
    return [(k, v) for k, v in asdict(section).items() if v != getattr(default, k)]


PCA_SOURCES = ("mnist", "mnist_test_split")


def check_model_input(c: ExperimentConfig) -> None:
    """``data.pca_components``: for the MNIST sources, at most their pixels; and the rows the
    source gives after it (features, or images) are what the task's model takes
    (``models.input_problem``), so a mismatch fails here, not after the store is built."""
    d = c.data
    if d.pca_components is not None and d.source not in PCA_SOURCES:
        raise ConfigError(
            "data.pca_components",
            d.pca_components,
            f"only for sources {' and '.join(PCA_SOURCES)}; remove it",
        )
    if d.pca_components is not None:
        pixels = math.prod(image_shape(d.source))
        if not 1 <= d.pca_components <= pixels:
            raise ConfigError(
                "data.pca_components",
                d.pca_components,
                f"must be in [1, {pixels}] (the images' pixels), e.g. 60 (DP-SCAFFOLD's)",
            )
    task = TASKS[c.task]
    if task.preprocess.pad and d.standardize_unit_norm:  # (PCA is for the MNIST sources only)
        raise ConfigError(
            "data.standardize_unit_norm",
            d.standardize_unit_norm,
            f"task {c.task} frames its images with black pixels, which rows of standardised "
            f"or PCA features are not: remove it, or run task {task.model_name} (the images as "
            "stored)",
        )
    model = task.model_name
    shape, _ = source_shape(d.source, d.source_options())
    problem = input_problem(model, shape)
    if problem is not None:
        fix = (
            "set data.pca_components: 60"
            if model == "mlp_pca60"
            else f"remove data.pca_components ({model} takes the images)"
        )
        raise ConfigError(
            "data.pca_components", d.pca_components, f"task {c.task}: {problem}; {fix}"
        )


def check_source_options(d: DataConfig) -> None:
    """``data.synthetic`` (any field away from its default) only for source synthetic, and
    ``data.download`` only for the sources it fetches (the vision ones): elsewhere they would be
    ignored."""
    changed = fields_set(d.synthetic)
    if d.source != "synthetic" and changed:
        name, value = changed[0]
        raise ConfigError(
            f"data.synthetic.{name}",
            value,
            f"only for source synthetic, and this run reads {d.source}; remove it",
        )
    if d.download and d.source not in SOURCE_NAMES:
        raise ConfigError(
            "data.download",
            True,
            f"fetches the files of sources {', '.join(SOURCE_NAMES)}; {d.source} has none to "
            "fetch: remove it",
        )


def validate_pretrained(c: ExperimentConfig) -> None:
    """``data.pretrained``: a folder inside data.root, for a model that loads one (or a GLUE
    source, whose tokenizer it holds); ``data.max_length``: GLUE sources only."""
    d = c.data
    if d.pretrained is not None:
        problem = folder_problem(d.pretrained)
        if problem is not None:
            raise ConfigError("data.pretrained", d.pretrained, problem)
        model = TASKS[c.task].model_name
        if model not in PRETRAINED_LOADERS and d.source not in GLUE_SOURCES:
            raise ConfigError(
                "data.pretrained",
                d.pretrained,
                f"task {c.task}'s model {model} loads no pretrained weights (those that do: "
                f"{', '.join(sorted(PRETRAINED_LOADERS))}); remove it",
            )
    if d.source in GLUE_SOURCES and d.pretrained is None:
        raise ConfigError(
            "data.pretrained",
            None,
            f"source {d.source} is tokenised by the pretrained folder's vocab.json + merges.txt: "
            "name that folder inside data.root (e.g. roberta-base)",
        )
    if d.max_length is not None and (d.source not in GLUE_SOURCES or not 3 <= d.max_length <= 512):
        raise ConfigError(
            "data.max_length",
            d.max_length,
            f"only for sources {', '.join(GLUE_SOURCES)}, in [3, 512] (e.g. 128); "
            "remove it otherwise",
        )


def validate_cohort(c: ExperimentConfig) -> None:
    positive("cohort.size", c.cohort.size, "20")
    if c.cohort.size > c.data.num_clients:
        raise ConfigError(
            "cohort.size",
            c.cohort.size,
            f"the cohort cannot exceed the population of {c.data.num_clients} "
            f"clients; lower cohort.size or raise data.num_clients",
        )


def validate_privacy(c: ExperimentConfig) -> None:
    p = c.privacy
    changed = fields_set(p)
    if c.algorithm.name not in PRIVATE_PRESETS and changed:  # no ε is accounted: all unused
        name, value = changed[0]
        fix = f"{c.algorithm.name} is non-private; use dp_fedavg or remove it"
        raise ConfigError(f"privacy.{name}", value, fix)
    if p.secret_streams and c.stream_seed is not None:
        raise ConfigError(
            "stream_seed",
            c.stream_seed,
            "privacy.secret_streams draws the streams' key from the operating system; set "
            "stream_seed: null, or privacy.secret_streams: false to key them by this seed",
        )
    if p.delta is not None and not 0 < p.delta < 1:
        raise ConfigError(
            "privacy.delta", p.delta, f"δ must be in (0, 1), e.g. {c.population**-1.1:.3g}"
        )
    record_pld = c.sample_level and c.accountant_name in ("pld", "aggregate")
    if record_pld and p.delta is not None and p.delta < MIN_DELTA:
        # a client-level run falls back to RDP there; a record-level accountant cannot
        raise ConfigError(
            "privacy.delta",
            p.delta,
            f"below {MIN_DELTA:g} the record-level {c.accountant_name} accountant's float64 "
            "convolution is not accurate against δ; use privacy.accountant: rdp, or a larger δ",
        )
    if p.delta is None and c.population == 1 and c.algorithm.name in CLIENT_LEVEL_PRESETS:
        raise ConfigError(
            "privacy.delta",
            None,
            "unset, so δ = N^-1.1 = 1 for a population of N = 1 client: such a δ allows "
            "publishing that client's data in the clear; raise data.num_clients (or "
            "privacy.population) to the population to protect, or set privacy.delta, e.g. 1e-5",
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
    paper_sampling = ("fixed", "fresh", "replace_one")  # cohort, batches, adjacency it analyses
    ran = (c.cohort.sampling, c.batch_sampling, c.algorithm.adjacency or "replace_one")
    if c.accountant_name == "paper" and c.sample_level and ran != paper_sampling:
        raise ConfigError(
            "privacy.accountant",
            "paper",
            "DP-SCAFFOLD's accountant analyses fixed cohorts, fixed-size batches drawn without "
            f"replacement and replace-one adjacency; this run has {ran[0]} cohorts, {ran[1]} "
            f"batches and {ran[2]}: use auto (its number stays in the privacy report)",
        )
    if not c.sample_level and c.accountant_name not in accountants_for(c.sampling_assumption):
        raise ConfigError(
            "privacy.accountant",
            p.accountant,
            f"{p.accountant} has no analysis of sampling without replacement (the fixed-size "
            "cohort's assumption); use accountant: rdp or auto, or cohort.sampling: poisson",
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
                "(a partition that gives each row to one client: remove "
                "data.partition.samples_per_client)"
                if c.record_copies
                else "(clip_rule: fixed with a clip_norm)"
                if c.sample_level or c.algorithm.clip_rule == "median"
                else "(privacy.sampling: match)"
                if c.sampling_mismatch
                else "(algorithm.mean_denominator: nominal)"
                if c.algorithm.mean_denominator != "nominal"
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
        positive("privacy.target_epsilon", p.target_epsilon, "8.0")
        if p.target_epsilon > DEFAULT_MAX_EPSILON:
            raise ConfigError(
                "privacy.target_epsilon",
                p.target_epsilon,
                f"above {DEFAULT_MAX_EPSILON:g}, where an ε is no meaningful guarantee and the "
                "PLD and PRV accountants refuse to compute one (a calibrated σ would be near 0); "
                f"give a budget of at most {DEFAULT_MAX_EPSILON:g}, e.g. 8.0",
            )
        if not c.algorithm.noise_multiplier and p.calibrate != "sigma":
            raise ConfigError(
                "privacy.target_epsilon",
                p.target_epsilon,
                "σ = 0 gives no privacy to budget; set algorithm.noise_multiplier > 0",
            )


def validate_runtime(c: ExperimentConfig) -> None:
    e = c.executor
    positive("executor.num_actors", e.num_actors, "2")
    if not RESOURCE_UNIT <= e.cpus_per_actor <= MAX_RESOURCE:
        raise ConfigError(
            "executor.cpus_per_actor",
            e.cpus_per_actor,
            f"must be in [{RESOURCE_UNIT}, {MAX_RESOURCE}] (Ray's smallest share of a CPU, and "
            "the most torch threads a host starts), e.g. 1",
        )
    g = e.gpus_per_actor
    if not (g == 0 or RESOURCE_UNIT <= g <= 1 or (g == int(g) and 1 < g <= MAX_RESOURCE)):
        raise ConfigError(
            "executor.gpus_per_actor",
            g,
            f"must be 0, a fraction in [{RESOURCE_UNIT}, 1] or a whole number of GPUs up to "
            f"{MAX_RESOURCE}, e.g. 0.25",
        )
    if e.address is not None:
        ray_endpoint("executor.address", e.address)
    check_keep_warm(e)
    check_overlap_start(e)
    if e.kind == "local" and e.placement != "pack":
        raise ConfigError(
            "executor.placement",
            e.placement,
            "places Ray actors on nodes; the local executor has one process: set "
            "executor.kind=ray, or remove executor.placement",
        )
    if e.precision == "bf16" and c.sample_level:
        raise ConfigError(
            "executor.precision",
            e.precision,
            f"{c.algorithm.name}'s per-example gradients (algorithms/dpsgd.py) would run in "
            "bf16 on some paths only: the vectorised one and the sequential one for models of "
            "nn.Linear layers go through the autocast forward, the sequential one for other "
            "models (expanded, vmap_grad: a CNN, a median clip, a warm start, vectorize=false) "
            "calls the model in float32, so the precision would depend on the model and the "
            "kernels; bf16 DP-SGD is not validated (its clip and noise would stay float32): set "
            "executor.precision=float32",
        )
    check_name("tracking.experiment", c.tracking.experiment)
    if c.tracking.run_name is not None:
        check_name("tracking.run_name", c.tracking.run_name)
    if e.num_actors > c.data.num_clients:
        raise ConfigError(
            "executor.num_actors",
            e.num_actors,
            f"more actors than the {c.data.num_clients} clients; lower it",
        )
    persistent = c.checkpoint.configured_path().is_absolute() or c.data.store_is_absolute
    if in_ray_job() and not persistent:
        raise ConfigError(
            "checkpoint.dir",
            c.checkpoint.dir,
            "this Ray job runs in a temporary copy of the working directory, deleted when the "
            "job ends, and so would its checkpoints and shards: set DPFL_CHECKPOINT_DIR or "
            "DPFL_STORE_ROOT to an absolute path (--runtime-env-json '{\"env_vars\": {...}}'), "
            "or checkpoint.dir to one",
        )
    if c.checkpoint.every < 0:
        raise ConfigError("checkpoint.every", c.checkpoint.every, "must be >= 0 (0: at the end)")


def check_keep_warm(e: ExecutorConfig) -> None:
    """``executor.keep_warm_s``: 0, or idle seconds in [1, a day], and only where a Ray outlives
    the run (an address other than ``local``, from ``executor.address`` or ``$RAY_ADDRESS``):
    an embedded Ray ends with it."""
    if e.keep_warm_s == 0:
        return
    if not MIN_KEEP_WARM_S <= e.keep_warm_s <= MAX_KEEP_WARM_S:
        raise ConfigError(
            "executor.keep_warm_s",
            e.keep_warm_s,
            f"idle seconds a warm actor waits for the next run: 0 (none) or in "
            f"[{MIN_KEEP_WARM_S:g}, {MAX_KEEP_WARM_S:g}], e.g. 600",
        )
    if e.kind != "ray":
        raise ConfigError(
            "executor.keep_warm_s",
            e.keep_warm_s,
            "keeps Ray actors alive for the next run; the local executor has none: set "
            "executor.kind=ray with executor.address of a running Ray, or executor.keep_warm_s=0",
        )
    if starts_embedded_ray(e):
        raise ConfigError(
            "executor.keep_warm_s",
            e.keep_warm_s,
            "keeps Ray actors alive on a running Ray for the next run, but an embedded Ray ends "
            "with this run: set executor.address to a running Ray (`ray start --head`), submit "
            "the run with `ray job submit`, or set executor.keep_warm_s=0",
        )


MIN_KEEP_WARM_S, MAX_KEEP_WARM_S = 1.0, 86400.0


def check_overlap_start(e: ExecutorConfig) -> None:
    """``executor.overlap_start: true`` only where it applies: CPU actors on an embedded Ray
    (``cluster.runtime.overlapped_start``); ``auto`` leaves it off elsewhere."""
    if e.overlap_start is not True:
        return
    why = None
    if e.kind != "ray":
        why = "the local executor's hosts are in this process from the start"
    elif not starts_embedded_ray(e):
        why = (
            "a running Ray's actors (executor.address, RAY_ADDRESS, a Ray job's) may be on "
            "other machines, where this process has no data"
        )
    elif e.gpus_per_actor > 0:
        why = "hosts in this process would hold a CUDA context for the whole run"
    if why is not None:
        raise ConfigError(
            "executor.overlap_start",
            e.overlap_start,
            f"runs the first rounds in this process while an embedded Ray's CPU actors start; "
            f"here {why}: set executor.overlap_start=auto or false",
        )


RESOURCE_UNIT = 0.0001  # Ray refuses a fractional resource finer than this


MAX_RESOURCE = 1024
