"""Named algorithms: a local trainer, a client update pipeline and a server rule.

::

 | preset          | local trainer | client pipeline                          | paper              |
 |-----------------|---------------|------------------------------------------|--------------------|
 | fedavg          | SGD           | (none)                                   | McMahan et al. 17  |
 | scaffold        | SGD + c − c_i | (none)                                   | Karimireddy 20     |
 | fedsam          | SAM           | (none)                                   | Qu et al. 22       |
 | dp_fedavg       | SGD           | Clip(C) → Noise(σ)                       | McMahan et al. 18  |
 | dp_fedsam       | SAM           | Clip(C) → Noise(σ)                       | Shi et al. 23      |
 | dp_fedsam_topk  | SAM           | Clip → TopK(p) → Noise (dense)           | Shi et al. 23      |
 | fed_smp_topk    | SGD           | TopK(p) → Clip → Noise (dense)           | Hu et al. 22       |
 | fed_smp_randk   | SGD           | RandK(p, shared mask) → Clip → Noise     | Hu et al. 22       |
 |                 |               | (noise on the shared mask)               |                    |
 | dp_fedavg_blur  | SGD + BLUR    | Clip(C) → Noise(σ)                       | Cheng et al. 22    |
 | dp_fedavg_lus   | SGD           | LUS(c) → Clip → Noise                    | Cheng et al. 22    |
 | dp_fedavg_blurs | SGD + BLUR    | LUS(c) → Clip → Noise                    | Cheng et al. 22    |
 | dp_fedpgn       | PGN (β, ρ, g̃) | StripDrift → Clip → Noise; server: +drift | Liu et al. 25     |
 |                 |               | server: g̃ ← −Δ̄/(ηK) broadcast           |                   |
 | dp_fedpgn_ls    | PGN           | as dp_fedpgn; server: A⁻¹ on Δ̄ and g̃      | Liu et al. 25     |
 |                 |               | (or the code's stencil on Δ̄ only)        |                   |
 | dp_fedavg_ls    | SGD           | Clip → Noise; server: A⁻¹ on Δ̄            | Liang et al. 24   |
 | dp_fedavg_sample| DP-SGD        | (none)                                   | Noble et al. 22    |
 | dp_scaffold     | DP-SGD + c−c_i| (none); warm start optional              | Noble et al. 22    |
 | fetchsgd        | one gradient  | Sketch; server: sketch momentum, error   | Rothchild et al. 20|
 |                 |               | feedback, top-k unsketch                 |                    |
 | dpsfl           | one gradient  | Clip → Noise (dense) → Sketch; FetchSGD  | Zhang et al.       |
 | dpsfl_ac        | one gradient  | as dpsfl; C moves with noisy clip bits   | Zhang et al.       |

Every private preset is client-level DP: each client's delta is clipped to L2 norm C (flat, or
per layer with sensitivity C·√L) and the mean of the m clients carries Gaussian noise of std
σ·S/m per coordinate, S the mechanism's L2 bound (``algorithms.mechanism``). The top-k presets
put that noise on every coordinate by default; the papers' literal variants (``noise_support:
kept``, ``mask_source: noisy``) run but are unaccounted: their pipelines say why, and no ε is
reported for them.

The two sample-level presets (DP-SCAFFOLD's Alg. 1 and 2) protect one *record*: every local
step is DP-SGD (``SampleDP``: per-example clip to C, Gaussian noise κ·C·σ_g on the batch sum,
``algorithms.dpsgd``) and the uploads are post-processing of those noisy steps. σ_g = 0 with
C = ∞ keeps the trainer's plain SGD gradient: SCAFFOLD / FedAvg bit for bit.

The sketched presets (``algorithms.sketch``, ``algorithms.fetchsgd``) upload the count sketch of
one batch gradient. DPSFL is client-level DP by default: the noise goes on the dense clipped
gradient, so the sketch is post-processing. ``sketch_noise: paper`` is DPSFL's Alg. 1 (noise on
each client's counters sized to C√l), which runs unaccounted.

A preset's keyword arguments are its options, with the paper's values as
defaults; trainer options (SAM's ρ, BLUR's λ, PGN's β and ρ) are set on the base trainer the
caller passes in.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import Literal

from algorithms.adaptive_clip import AdaptiveClip
from algorithms.algorithm import Algorithm
from algorithms.dpsgd import Adjacency, DpSgdGradient
from algorithms.fetchsgd import FetchSgdServerRule, SketchFeedback
from algorithms.local import LocalTrainer, PgnGradient, SamGradient
from algorithms.lus import LocalUpdateSparsification, LusScope, LusScore
from algorithms.mechanism import (
    DENSE,
    GaussianMechanism,
    NoiseSupport,
    Placement,
    SharedMaskSupport,
    UploadSupport,
)
from algorithms.pgn import StripDrift
from algorithms.pipeline import UpdatePipeline
from algorithms.regularizers import BoundedLocalUpdate
from algorithms.server import MeanServerRule
from algorithms.sketch import SketchUpload, noise_multiplier_for_rho, rho_from_epsilon
from algorithms.smoothing import LaplacianSmoothing, LaplacianStencil
from algorithms.sparsify import RandK, TopK
from algorithms.transforms import Clip

# DP-FedPGN's perturbation δ = ±ρ·g̃/‖g̃‖: the paper's ascent, or the authors' LESAM descent.
PgnPerturbation = Literal["ascent", "descent"]
# Laplacian smoothing: the papers' A_σ⁻¹, or the DP-FedPGN authors' one-step stencil.
LsOperator = Literal["inverse", "stencil"]


def fedavg(trainer: LocalTrainer, server_lr: float = 1.0, weighting="uniform") -> Algorithm:
    return Algorithm("fedavg", trainer, server=MeanServerRule(server_lr, weighting))


def _sam(trainer: LocalTrainer, rho: float, sam_adaptive: bool) -> LocalTrainer:
    return replace(trainer, gradient=SamGradient(rho, sam_adaptive))


def fedsam(
    trainer: LocalTrainer,
    server_lr: float = 1.0,
    weighting="uniform",
    rho: float = 0.5,
    sam_adaptive: bool = False,
) -> Algorithm:
    sam = _sam(trainer, rho, sam_adaptive)
    return Algorithm("fedsam", sam, server=MeanServerRule(server_lr, weighting))


def scaffold(trainer: LocalTrainer, server_lr: float = 1.0) -> Algorithm:
    return Algorithm("scaffold", trainer, server=MeanServerRule(server_lr), control_variates=True)


@dataclass(frozen=True)
class ClientDP:
    """Client-level DP of a preset: clip to C (flat or per layer), Gaussian noise σ·S on the sum.

    ``clip_rule="median"``: the DP-FedPGN authors' per-client median clip (``Clip``); no ε."""

    clip_norm: float
    noise_multiplier: float
    noise_placement: Placement = "server"
    noise_scale: float = 1.0  # m / noise_cohort_size
    clip_scope: Literal["flat", "layer"] = "flat"
    clip_rule: Literal["fixed", "median"] = "fixed"

    def pipeline(
        self, before=(), between=(), after=(), support: NoiseSupport = DENSE
    ) -> UpdatePipeline:
        """``before`` → [Clip → ``between`` → noise on ``support``] → ``after``."""
        mechanism = GaussianMechanism(
            Clip(self.clip_norm, self.clip_scope, rule=self.clip_rule),
            self.noise_multiplier,
            self.noise_placement,
            self.noise_scale,
            support,
            tuple(between),
        )
        return UpdatePipeline(tuple(before), mechanism, tuple(after))


