"""The end of a round for many clients at once, their local training done
(``algorithms.vectorized``): ``client_round``'s tail — the delta, its finiteness check, the
flat clip, the aggregation weight, the upload's bytes, the sum and the reports — as tensor ops
over the clients' [n, d] matrix, not a few dozen small tensor calls and a host sync per client.

It applies where the tail is those steps only (``batchable``): no control variates, no adaptive
clip, no transform before or after the mechanism, and a mechanism (if any) that clips the whole
update to a fixed C and leaves the noise to the server (server-placed, or σ = 0) on every
coordinate; anything else runs ``client_round`` per client.

Bit for bit ``client_round``'s uploads, sums and reports (``tests/test_clients_tail.py``): the
delta and the clip's and the weight's products are elementwise (the scale C/‖Δ‖₂ rounded to
float32 once, as torch rounds a Python scalar for a float32 tensor); each norm is its row's own
reduction (``algorithms.norms``; on the CPU ``l2_norms`` reduces each row of a block as it
reduces the row alone; elsewhere the rows are reduced one by one); the float64 sum adds the rows
one after the other in client order (``PartialAggregate.add_rows``).
"""

from __future__ import annotations

import math

import torch

from algorithms.aggregate import ClientReport, PartialAggregate
from algorithms.algorithm import Algorithm
from algorithms.client import (
    aggregation_weight,
    encoded_bytes,
    grad_evals_per_step,
    trained_report,
)
from algorithms.local import LocalResult
from algorithms.mechanism import DenseSupport
from algorithms.norms import l2_norms
from algorithms.vectorized import MAX_CHUNK_FLOATS


def batchable(algorithm: Algorithm) -> bool:
    """Whether ``sum_trained_clients`` computes ``client_round``'s tail for ``algorithm``."""
    pipeline, mechanism = algorithm.pipeline, algorithm.pipeline.mechanism
    server_noise_flat_clip = mechanism is None or (
        mechanism.clip.scope == "flat"
        and mechanism.clip.rule == "fixed"
        and not mechanism.between
        and isinstance(mechanism.support, DenseSupport)
        and (mechanism.placement == "server" or mechanism.noise_multiplier == 0)
    )
    return (
        server_noise_flat_clip
        and not pipeline.before
        and not pipeline.after
        and not algorithm.control_variates
        and algorithm.adaptive_clip is None
    )


def sum_trained_clients(
    algorithm: Algorithm,
    params: torch.Tensor,
    trained: list[LocalResult],
    client_ids: list[int],
    num_samples: list[int],
) -> PartialAggregate:
    """The partial aggregate of the clients ``client_ids`` (with ``num_samples`` records, their
    local training ``trained`` from the broadcast ``params``): ``client_round``'s uploads
    summed in this order, and its reports. Only where ``batchable(algorithm)``. Blocks of
    clients at a time, each block's matrices under ``MAX_CHUNK_FLOATS``."""
    partial = PartialAggregate()
    block = max(1, MAX_CHUNK_FLOATS // params.numel())
    for start in range(0, len(trained), block):
        rows = slice(start, start + block)
        _add_block(partial, algorithm, params, trained[rows], client_ids[rows], num_samples[rows])
    return partial


def _add_block(
    partial: PartialAggregate,
    algorithm: Algorithm,
    params: torch.Tensor,
    trained: list[LocalResult],
    client_ids: list[int],
    num_samples: list[int],
) -> None:
    deltas = torch.stack([result.params for result in trained]) - params
    norms = _row_norms(deltas).tolist()  # one host sync for the block
    reports = [
        trained_report(cid, n, result)
        for cid, n, result in zip(client_ids, num_samples, trained, strict=True)
    ]
    kept = []
    for i, (report, norm) in enumerate(zip(reports, norms, strict=True)):
        report.dropped = not math.isfinite(norm)  # no noise share owed: nothing uploaded
        if not report.dropped:
            kept.append(i)
    updates = deltas if len(kept) == len(reports) else deltas[kept]
    mechanism = algorithm.pipeline.mechanism
    if mechanism is not None:
        updates = _scaled(updates, [_clip_scale(mechanism.clip.clip_norm, norms[i]) for i in kept])
    weights = [aggregation_weight(algorithm, num_samples[i]) for i in kept]
    updates = _scaled(updates, weights)
    nonzero = torch.count_nonzero(updates, dim=1).tolist()
    numel, element_size = updates.shape[1], updates.element_size()
    for i, count in zip(kept, nonzero, strict=True):
        _fill(reports[i], mechanism, norms[i], trained[i])
        reports[i].stats["upload_bytes"] = float(encoded_bytes(numel, element_size, count))
    partial.add_rows(algorithm.pipeline.upload_name, updates, weights)
    partial.reports.extend(reports)


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    """‖row‖₂ of every row, each as ``l2_norm(row)`` computes it (``algorithms.norms``)."""
    if rows.device.type == "cpu":
        return l2_norms(rows)
    return torch.stack([l2_norms(row) for row in rows])


def _clip_scale(clip_norm: float, norm: float) -> float:
    """``Clip.apply``'s factor: 1 within the bound, else C/‖Δ‖₂."""
    return 1.0 if norm <= clip_norm else clip_norm / norm


def _scaled(rows: torch.Tensor, factors: list[float]) -> torch.Tensor:
    """Each row times its factor, as ``row * factor`` with a Python float (a factor of 1 leaves
    a row's values as they are, so rows are only multiplied when some factor is not 1)."""
    if all(factor == 1.0 for factor in factors):
        return rows
    column = torch.tensor(factors, dtype=rows.dtype, device=rows.device)[:, None]
    return rows * column


def _fill(report: ClientReport, mechanism, norm: float, result: LocalResult) -> None:
    """A kept client's norms and stats, as ``client_round`` records them."""
    report.pre_clip_norm = norm
    stats = {} if mechanism is None else mechanism.clip.flat_stats(norm)
    report.clipped = stats.pop("clipped", math.nan)
    report.stats = {**stats, "grad_evals_per_step": grad_evals_per_step(result)}
