"""Checks of the preset families with their own rules: sample-level DP-SGD (DP-SCAFFOLD and its
warm start), the papers' literal top-k variants, and the sketched presets (FetchSGD, DPSFL,
DPSFL-AC's adaptive clipping)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from algorithms.presets import COMPRESSION_LEVELS, PAPER_DELTA
from algorithms.sketch import rho_from_epsilon
from cluster.config.errors import ConfigError, start_from
from privacy.record_level import methods_for

if TYPE_CHECKING:
    from cluster.config.experiment import ExperimentConfig


MAX_SKETCH_SIZE = 2**31 - 1  # torch indexes one tensor's counters and top-k with int32
# η_C and σ_b: at most 10 each keep η_C·|b̄ − γ| below exp's overflow at 709 (b̄'s noise ≤ 6σ_b)
MAX_CLIP_STEP = 10


def validate_sample_level(c: ExperimentConfig) -> None:
    """DP-SGD presets: what the record-level accountant needs to describe the run."""
    a = c.algorithm
    if a.local.local_steps is None:
        raise ConfigError(
            "algorithm.local.local_epochs",
            a.local.local_epochs,
            "sample-level accounting charges K noisy steps per round: set local_steps (and "
            "local_epochs: null)" + start_from(a.name),
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
            f"{a.name} adds its noise in every local DP-SGD step of the clients; remove it"
            + start_from(a.name),
        )
    if c.privacy.sampling != "match":
        raise ConfigError(
            "privacy.sampling",
            c.privacy.sampling,
            "client-level accounting option; the record-level ε holds for either cohort "
            "sampler (only the participation rate l enters): remove it" + start_from(a.name),
        )
    validate_sample_level_deployment(c)
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


def validate_sample_level_deployment(c: ExperimentConfig) -> None:
    """``privacy.noise_cohort_size`` / ``privacy.population`` (a deployment of C_n of N clients
    per round) only where the simulation carries that deployment's noise: DP-FedAvg at sample
    level (its clients' noise is scaled by √(m/C_n), ``SampleDP``) with the record-level
    accountants. DP-SCAFFOLD's c_i stay with the m-of-M simulated clients and c averages the
    simulated M, and the paper's accountant reads the simulated M: neither is the deployment's."""
    p = c.privacy
    if p.noise_cohort_size is None and p.population is None:
        return
    name = "noise_cohort_size" if p.noise_cohort_size is not None else "population"
    option, value = f"privacy.{name}", getattr(p, name)
    if c.algorithm.name != "dp_fedavg_sample":
        raise ConfigError(
            option,
            value,
            f"{c.algorithm.name}'s control variates c_i and c live on the simulated clients, so "
            "its noise cannot be the deployment's; use dp_fedavg_sample or remove it",
        )


def validate_warm_start(c: ExperimentConfig) -> None:
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


def validate_noise_support(c: ExperimentConfig) -> None:
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


def validate_sketch(c: ExperimentConfig) -> None:
    """fetchsgd, dpsfl, dpsfl_ac: one batch gradient per client, a valid sketch and clip loop."""
    a, local = c.algorithm, c.algorithm.local
    plain_sgd = {"local_steps": 1, "lr": 1.0, "momentum": 0.0, "lr_decay": 1.0, "weight_decay": 0.0}
    for name, value in plain_sgd.items():
        if getattr(local, name) != value:
            raise ConfigError(
                f"algorithm.local.{name}",
                getattr(local, name),
                f"{a.name} clients upload one batch gradient (u = −g): set local_steps: 1, "
                "lr: 1.0, momentum: 0, lr_decay: 1, weight_decay: 0; the step size is "
                "algorithm.server_lr (η) "
                "and the momentum algorithm.sketch_momentum (β)" + start_from(a.name),
            )
    if local.lr_scaling != "none":
        raise ConfigError(
            "algorithm.local.lr_scaling",
            local.lr_scaling,
            f"{a.name} takes no lr; remove it" + start_from(a.name),
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
        if getattr(a, name) is not None and not 1 <= getattr(a, name) <= MAX_SKETCH_SIZE:
            raise ConfigError(
                f"algorithm.{name}", getattr(a, name), f"must be in [1, {MAX_SKETCH_SIZE}]"
            )
    counters = (a.sketch_rows or 0) * (a.sketch_cols or 0)
    if counters > MAX_SKETCH_SIZE:
        raise ConfigError(
            "algorithm.sketch_cols",
            a.sketch_cols,
            f"a sketch of sketch_rows × sketch_cols = {counters} counters is over "
            f"{MAX_SKETCH_SIZE} (one tensor's limit); lower either",
        )
    if a.sketch_momentum is not None and not 0 <= a.sketch_momentum < 1:
        raise ConfigError(
            "algorithm.sketch_momentum", a.sketch_momentum, "must be in [0, 1), e.g. 0.9"
        )
    if a.paper_epsilon is not None and not (
        c.paper_sketch_noise
        and a.paper_epsilon > 0
        and rho_from_epsilon(a.paper_epsilon, PAPER_DELTA) > 0  # 0 below ε ≈ 1e-16
    ):
        raise ConfigError(
            "algorithm.paper_epsilon",
            a.paper_epsilon,
            "only with sketch_noise: paper, and > 1e-15 (its ρ is 0 below; the paper: 2 to 10, "
            "default 4)",
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
        value = getattr(a, name)
        if value is not None and not 0 < value <= MAX_CLIP_STEP:
            raise ConfigError(
                f"algorithm.{name}",
                value,
                f"must be in (0, {MAX_CLIP_STEP}], e.g. {example} (C·exp(−η_C(b̄ − γ)) "
                "overflows beyond)",
            )