@dataclass(frozen=True)
class SampleDP:
    """Sample-level DP of a preset: DP-SGD in every local step (``algorithms.dpsgd``).

    Each step's batch sum of per-example gradients clipped to C (flat, or per tensor with
    S = C·√L) gets Gaussian noise of std κ·S·σ_g (κ = 2 replace-one, 1 add/remove), then is
    divided by the expected batch size B = sR. ``noise_scale`` m/C_n (a noise cohort): each of
    the m simulated clients adds √(m/C_n) times that noise, so that their mean carries the
    noise of C_n deployment clients' mean (``DpSgdGradient.simulation_noise_factor``).
    """

    clip_norm: float
    noise_multiplier: float  # σ_g
    clip_scope: Literal["flat", "layer"] = "flat"
    adjacency: Adjacency = "replace_one"
    clip_rule: Literal["fixed", "median"] = "fixed"
    noise_scale: float = 1.0  # m / noise_cohort_size

    def trainer(self, trainer: LocalTrainer) -> LocalTrainer:
        """``trainer`` with the DP-SGD gradient rule; σ_g = 0 and C = ∞ leave it plain SGD."""
        if self.noise_multiplier == 0 and math.isinf(self.clip_norm) and self.clip_rule == "fixed":
            return trainer
        rule = DpSgdGradient(
            self.clip_norm,
            self.noise_multiplier,
            self.clip_scope,
            self.adjacency,
            self.clip_rule,
            math.sqrt(self.noise_scale),
        )
        return replace(trainer, gradient=rule)


