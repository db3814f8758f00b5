"""One client's round, top to bottom: local training → delta → update pipeline → uploads.

Randomness comes from per-client streams keyed by ``(seed, round, client, purpose)``: mini-batches
(LOCAL_TRAINING), noise (CLIENT_NOISE), augmentation (AUGMENT) and dropout (DROPOUT, which seeds
torch's global generator since dropout layers read it), so that switching noise or augmentation
off never changes which batches are drawn.
"""

from __future__ import annotations

import math

import torch

from algorithms.aggregate import ClientReport
from algorithms.algorithm import Algorithm
from algorithms.control_variates import local_correction, updated_client_control
from algorithms.local import LocalResult, ModelObjective
from algorithms.norms import l2_norm
from algorithms.rng import Purpose, stream_seed, torch_generator
from algorithms.transforms import ClientContext


def upload_bytes(update: torch.Tensor) -> int:
    """Bytes to send ``update``: dense values, or (value, int32 index) pairs if that is smaller."""
    return encoded_bytes(update.numel(), update.element_size(), int(torch.count_nonzero(update)))


def encoded_bytes(numel: int, element_size: int, nonzero: int) -> int:
    """``upload_bytes`` of a tensor of ``numel`` elements, ``nonzero`` of them not 0."""
    return min(numel * element_size, nonzero * (element_size + 4))


def counted(uploads: dict[str, torch.Tensor], report: ClientReport) -> dict[str, torch.Tensor]:
    """``uploads``, with everything in them counted in ``report.stats["upload_bytes"]``: the
    update, DPSFL-AC's noisy bit, SCAFFOLD's Δc_i, a warm-up's c_i⁰, a dropped client's noise."""
    report.stats["upload_bytes"] = float(sum(upload_bytes(t) for t in uploads.values()))
    return uploads


def trained_report(client_id: int, num_samples: int, result: LocalResult) -> ClientReport:
    """A trained client's report: its training loss and accuracy (means over the records its
    steps saw); the update's norms and stats are filled in after."""
    return ClientReport(
        client_id=client_id,
        num_samples=num_samples,
        steps=result.steps,
        train_loss=result.loss_sum / max(result.seen, 1),
        train_accuracy=result.correct / max(result.seen, 1),
    )


def grad_evals_per_step(result: LocalResult) -> float:
    return result.grad_evals / max(result.steps, 1)


def aggregation_weight(algorithm: Algorithm, num_samples: int) -> float:
    """A client's weight in the server's mean: its sample count, or 1."""
    return float(num_samples) if algorithm.server.weighting == "samples" else 1.0


