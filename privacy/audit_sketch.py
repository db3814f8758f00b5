"""Empirical audit of a sketched preset's round (DPSFL, DPSFL-AC): what the sketch releases.

What runs is the preset's own pipeline on every client of the cohort (flat clip, its noise, the
count sketch, as ``privacy.audit``) and, under server or client placement, the server rule's
noisy sketch sum (``FetchSgdServerRule.noisy_sketch_sum``: Σ_i S(u_i) + S(Z)). The observer is
the one the claim is made against: the noisy sum (server or client placement, the latter under
secure aggregation), or under ``local`` placement (the paper's Alg. 1: every client noises its
own sketch and sends it) the canary's own upload.

The canary is the adversarial unit vector of the sketch (``CountSketch.adversarial_unit_vector``:
spread with matching signs over the fullest bucket of row 0), sent at B = 10·C and clipped to C.
Replace-one worlds send ±B·v, add/remove ones B·v or nothing. The score is the release's
projection on S(v)/‖S(v)‖, the most powerful linear test. The claim is the one-release
Gaussian μ = Δ/(σS) of the mechanism's σ and its stated sensitivity S: C for the dense variant
(noise on the clipped vector, the sketch is post-processing), C√l for the paper's (noise on the
counters). With several coordinates per counter (d ≫ m) the adversarial vector moves the
sketch by ‖S(v)‖_F ≈ √(maxload₀ + l − 1) ≫ √l, which the audit catches.
"""

from __future__ import annotations

import numpy as np
import torch

from algorithms.aggregate import PartialAggregate
from algorithms.layout import ParamLayout
from algorithms.presets import Algorithm
from algorithms.rng import Purpose, torch_generator
from algorithms.server import ServerContext
from algorithms.transforms import ClientContext
from privacy.audit import (
    CANARY_NORM_FACTOR,
    Adjacency,
    AuditResult,
    CraftedRound,
    audit_result,
    claimed_mu,
    with_noise_scaled,
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
    direction = sketch.sketch(v.double()).flatten()
    direction /= torch.linalg.vector_norm(direction)
    own_upload_only = algorithm.mechanism.placement == "local"
    scores = np.empty(trials)
    for t in range(trials):
        data = torch_generator(seed, t, Purpose.DATA)  # the same in every world
        updates = crafted.client_updates(data, cohort_size)
        noise = torch_generator(seed, world, t, Purpose.CLIENT_NOISE)
        if canary_sign is not None:
            updates[0] = canary_sign * CANARY_NORM_FACTOR * crafted.clip_norm * v
        clients = [0] if own_upload_only else range(cohort_size)
        total = PartialAggregate()
        for client in clients:
            if client == 0 and canary_sign is None:
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
    if algorithm.mechanism is None or algorithm.pipeline.noise_multiplier <= 0:
        raise ValueError("the audit needs a private algorithm: clipping and Gaussian noise")
    if trials < 20:
        raise ValueError(f"trials must be >= 20 (10 to pick a test, 10 to run it), got {trials}")
    reason = sketch_audit_dim_error(dim, algorithm.server.upload.cols)
    if reason is not None:
        raise ValueError(reason)
    layout = ParamLayout(("w",), ((dim,),), (0, dim))
    claim_algorithm = algorithm.bind(layout)
    mechanism = claim_algorithm.mechanism
    crafted = CraftedRound(layout, torch.ones(dim), mechanism.clip.clip_norm, mechanism.sensitivity)
    mu = claimed_mu(mechanism.noise_multiplier * mechanism.noise_scale, adjacency)
    run = with_noise_scaled(claim_algorithm, noise_scale_for_testing)
    args = (run, crafted, cohort_size, num_clients, trials)
    positives = _scores(*args, canary_sign=1.0, seed=seed, world=1)
    other = -1.0 if adjacency == "replace_one" else None
    negatives = _scores(*args, canary_sign=other, seed=seed, world=2)
    valid = claim_algorithm.pipeline.unaccounted_reason is None
    return audit_result(positives, negatives, mu, confidence, valid)