def dp_fedavg_sample(trainer: LocalTrainer, sample_dp: SampleDP, server_lr: float = 1.0):
    """DP-FedAvg at sample level (DP-SCAFFOLD's Alg. 2): DP-SGD local steps, mean of Δy_i."""
    return Algorithm(
        "dp_fedavg_sample", sample_dp.trainer(trainer), server=MeanServerRule(server_lr)
    )


def dp_scaffold(
    trainer: LocalTrainer,
    sample_dp: SampleDP,
    server_lr: float = 1.0,
    warm_start: bool = False,
    warm_start_variant: Literal["paper", "authors_code"] = "paper",
) -> Algorithm:
    """DP-SCAFFOLD (Alg. 1): DP-SGD steps along −(H̃ − c_i + c), option-II control variates.

    ``warm_start``: DP-SCAFFOLD-warm. ``paper``: ⌈4/l⌉ sampled rounds before the T training
    rounds set c_i⁰ = (1/K) Σ_k H̃_i^k(x⁰) (noisy, charged to ε) without moving x.
    ``authors_code``: every client's c_i⁰ is computed at x⁰ in round 0 (its noise drawn then);
    the first round(4/l) of the T rounds only collect it from the clients they sample, once
    each; the cost the authors do not count (one K-step release of every record) is charged."""
    if warm_start_variant not in ("paper", "authors_code"):
        raise ValueError(f"warm_start_variant must be paper or authors_code: {warm_start_variant}")
    return Algorithm(
        "dp_scaffold",
        sample_dp.trainer(trainer),
        server=MeanServerRule(server_lr),
        control_variates=True,
        warm_start=warm_start_variant if warm_start else None,
    )


def _private(name: str, trainer: LocalTrainer, pipeline: UpdatePipeline, server_lr: float):
    return Algorithm(name, trainer, pipeline, MeanServerRule(server_lr, "uniform"))


def dp_fedavg(trainer: LocalTrainer, dp: ClientDP, server_lr: float = 1.0) -> Algorithm:
    return _private("dp_fedavg", trainer, dp.pipeline(), server_lr)


def dp_fedsam(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    rho: float = 0.5,
    sam_adaptive: bool = False,
) -> Algorithm:
    return _private("dp_fedsam", _sam(trainer, rho, sam_adaptive), dp.pipeline(), server_lr)


NoiseSupportName = Literal["dense", "kept"]


def _topk_support(noise_support: NoiseSupportName) -> NoiseSupport:
    """dense: noise on every coordinate (DP). kept: only on each client's kept coordinates, as
    the top-k papers describe (unaccounted: the support depends on the data)."""
    if noise_support not in ("dense", "kept"):
        raise ValueError(f"noise_support must be dense or kept, got {noise_support!r}")
    return DENSE if noise_support == "dense" else UploadSupport()


