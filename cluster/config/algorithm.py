"""``algorithm:``: the preset, its local trainer, clipping and noise, and each preset's options.

The options are keyword arguments of the preset functions in ``algorithms/presets.py`` (whose
signatures hold the papers' defaults); null here means "the preset's default".
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from algorithms.presets import (
    CONTROL_VARIATE_PRESETS,
    FIXED_STEP_PRESETS,
    PRESET_OPTIONS,
    PRESETS,
    PRIVATE_PRESETS,
    SAMPLE_LEVEL_PRESETS,
    SKETCH_PRESETS,
    presets_taking,
)
from cluster.config.errors import ConfigError, start_from


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
    # every mini-batch gradient clipped to this L2 norm before the step (the DP-FedPGN
    # authors' code: maxnorm 10; an optimisation knob, no part of any privacy guarantee)
    max_grad_norm: float | None = None


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
    lus_scope: Literal["tensor", "module", "global"] | None = None  # LUS groups (per tensor)
    lus_score: Literal["taylor", "magnitude", "random"] | None = None  # LUS ablation (taylor)
    pgn_beta: float | None = None  # DP-FedPGN mixing β (0.3)
    pgn_rho: float | None = None  # DP-FedPGN perturbation radius ρ (0.2)
    # ascent: δ = +ρ·g̃/‖g̃‖ (the paper, default); descent: −ρ·g̃/‖g̃‖ (the authors' LESAM)
    pgn_perturbation: Literal["ascent", "descent"] | None = None
    ls_sigma: float | None = None  # Laplacian smoothing σ_ls (0.01); the stencil's λ
    ls_scope: Literal["flat", "tensor"] | None = None  # one flat signal (default) or per tensor
    # inverse: A_σ⁻¹ (the papers, default); stencil: the DP-FedPGN authors' one explicit
    # stencil step per tensor on the update (not on g̃)
    ls_operator: Literal["inverse", "stencil"] | None = None
    server_momentum: float | None = None  # server momentum μ (any preset; off by default)
    # The mean's denominator: the nominal cohort size (m, or qN under Poisson) or the realised
    # number of uploads |P_t| (BLUR+LUS's Alg. 1; unaccounted: the count carries no noise)
    mean_denominator: Literal["nominal", "realised"] = "nominal"
    # Sample-level presets (dp_fedavg_sample, dp_scaffold): DP-SGD in every local step
    adjacency: Literal["replace_one", "add_remove"] | None = None  # replace_one (the paper)
    clip_rule: Literal["fixed", "median"] | None = None  # median: the authors' codes; no ε
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
    # zero_error: FetchSGD's code (zero S_e where Δ hashes); zero_error_and_momentum: S_u too;
    # subtract: S_e −= S(Δ) (the papers)
    sketch_feedback: Literal["zero_error", "zero_error_and_momentum", "subtract"] | None = None
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


# ----------------------------------------------------------------------------- checks


def validate_preset_options(a: AlgorithmConfig) -> None:
    accepted = inspect.signature(PRESETS[a.name]).parameters
    for name, value in a.preset_options().items():
        if name not in accepted:
            users = sorted(presets_taking(name))
            raise ConfigError(
                f"algorithm.{name}",
                value,
                f"{a.name} has no such option; only for {', '.join(users)}; remove it"
                + start_from(a.name),
            )
    for name in DP_OPTION_FIELDS + SAMPLE_DP_OPTION_FIELDS:
        if getattr(a, name) is not None and a.name not in PRIVATE_PRESETS:
            raise ConfigError(
                f"algorithm.{name}",
                getattr(a, name),
                f"{a.name} is non-private; remove it" + start_from(a.name),
            )
    if a.adjacency is not None and a.name not in SAMPLE_LEVEL_PRESETS:
        raise ConfigError(
            "algorithm.adjacency",
            a.adjacency,
            f"a DP-SGD option; {a.name} is client-level: remove it, or use "
            f"{' or '.join(sorted(SAMPLE_LEVEL_PRESETS))}" + start_from(a.name),
        )
    for name in ("blur_lambda", "blur_bound"):
        if getattr(a, name) is not None and getattr(a, name) < 0:
            raise ConfigError(f"algorithm.{name}", getattr(a, name), "must be >= 0")
    if a.pgn_beta is not None and not 0 < a.pgn_beta <= 1:
        raise ConfigError("algorithm.pgn_beta", a.pgn_beta, "must be in (0, 1] (0.3 in the paper)")
    for name in ("pgn_rho", "ls_sigma"):
        if getattr(a, name) is not None and getattr(a, name) < 0:
            raise ConfigError(f"algorithm.{name}", getattr(a, name), "must be >= 0")
    if a.pgn_perturbation == "descent" and a.pgn_rho == 0:
        raise ConfigError(
            "algorithm.pgn_perturbation",
            a.pgn_perturbation,
            "pgn_rho 0 perturbs nothing, in either direction: remove it or set pgn_rho > 0",
        )
    if a.ls_operator == "stencil" and a.ls_scope is not None:
        raise ConfigError(
            "algorithm.ls_scope",
            a.ls_scope,
            "ls_operator stencil acts on each tensor by its shape (1-D, 2-D, 4-D), as the "
            "authors' code does: remove ls_scope (it chooses A⁻¹'s signal)",
        )
    if a.server_momentum is not None and not 0 <= a.server_momentum < 1:
        raise ConfigError(
            "algorithm.server_momentum", a.server_momentum, "must be in [0, 1), e.g. 0.9"
        )
    if a.mean_denominator == "realised" and a.name in SKETCH_PRESETS | SAMPLE_LEVEL_PRESETS:
        raise ConfigError(
            "algorithm.mean_denominator",
            a.mean_denominator,
            f"realised is the client-level mean's option (BLUR+LUS); {a.name} averages over "
            "the nominal cohort: use nominal",
        )
    if a.mean_denominator == "realised" and a.weighting != "uniform":
        raise ConfigError(
            "algorithm.mean_denominator",
            a.mean_denominator,
            "sample weighting divides by the clients' sample counts already; use nominal",
        )
    if a.name in FIXED_STEP_PRESETS and a.local.local_steps is None:
        raise ConfigError(
            "algorithm.local.local_steps",
            None,
            f"{a.name} scales its server step by η·K: set local_steps (and local_epochs: null)"
            + start_from(a.name),
        )
    if a.name in FIXED_STEP_PRESETS and a.local.momentum:
        raise ConfigError(
            "algorithm.local.momentum",
            a.local.momentum,
            f"{a.name} strips the public drift (1 − β)·K·η·g̃ from each update before clipping, "
            "which is exact only without local momentum (momentum compounds it): set 0, as the "
            "paper does" + start_from(a.name),
        )
    if a.name in FIXED_STEP_PRESETS and a.local.lr_scaling != "none":
        raise ConfigError(
            "algorithm.local.lr_scaling",
            a.local.lr_scaling,
            f"{a.name} strips the public drift (1 − β)·K·η·g̃ at each client's own lr and adds it "
            "back at the server at the configured η·K: a per-client lr (inverse_sk) leaves part "
            "of the drift in the update and rescales g̃; set none, as the paper does"
            + start_from(a.name),
        )
    if a.name in CONTROL_VARIATE_PRESETS and a.local.momentum:
        raise ConfigError(
            "algorithm.local.momentum",
            a.local.momentum,
            f"{a.name}'s control variate c_i⁺ = c_i − c + (x − y)/(Kη) is the mean local "
            "gradient only for plain SGD steps: set 0, as the paper does" + start_from(a.name),
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
