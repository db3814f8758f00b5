"""Empirical audit of a sketched preset's round (DPSFL, DPSFL-AC): what the sketch releases.

What runs is the preset's own pipeline on every client of the cohort (flat clip, its noise, the
count sketch, as ``privacy.audit``) and, under server or client placement, the server rule's
noisy sketch sum (``FetchSgdServerRule.noisy_sketch_sum``: Σ_i S(u_i) + S(Z)). The observer is
the one the claim is made against: the noisy sum (server or client placement, the latter under
secure aggregation), or under ``local`` placement (the paper's Alg. 1: every client noises its
own sketch and sends it) the canary's own upload.

The canary is the adversarial unit vector of the sketch (``CountSketch.adversarial_unit_vector``:
spread with matching signs over the fullest bucket of row 0), sent at B = 10·C and clipped to C.
Replace-one worlds send ±B·v, add/remove ones B·v or nothing (under local placement, whose
observer sees the canary's own upload, a zero gradient instead: there is always an upload).
The score is the likelihood-ratio direction for the release's noise: S(v) itself when the noise
is i.i.d. per counter (the paper's), and w = (AAᵀ)⁺A·v for the dense variant, whose noise on
the counters is S(Z) with covariance σ²C²·AAᵀ (A the l·m × d sketch matrix). The claim is the
one-release
Gaussian μ = Δ/(σS) of the mechanism's σ and its stated sensitivity S: C for the dense variant
(noise on the clipped vector, the sketch is post-processing), C√l for the paper's (noise on the
counters). With several coordinates per counter (d ≫ m) the adversarial vector moves the
sketch by ‖S(v)‖_F ≈ √(maxload₀ + l − 1) ≫ √l, which the audit catches.
"""

from __future__ import annotations

import numpy as np
import torch

from algorithms.aggregate import PartialAggregate
from algorithms.algorithm import Algorithm
from algorithms.layout import ParamLayout
from algorithms.rng import Purpose, torch_generator
from algorithms.server import ServerContext
from algorithms.transforms import ClientContext
from privacy.audit import (
    CANARY_NORM_FACTOR,
    Adjacency,
    AuditResult,
    CraftedRound,
    audit_two_worlds,
    check_audit_inputs,
)

MIN_LOAD = 4  # d/m the audit needs: without collisions C√l *is* the sketch's sensitivity


def sketch_audit_dim_error(dim: int, cols: int) -> str | None:
    """Why ``dim`` is too small to audit a sketch of ``cols`` columns (None: it is not)."""
    if dim >= MIN_LOAD * cols:
        return None
    return (
        f"a sketch of {cols} columns needs an update dimension >= {MIN_LOAD * cols} "
        f"({MIN_LOAD} coordinates per counter); collisions are what a sketch's sensitivity "
        "depends on: raise --dim or lower algorithm.sketch_cols keeping your model's d/m"
    )


def _test_direction(sketch, v: torch.Tensor, counter_noise: bool) -> torch.Tensor:
    """The likelihood-ratio test's direction for a mean shift S(v) under the release's noise."""
    shift = sketch.sketch(v).flatten()
    if counter_noise:
        return shift / torch.linalg.vector_norm(shift)
    buckets, signs = sketch.hashes()
    matrix = torch.zeros(sketch.rows, sketch.cols, sketch.dim, dtype=torch.float64)
    coordinates = torch.arange(sketch.dim)
    for j in range(sketch.rows):
        matrix[j, buckets[j].long(), coordinates] = signs[j].double()
    matrix = matrix.view(sketch.size, sketch.dim)
    covariance = matrix @ matrix.T
    direction = torch.linalg.lstsq(covariance, shift[:, None], driver="gelsd").solution[:, 0]
    return direction / torch.linalg.vector_norm(direction)


def _scores(
    algorithm: Algorithm,
    crafted: CraftedRound,
    cohort_size: int,
    num_clients: int,
    trials: int,
    canary_sign: float | None,
    seed: int,
    world: int,
) -> np.ndarray:
    server, dim = algorithm.server, crafted.profile.numel()
    sketch = server.count_sketch(dim)
    v = sketch.adversarial_unit_vector().float()
    own_upload_only = algorithm.mechanism.placement == "local"
    direction = _test_direction(sketch, v.double(), counter_noise=own_upload_only)
    scores = np.empty(trials)
    for t in range(trials):
        data = torch_generator(seed, t, Purpose.DATA)  # the same in every world
        updates = crafted.client_updates(data, cohort_size)
        noise = torch_generator(seed, world, t, Purpose.CLIENT_NOISE)
        # Without the canary (add/remove), its own upload is that of a zero gradient.
        sign = 0.0 if canary_sign is None else canary_sign
        updates[0] = sign * CANARY_NORM_FACTOR * crafted.clip_norm * v
        clients = [0] if own_upload_only else range(cohort_size)
        total = PartialAggregate()
        for client in clients:
            if client == 0 and canary_sign is None and not own_upload_only:
                continue
            ctx = ClientContext(noise, float(cohort_size), layout=crafted.layout)
            total.add({"sketch": algorithm.pipeline(updates[client], ctx)}, 1.0)
        server_noise = algorithm.pipeline.server_noise(
            dim, crafted.layout, (seed, t), torch_generator(seed, world, t, Purpose.SERVER_NOISE)
        )
        ctx = ServerContext(float(cohort_size), num_clients, server_noise)
        released = server.noisy_sketch_sum(total, dim, ctx).flatten()
        scores[t] = float(torch.dot(released, direction))
    return scores


def audit_sketch_round(
    algorithm: Algorithm,
    cohort_size: int,
    num_clients: int,
    adjacency: Adjacency,
    trials: int = 1000,
    confidence: float = 0.95,
    dim: int = 2000,
    seed: int = 0,
    noise_scale_for_testing: float = 1.0,
) -> AuditResult:
    """Audit one round of a sketched ``algorithm`` with the sketch's adversarial canary."""
    check_audit_inputs(algorithm, trials)
    reason = sketch_audit_dim_error(dim, algorithm.server.upload.cols)
    if reason is not None:
        raise ValueError(reason)
    layout = ParamLayout(("w",), ((dim,),), (0, dim))
    claim_algorithm = algorithm.bind(layout)
    mechanism = claim_algorithm.mechanism
    crafted = CraftedRound(layout, torch.ones(dim), mechanism.clip.clip_norm, mechanism.sensitivity)
    return audit_two_worlds(
        _scores,
        claim_algorithm,
        crafted,
        (cohort_size, num_clients, trials),
        adjacency,
        confidence,
        seed,
        noise_scale_for_testing,
    )