def dp_fedsam_topk(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    rho: float = 0.5,
    sam_adaptive: bool = False,
    keep_fraction: float = 0.4,
    mask_scope: Literal["layer", "global"] = "layer",
    mask_source: Literal["clean", "noisy"] = "clean",
    noise_support: NoiseSupportName = "dense",
) -> Algorithm:
    """clean: Clip → TopK → noise (dense, or on the kept coordinates: the paper's intent).
    noisy: Clip → noise → TopK of the noisy update (Eq. 12 read literally; unaccounted)."""
    topk = TopK(keep_fraction, mask_scope)
    if mask_source == "clean":
        pipeline = dp.pipeline(between=(topk,), support=_topk_support(noise_support))
    elif noise_support == "dense":
        pipeline = dp.pipeline(after=(topk,))
    else:
        raise ValueError("mask_source noisy masks dense noise; noise_support kept does not apply")
    return _private("dp_fedsam_topk", _sam(trainer, rho, sam_adaptive), pipeline, server_lr)


def fed_smp_topk(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    keep_fraction: float = 0.4,
    mask_scope: Literal["layer", "global"] = "layer",
    noise_support: NoiseSupportName = "dense",
) -> Algorithm:
    """TopK → Clip → noise: dense by default; ``kept``: Fed-SMP's noise on kept coordinates."""
    topk = (TopK(keep_fraction, mask_scope),)
    pipeline = dp.pipeline(before=topk, support=_topk_support(noise_support))
    return _private("fed_smp_topk", trainer, pipeline, server_lr)


def fed_smp_randk(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    keep_fraction: float = 0.4,
    mask_scope: Literal["layer", "global"] = "layer",
) -> Algorithm:
    """RandK (the round's shared public mask) → Clip → noise on that mask only."""
    randk = RandK(keep_fraction, mask_scope)
    pipeline = dp.pipeline(before=(randk,), support=SharedMaskSupport(randk))
    return _private("fed_smp_randk", trainer, pipeline, server_lr)


def _blur(trainer: LocalTrainer, dp: ClientDP, blur_lambda: float, blur_bound: float | None):
    """The trainer with BLUR; its radius S defaults to the clip norm, as in the paper."""
    bound = dp.clip_norm if blur_bound is None else blur_bound
    return replace(trainer, regularizers=(BoundedLocalUpdate(blur_lambda, bound),))


def dp_fedavg_blur(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    blur_lambda: float = 0.4,
    blur_bound: float | None = None,
) -> Algorithm:
    """DP-FedAvg whose trainer carries the BLUR regularizer (Cheng et al. 2022)."""
    blur = _blur(trainer, dp, blur_lambda, blur_bound)
    return _private("dp_fedavg_blur", blur, dp.pipeline(), server_lr)


def dp_fedavg_lus(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    lus_sparsity: float = 0.7,
    lus_gradient: Literal["data", "batch"] = "data",
    lus_scope: LusScope = "tensor",
    lus_score: LusScore = "taylor",
) -> Algorithm:
    lus = (LocalUpdateSparsification(lus_sparsity, lus_gradient, lus_scope, lus_score),)
    return _private("dp_fedavg_lus", trainer, dp.pipeline(before=lus), server_lr)


def dp_fedavg_blurs(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    blur_lambda: float = 0.4,
    blur_bound: float | None = None,
    lus_sparsity: float = 0.7,
    lus_gradient: Literal["data", "batch"] = "data",
    lus_scope: LusScope = "tensor",
    lus_score: LusScore = "taylor",
) -> Algorithm:
    """BLUR in the trainer and LUS before clipping: Cheng et al.'s full method."""
    lus = (LocalUpdateSparsification(lus_sparsity, lus_gradient, lus_scope, lus_score),)
    blur = _blur(trainer, dp, blur_lambda, blur_bound)
    return _private("dp_fedavg_blurs", blur, dp.pipeline(before=lus), server_lr)


