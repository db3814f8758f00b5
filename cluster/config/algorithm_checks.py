"""The ``algorithm:`` section's checks against the whole experiment (the cohort, the noise
placement, the privacy unit), with those of the preset families with their own rules
(``families``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from algorithms.norms import MIN_CLIP_NORM
from algorithms.presets import PRIVATE_PRESETS, SAMPLE_LEVEL_PRESETS, SKETCH_PRESETS, presets_taking
from cluster.config.algorithm import validate_preset_options
from cluster.config.errors import FLOAT_LIMIT, ConfigError, positive, start_from
from cluster.config.families import validate_noise_support, validate_sample_level, validate_sketch

if TYPE_CHECKING:
    from cluster.config.experiment import ExperimentConfig


def validate_algorithm(c: ExperimentConfig) -> None:
    a, local = c.algorithm, c.algorithm.local
    positive("algorithm.local.lr", local.lr, "0.1")
    positive("algorithm.local.batch_size", local.batch_size, "32")
    if (local.local_steps is None) == (local.local_epochs is None):
        raise ConfigError(
            "algorithm.local.local_steps",
            local.local_steps,
            "set exactly one of local_steps and local_epochs (the other to null)",
        )
    if local.local_steps is not None:
        positive("algorithm.local.local_steps", local.local_steps, "10")
    if local.local_epochs is not None:
        positive("algorithm.local.local_epochs", local.local_epochs, "1")
    if not 0 <= local.momentum < 1:
        raise ConfigError("algorithm.local.momentum", local.momentum, "must be in [0, 1)")
    if local.weight_decay < 0:
        raise ConfigError("algorithm.local.weight_decay", local.weight_decay, "must be >= 0")
    if local.max_grad_norm is not None:
        positive("algorithm.local.max_grad_norm", local.max_grad_norm, "10 (or null: none)")
        if a.name in SAMPLE_LEVEL_PRESETS | SKETCH_PRESETS:
            raise ConfigError(
                "algorithm.local.max_grad_norm",
                local.max_grad_norm,
                f"{a.name}'s clients clip their gradients already (per example, or the batch "
                "gradient they sketch): remove it" + start_from(a.name),
            )
    if not 0 < local.lr_decay <= 1:
        raise ConfigError(
            "algorithm.local.lr_decay",
            local.lr_decay,
            "must be in (0, 1]: round t uses lr·lr_decay^t (1 = constant, the papers use 0.998)",
        )
    positive("algorithm.server_lr", a.server_lr, "1.0")
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
                    "clip_rule median picks C from the data (each batch's per-example norms, or "
                    "each client's per-tensor update norms); remove clip_norm",
                )
            if not c.sample_level:
                validate_client_median(c)
        elif a.clip_norm is None or not a.clip_norm >= MIN_CLIP_NORM:
            raise ConfigError(
                "algorithm.clip_norm",
                a.clip_norm,
                f"the clip norm C must be > 0, at least {MIN_CLIP_NORM:g}: below it the float32 "
                "norm of an update or gradient above C can underflow to 0 and skip the clip "
                "(e.g. 1.0; .inf disables clipping)" + start_from(a.name),
            )
        sigma_is_calibrated = c.privacy.calibrate == "sigma" and a.noise_multiplier is None
        if c.paper_sketch_noise:
            sigma_is_calibrated = True  # σ comes from paper_epsilon (checked with the sketch)
        if not sigma_is_calibrated and (a.noise_multiplier is None or a.noise_multiplier < 0):
            raise ConfigError(
                "algorithm.noise_multiplier",
                a.noise_multiplier,
                "the noise multiplier σ must be >= 0 (e.g. 1.0)" + start_from(a.name),
            )
        noised = sigma_is_calibrated or a.noise_multiplier > 0
        if noised and a.clip_norm is not None and math.isinf(a.clip_norm):
            raise ConfigError(
                "algorithm.clip_norm",
                a.clip_norm,
                "noise needs a finite clip norm to bound sensitivity; set C > 0",
            )
        if noised and a.noise_multiplier is not None and a.clip_norm is not None:
            check_noise_fits_float32(c)
        if a.weighting != "uniform":
            raise ConfigError(
                "algorithm.weighting",
                a.weighting,
                "DP needs uniform weighting (sample counts are private); use uniform",
            )
        if c.sample_level:
            validate_sample_level(c)
        elif (
            c.noise_placement == "client"
            and c.cohort.sampling == "poisson"
            and not c.paper_sketch_noise  # DPSFL's own noise: every client, whole (local)
        ):
            raise ConfigError(
                "algorithm.noise_placement",
                c.noise_placement,
                "client-placed noise sums to σC only over a fixed-size cohort; use "
                + (
                    "cohort.sampling: fixed (clip_rule median needs client-placed noise)"
                    if a.clip_rule == "median"
                    else "cohort.sampling: fixed or noise_placement: server"
                ),
            )
        if not c.sample_level:
            validate_noise_support(c)
    else:
        for name in ("clip_norm", "noise_multiplier"):
            if getattr(a, name) is not None:
                raise ConfigError(
                    f"algorithm.{name}",
                    getattr(a, name),
                    f"{a.name} is non-private; remove it or use dp_fedavg" + start_from(a.name),
                )
    validate_preset_options(a)
    if a.name in SKETCH_PRESETS:
        validate_sketch(c)


def check_noise_fits_float32(c: ExperimentConfig) -> None:
    """σ·C, the std of the noise on the sum, times the learning rates that carry the noise into
    the float32 model (the server's; the local one too where the noise is added to each batch
    gradient, sample-level), must stay a float32 number: beyond it the model becomes inf and
    the run would go on with an ε for noise that never reached it."""
    a = c.algorithm
    rates = [("algorithm.server_lr", a.server_lr)]
    if c.sample_level:
        rates.append(("algorithm.local.lr", a.local.lr))
    reach, product = a.noise_multiplier * a.clip_norm, "σ·C"
    for name, rate in rates:
        if rate > 1:
            reach, product = reach * rate, f"{product}·{name}"
    if reach > FLOAT_LIMIT:
        raise ConfigError(
            "algorithm.noise_multiplier",
            a.noise_multiplier,
            f"{product} = {reach:.3g} is beyond float32's largest number {FLOAT_LIMIT:g}: the "
            "noise would make the model inf; lower noise_multiplier or clip_norm",
        )


def validate_client_median(c) -> None:
    """``clip_rule: median`` at client level (the DP-FedPGN authors' code): every tensor of a
    client's update clipped to the median of its per-tensor norms, noise scaled to that median
    by the client itself."""
    a = c.algorithm
    if a.name in SKETCH_PRESETS:
        raise ConfigError(
            "algorithm.clip_rule",
            a.clip_rule,
            f"{a.name} clips its batch gradient flat before sketching; the median rule is for "
            "model updates clipped per layer: remove it",
        )
    if a.clip_scope == "flat":
        raise ConfigError(
            "algorithm.clip_scope",
            a.clip_scope,
            "clip_rule median clips each tensor to the median of the client's per-tensor norms: "
            "set clip_scope: layer (or leave it unset)",
        )
    if a.name in presets_taking("blur_bound") and a.blur_bound is None:
        raise ConfigError(
            "algorithm.blur_bound",
            None,
            "BLUR's radius defaults to the clip norm, which clip_rule median does not have: "
            "set it (e.g. the C of the fixed-clip run, 0.3)",
        )
    if c.noise_placement == "server":
        raise ConfigError(
            "algorithm.noise_placement",
            c.noise_placement,
            "clip_rule median scales each client's noise to its own median, which only the "
            "client knows: use noise_placement: client (the authors' code)",
        )