def client_round(
    algorithm: Algorithm,
    objective: ModelObjective,
    params: torch.Tensor,
    payload: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    state: dict[str, torch.Tensor],
    seed: int,
    round_index: int,
    client_id: int,
    nominal_cohort_size: float,
    warmup: bool = False,
    trained: LocalResult | None = None,
    noise_generator: torch.Generator | None = None,
) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor], ClientReport]:
    """Returns (uploads to sum, aggregation weight, new client state, report).

    ``warmup`` (DP-SCAFFOLD-warm): no training; the client sets c_i⁰ = (1/K) Σ_k G(x⁰; ξ_k)
    with the round's batches and noise, and uploads only Δc_i. Under the authors' variant c_i⁰
    is the one drawn with round 0's keys at x⁰ (``payload["warm_start_point"]``), as if every
    client computed it in round 0; a client uploads it once, and one never sampled in the
    warm-up trains from it. ``trained``: this client's local training, already done (with the
    same batches) for many clients at once by ``algorithms.vectorized``; ``noise_generator``:
    this client's ``CLIENT_NOISE`` stream, already made (``rng.client_generators``)."""
    algorithm = algorithm.at_round(round_index).with_state(payload)
    keys = (seed, round_index, client_id)

    def noise_stream(keys=keys) -> torch.Generator:
        return torch_generator(*keys, Purpose.SAMPLE_NOISE, device=params.device)

    def augment_stream(keys=keys) -> torch.Generator | None:
        if objective.augment is None:
            return None
        return torch_generator(*keys, Purpose.AUGMENT, device=params.device)

    def seed_dropout(keys=keys) -> None:
        # Dropout draws from torch's global generator: seed it per (round, client) too (only
        # then: ``torch.manual_seed`` also queues a seed for every device type, ≈ 2 ms each).
        if objective.draws_from_global_rng:
            torch.manual_seed(stream_seed(*keys, Purpose.DROPOUT))

    def warm_control(at: torch.Tensor, keys=keys) -> torch.Tensor:
        """c_i⁰'s mean of K gradients at ``at``, drawn from the streams of ``keys`` alone, as a
        round's training is: whatever the host ran before (the number of hosts) changes none."""
        seed_dropout(keys)
        rng = torch_generator(*keys, Purpose.LOCAL_TRAINING)
        return algorithm.trainer.mean_gradient(
            objective, at, x, y, rng, lambda: noise_stream(keys), augment_stream(keys)
        )

    correction = None
    if algorithm.control_variates:
        client_control = state.get("control")
        if client_control is None and algorithm.warm_start == "authors_code":
            client_control = warm_control(payload["warm_start_point"], (seed, 0, client_id))
            if not warmup:  # never collected: trains from it, as in the authors' code
                state = {**state, "control": client_control}
        elif client_control is None:
            client_control = torch.zeros_like(params)
        correction = local_correction(payload["control"], client_control)
    if warmup:
        steps = algorithm.trainer.num_steps(len(y))
        report = ClientReport(client_id, len(y), steps, math.nan, math.nan)
        if algorithm.warm_start == "authors_code":
            if "control" in state:  # collected already: nothing new
                return {}, 0.0, state, report
            uploads = counted({"control": client_control}, report)
            return uploads, 1.0, {**state, "control": client_control}, report
        control = warm_control(params)
        uploads = counted({"control": control - client_control}, report)
        return uploads, 1.0, {**state, "control": control}, report

    result = trained
    if result is None:
        seed_dropout()
        result = algorithm.trainer.train(
            objective,
            params,
            x,
            y,
            torch_generator(*keys, Purpose.LOCAL_TRAINING),
            correction,
            augment_generator=augment_stream(),
            payload=payload,
            noise_stream=noise_stream,
        )
    delta = result.params - params
    report = trained_report(client_id, len(y), result)
    # One reduction instead of a full-size isfinite mask: NaN or ±inf anywhere makes the norm
    # NaN or inf (so does a float32 overflow of a piece's norm, in an update longer than
    # ``norms.SHORT``). An upper bound of ‖Δ‖₂ (``algorithms.norms``): the clip scales by it.
    delta_norm = l2_norm(delta)
    report.dropped = not math.isfinite(delta_norm)
    if report.dropped and not algorithm.pipeline.owes_noise_share:
        return {}, 0.0, state, report

    def final_gradient(kind: str) -> torch.Tensor:
        rows = slice(None)
        if kind == "batch":
            order = torch.randperm(len(y), generator=torch_generator(*keys, Purpose.LUS_BATCH))
            rows = order[: algorithm.trainer.batch_size].to(y.device)
        return objective.loss_and_grad(result.params, x[rows], y[rows])[2]

    if noise_generator is None:
        noise_generator = torch_generator(*keys, Purpose.CLIENT_NOISE, device=params.device)
    ctx = ClientContext(
        noise_generator,
        nominal_cohort_size,
        layout=objective.layout,
        round_key=(seed, round_index),
        local_gradient=final_gradient,  # for LUS
        client_stream=lambda purpose: torch_generator(*keys, purpose, device=params.device),
        payload=payload,
        local_steps=result.steps,
        lr=result.lr,
    )
    if report.dropped:
        return counted(_noise_share(algorithm, delta, ctx, keys), report), 0.0, state, report
    update = algorithm.pipeline(delta, ctx, norm=delta_norm)
    report.pre_clip_norm = ctx.stats.get("pre_clip_norm", delta_norm)
    report.clipped = ctx.stats.get("clipped", math.nan)
    report.stats = {k: v for k, v in ctx.stats.items() if k not in ("pre_clip_norm", "clipped")}
    report.stats["grad_evals_per_step"] = grad_evals_per_step(result)

    weight = aggregation_weight(algorithm, len(y))
    uploads = {algorithm.pipeline.upload_name: update * weight if weight != 1.0 else update}
    if algorithm.adaptive_clip is not None:
        mechanism = algorithm.mechanism
        uploads["clip_bit"] = algorithm.adaptive_clip.client_upload(
            report.pre_clip_norm,
            mechanism.clip.clip_norm,
            torch_generator(*keys, Purpose.CLIP_BIT),
            0.0
            if mechanism.placement == "server"
            else algorithm.adaptive_clip.client_noise_std(mechanism.noise_scale),
        )
    if algorithm.control_variates:
        new_control = updated_client_control(
            client_control,
            payload["control"],
            params,
            result.params,
            result.steps,
            result.lr,
        )
        uploads["control"] = new_control - client_control
        state = {**state, "control": new_control}
    return counted(uploads, report), weight, state, report


def _noise_share(algorithm: Algorithm, like: torch.Tensor, ctx: ClientContext, keys) -> dict:
    """A dropped client's uploads: its share of client-placed noise, on the update and on the
    adaptive clip's count, with nothing of its own (``UpdatePipeline.noise_share``)."""
    uploads = {algorithm.pipeline.upload_name: algorithm.pipeline.noise_share(like, ctx)}
    clip = algorithm.adaptive_clip
    if clip is not None:
        std = clip.client_noise_std(algorithm.mechanism.noise_scale)
        uploads["clip_bit"] = clip.noise_share(torch_generator(*keys, Purpose.CLIP_BIT), std)
    return uploads