def _pgn(name, trainer, dp, server_lr, smoothing, beta, rho, perturbation):
    if trainer.local_steps is None:
        raise ValueError(f"{name} needs local_steps (its server scale is γ = η·K)")
    trainer = replace(trainer, gradient=PgnGradient(beta, rho, perturbation))
    pipeline = dp.pipeline(before=(StripDrift(beta),))
    scale = trainer.lr * trainer.local_steps
    server = MeanServerRule(server_lr, "uniform", smoothing, direction_scale=scale, drift_beta=beta)
    return Algorithm(name, trainer, pipeline, server)


def _laplacian(ls_operator: LsOperator, ls_sigma: float, ls_scope: str | None):
    """The paper's A⁻¹ (``inverse``; ``ls_scope`` flat by default) or the DP-FedPGN authors'
    one-step stencil per tensor (``stencil``, which has no scope)."""
    if ls_operator == "stencil":
        if ls_scope is not None:
            raise ValueError("ls_operator 'stencil' acts on each tensor by its shape: no ls_scope")
        return LaplacianStencil(ls_sigma)
    return LaplacianSmoothing(ls_sigma, ls_scope or "flat")


def dp_fedpgn(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    pgn_beta: float = 0.3,
    pgn_rho: float = 0.2,
    pgn_perturbation: PgnPerturbation = "ascent",
) -> Algorithm:
    """DP-FedPGN: ``PgnGradient`` local steps; the drift stripped before clipping, added back
    by the server. ``pgn_perturbation``: ascent δ = +ρ·g̃/‖g̃‖ (the paper), descent −ρ·g̃/‖g̃‖
    (the authors' LESAM optimizer)."""
    return _pgn("dp_fedpgn", trainer, dp, server_lr, None, pgn_beta, pgn_rho, pgn_perturbation)


def dp_fedpgn_ls(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    pgn_beta: float = 0.3,
    pgn_rho: float = 0.2,
    pgn_perturbation: PgnPerturbation = "ascent",
    ls_sigma: float = 0.01,
    ls_scope: str | None = None,
    ls_operator: LsOperator = "inverse",
) -> Algorithm:
    """DP-FedPGN with Laplacian smoothing of the aggregated update: the paper's A⁻¹ on Δ̄ and
    g̃ (``inverse``), or the authors' one-step stencil on Δ̄ only (``stencil``)."""
    smoothing = _laplacian(ls_operator, ls_sigma, ls_scope)
    return _pgn(
        "dp_fedpgn_ls", trainer, dp, server_lr, smoothing, pgn_beta, pgn_rho, pgn_perturbation
    )


def dp_fedavg_ls(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    ls_sigma: float = 0.01,
    ls_scope: str | None = None,
    ls_operator: LsOperator = "inverse",
) -> Algorithm:
    """DP-FedAvg with Laplacian smoothing of the noisy mean (Liang et al.): A⁻¹ (``inverse``;
    ``ls_scope``: the flat vector as one signal, or each tensor on its own) or the DP-FedPGN
    authors' one-step stencil per tensor (``stencil``, their code's DP-FedAvg-LS)."""
    server = MeanServerRule(server_lr, "uniform", _laplacian(ls_operator, ls_sigma, ls_scope))
    return Algorithm("dp_fedavg_ls", trainer, dp.pipeline(), server)


# DPSFL's compression levels CL1–5 (spec 002 §4): (top-k k, sketch columns m), 5 rows.
COMPRESSION_LEVELS = {
    1: (50_000, 500_000),
    2: (32_000, 300_000),
    3: (25_000, 200_000),
    4: (18_000, 120_000),
    5: (12_000, 80_000),
}
PAPER_DELTA = 1e-5  # the δ of DPSFL's ε → ρ conversion


