"""Empirical audit of a sample-level preset's round (DP-SCAFFOLD, DP-FedAvg at sample level).

What runs is the preset's own client round (``algorithms.client.client_round``): its local
trainer with the ``DpSgdGradient`` rule (per-example clipping, flat or per tensor, noise κ·S·σ_g
per step from the client's seeded stream, the SCAFFOLD correction c − c_i, η₀/(sK)) and its
uploads (Δy_i and Δc_i). Only the per-example gradients are crafted (``CraftedObjective``), as
update canaries are in client-level audits: the client's other records give realistic
gradients (``privacy.audit.CraftedRound``: shared and own directions, norms spread around C),
and the canary record gives +B·v (B = 10·S) in one world and −B·v (replace-one) or 0 (its
clipped sum without the record: add/remove) in the other.

The observer is the server, which sees the client's upload; the score is ⟨Δy_i, v⟩ (Δc_i is a
function of Δy_i and public values). The canary is in every batch (the batch is the whole
client, s = 1), so the audit tests the clipping, the noise scale and their composition over the
K steps, not the amplification by sampling, which is the accountant's. With the canary's
clipped gradient moving by Δ = 2S (replace-one) or S against noise κ·S·σ_g per step, the K
steps release a Gaussian with μ = √K·Δ/(κ·S·σ_g) = √K/σ_g along v; its ε(δ) is the claim.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from algorithms.algorithm import Algorithm
from algorithms.client import client_round
from algorithms.layout import ParamLayout
from algorithms.rng import Purpose, torch_generator
from privacy.audit import (
    CANARY_NORM_FACTOR,
    AuditResult,
    CraftedRound,
    audit_layout,
    audit_result,
)

RECORDS = 8  # the canary's client: the canary and 7 other records, all in every batch


@dataclass
class CraftedObjective:
    """An objective whose per-example gradients are a table: record j's row (x holds j)."""

    layout: ParamLayout
    table: torch.Tensor  # records × d
    augment: None = None
    grad_evals: int = 0
    draws_from_global_rng: bool = False

    def per_example_gradients(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        self.grad_evals += 1
        rows = self.table[x[:, 0].long()]
        return torch.tensor(0.0), torch.zeros(len(y), 1), rows


def canary_scores(
    algorithm: Algorithm,
    crafted: CraftedRound,
    trials: int,
    canary_sign: float,
    seed: int,
    world: int,
) -> list[float]:
    """⟨Δy, v⟩ of the canary's client in ``trials`` rounds; canary gradient ``canary_sign``·B·v."""
    size = crafted.profile.numel()
    v = crafted.canary_direction(algorithm, (seed, 0))  # a quiet coordinate of each layer
    x = torch.arange(RECORDS, dtype=torch.float32)[:, None]
    y = torch.zeros(RECORDS, dtype=torch.long)
    # Public and fixed over the trials (else their spread would only dilute the test): x, c, c_i.
    public = torch_generator(seed, Purpose.DATA)
    params = torch.randn(size, generator=public)
    payload = {"control": 0.1 * torch.randn(size, generator=public)}
    state = {"control": 0.1 * torch.randn(size, generator=public)}
    scores = []
    for t in range(trials):
        data = torch_generator(seed, t, Purpose.DATA)  # the same in every world
        table = crafted.client_updates(data, RECORDS)
        table[0] = canary_sign * CANARY_NORM_FACTOR * crafted.sensitivity * v
        objective = CraftedObjective(crafted.layout, table)
        uploads, *_ = client_round(
            algorithm, objective, params, payload, x, y, state, seed, t, world, 1.0
        )
        scores.append(float(torch.dot(uploads["delta"].double(), v.double())))
    return scores


def audit_sample_round(
    algorithm: Algorithm,
    trials: int = 1000,
    confidence: float = 0.95,
    dim: int = 16,
    seed: int = 0,
    noise_scale_for_testing: float = 1.0,
) -> AuditResult:
    """Audit one client round of a sample-level ``algorithm`` (its K steps, its uploads)."""
    rule = algorithm.sample_dp
    if rule is None or rule.noise_multiplier <= 0:
        raise ValueError("the sample-level audit needs DP-SGD local steps with σ_g > 0")
    if trials < 20:
        raise ValueError(f"trials must be >= 20 (10 to pick a test, 10 to run it), got {trials}")
    layout = audit_layout(dim)
    sensitivity = rule.sensitivity(len(layout.names))
    crafted = CraftedRound.make(dim, rule.clip_norm, sensitivity, seed)
    trainer = dataclasses.replace(algorithm.trainer, batch_size=RECORDS, batch_sampling="fresh")
    steps = trainer.num_steps(RECORDS)
    claim_algorithm = dataclasses.replace(algorithm, trainer=trainer)
    noisy = dataclasses.replace(
        rule, noise_multiplier=rule.noise_multiplier * noise_scale_for_testing
    )
    run = dataclasses.replace(claim_algorithm, trainer=dataclasses.replace(trainer, gradient=noisy))
    positives = canary_scores(run, crafted, trials, 1.0, seed, world=1)
    other = -1.0 if rule.adjacency == "replace_one" else 0.0
    negatives = canary_scores(run, crafted, trials, other, seed, world=2)
    mu = math.sqrt(steps) / rule.noise_multiplier
    return audit_result(
        np.asarray(positives),
        np.asarray(negatives),
        mu,
        confidence,
        rule.unaccounted_reason is None,
    )