def _called_with(function, options: dict):
    """``function`` called with the entries of ``options`` that are its parameters (the sketched
    presets share their options by name)."""
    accepted = inspect.signature(function).parameters
    return function(**{name: value for name, value in options.items() if name in accepted})


def _one_gradient(name: str, trainer: LocalTrainer) -> LocalTrainer:
    """DPSFL's clients upload u = −g, one batch gradient: one step of plain SGD at lr 1."""
    plain = (trainer.local_steps, trainer.lr, trainer.momentum, trainer.weight_decay)
    if plain != (1, 1.0, 0.0, 0.0):
        raise ValueError(
            f"{name} clients upload one batch gradient: local_steps 1, lr 1, momentum 0, "
            f"weight_decay 0 (got {', '.join(map(str, plain))}); η is server_lr"
        )
    return trainer


def _sketch_server(
    server_lr,
    sketch_rows,
    sketch_cols,
    sketch_top_k,
    sketch_momentum,
    sketch_seed,
    compression_level,
    sketch_feedback,
) -> FetchSgdServerRule:
    if compression_level is not None:
        if compression_level not in COMPRESSION_LEVELS:
            raise ValueError(f"compression_level must be one of 1..5, got {compression_level}")
        sketch_top_k, sketch_cols = COMPRESSION_LEVELS[compression_level]
    upload = SketchUpload(sketch_rows, sketch_cols, sketch_seed)
    return FetchSgdServerRule(upload, sketch_top_k, sketch_momentum, server_lr, sketch_feedback)


def fetchsgd(
    trainer: LocalTrainer,
    server_lr: float = 1.0,
    sketch_rows: int = 5,
    sketch_cols: int = 500_000,
    sketch_top_k: int = 50_000,
    sketch_momentum: float = 0.9,
    sketch_seed: int = 42,
    compression_level: int | None = None,
    sketch_feedback: SketchFeedback = "zero_error",
) -> Algorithm:
    """FetchSGD (non-private): sketch of −g, sketch momentum and error feedback, top-k."""
    server = _called_with(_sketch_server, locals())
    pipeline = UpdatePipeline(after=(server.upload,))
    return Algorithm("fetchsgd", _one_gradient("fetchsgd", trainer), pipeline, server)


SketchNoise = Literal["dense", "paper"]


def dpsfl(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    sketch_rows: int = 5,
    sketch_cols: int = 500_000,
    sketch_top_k: int = 50_000,
    sketch_momentum: float = 0.9,
    sketch_seed: int = 42,
    compression_level: int | None = None,
    sketch_feedback: SketchFeedback = "zero_error",
    sketch_noise: SketchNoise = "dense",
    paper_epsilon: float = 4.0,
) -> Algorithm:
    """DPSFL: flat clip of the batch gradient → noise → count sketch; FetchSGD's server.

    ``dense`` (default, DP): Gaussian noise σC on the dense clipped vector (the sum's, placed
    on the server or split over the clients), then the sketch, which is post-processing: the
    client-level accountants apply to σ as for DP-FedAvg.
    ``paper``: each client adds N(0, C²l/(2ρ)) to every counter of its own sketch, ρ from
    ``paper_epsilon`` at δ = 1e-5 (Alg. 1); unaccounted: C√l is not the sketch's sensitivity.
    """
    server = _called_with(_sketch_server, locals())
    if sketch_noise == "dense":
        pipeline = dp.pipeline(after=(server.upload,))
    elif sketch_noise == "paper":
        sigma = noise_multiplier_for_rho(rho_from_epsilon(paper_epsilon, PAPER_DELTA))
        upload = replace(server.upload, sensitivity="paper")
        mechanism = GaussianMechanism(Clip(dp.clip_norm), sigma, "local", between=(upload,))
        pipeline = UpdatePipeline(mechanism=mechanism)
    else:
        raise ValueError(f"sketch_noise must be dense or paper, got {sketch_noise!r}")
    return Algorithm("dpsfl", _one_gradient("dpsfl", trainer), pipeline, server)


def dpsfl_ac(
    trainer: LocalTrainer,
    dp: ClientDP,
    server_lr: float = 1.0,
    sketch_rows: int = 5,
    sketch_cols: int = 500_000,
    sketch_top_k: int = 50_000,
    sketch_momentum: float = 0.9,
    sketch_seed: int = 42,
    compression_level: int | None = None,
    sketch_feedback: SketchFeedback = "zero_error",
    sketch_noise: SketchNoise = "dense",
    paper_epsilon: float = 4.0,
    clip_target_quantile: float = 0.9,
    clip_error_tolerance: float = 0.5,
    clip_count_noise: float = 0.1,
    clip_lr: float = 0.01,
) -> Algorithm:
    """DPSFL-AC: DPSFL whose clip norm follows the clients' noisy bits (C₀ = ``clip_norm``,
    1.5 in the paper; ``algorithms.adaptive_clip``)."""
    base = _called_with(dpsfl, locals())
    adaptive = AdaptiveClip(clip_target_quantile, clip_error_tolerance, clip_count_noise, clip_lr)
    return replace(base, name="dpsfl_ac", adaptive_clip=adaptive)


PRESETS = {
    "fedavg": fedavg,
    "fedsam": fedsam,
    "scaffold": scaffold,
    "dp_fedavg": dp_fedavg,
    "dp_fedsam": dp_fedsam,
    "dp_fedsam_topk": dp_fedsam_topk,
    "fed_smp_topk": fed_smp_topk,
    "fed_smp_randk": fed_smp_randk,
    "dp_fedavg_blur": dp_fedavg_blur,
    "dp_fedavg_lus": dp_fedavg_lus,
    "dp_fedavg_blurs": dp_fedavg_blurs,
    "dp_fedpgn": dp_fedpgn,
    "dp_fedpgn_ls": dp_fedpgn_ls,
    "dp_fedavg_ls": dp_fedavg_ls,
    "dp_fedavg_sample": dp_fedavg_sample,
    "dp_scaffold": dp_scaffold,
    "fetchsgd": fetchsgd,
    "dpsfl": dpsfl,
    "dpsfl_ac": dpsfl_ac,
}


def presets_taking(option: str) -> frozenset[str]:
    """The presets whose signature has ``option``."""
    return frozenset(n for n, p in PRESETS.items() if option in inspect.signature(p).parameters)


# A client-level private preset takes a ClientDP part, a sample-level one a SampleDP part.
CLIENT_LEVEL_PRESETS = presets_taking("dp")
SAMPLE_LEVEL_PRESETS = presets_taking("sample_dp")
PRIVATE_PRESETS = CLIENT_LEVEL_PRESETS | SAMPLE_LEVEL_PRESETS
# Sketched presets: clients upload the count sketch of one batch gradient.
SKETCH_PRESETS = presets_taking("sketch_cols")
# PGN's server scale γ = η·K needs a fixed number of local steps.
FIXED_STEP_PRESETS = presets_taking("pgn_beta")
# SCAFFOLD's option II sets c_i⁺ = c_i − c + (x − y)/(Kη): the mean local gradient only for
# plain SGD steps (momentum carries gradients between steps).
CONTROL_VARIATE_PRESETS = frozenset({"scaffold", "dp_scaffold"})
# Options beyond the trainer, the DP part and the server's lr and weighting (config fields).
PRESET_OPTIONS = frozenset().union(*(inspect.signature(p).parameters for p in PRESETS.values())) - {
    "trainer",
    "dp",
    "sample_dp",
    "server_lr",
    "weighting",
}
# The papers' noise placement where it is the clients (secure aggregation); else the server.
# (BLUR/LUS add it on the clients too, but accept Poisson cohorts: the server's sum has the
# same distribution.)
DEFAULT_PLACEMENT = dict.fromkeys(
    {"dp_fedsam", "dp_fedpgn", "dp_fedpgn_ls", "dpsfl", "dpsfl_ac"}
    | presets_taking("keep_fraction"),
    "client",
)
