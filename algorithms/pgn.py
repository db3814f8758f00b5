"""DP-FedPGN's public drift around clipping and noise (spec 003 §1a, lines 11 and 14).

Local steps mix (1 − β)·g̃ into every gradient, so after K steps of lr η the update carries the
public drift −(1 − β)·K·η·g̃, which is a function of the previous (already private) release.
``StripDrift`` removes it before clipping, Δ̄ = Δ + (1 − β)Kη·g̃ = −ηβ·Σ_k ∇f(x_k + δ; ξ_k), so
only the private part is clipped and noised; ``AddDrift`` puts it back after the noise
(post-processing). K is the number of steps the client ran, η the trainer's lr, g̃ the broadcast
``direction``; β = 1 (or g̃ = 0) makes both the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


def _drift(ctx, beta: float) -> torch.Tensor | None:
    direction = ctx.payload.get("direction")
    if beta == 1 or direction is None:
        return None
    return (1 - beta) * ctx.local_steps * ctx.lr * direction


@dataclass(frozen=True)
class StripDrift:
    beta: float
    selects_by_value: ClassVar[bool] = False

    def apply(self, update, ctx):
        drift = _drift(ctx, self.beta)
        return update if drift is None else update + drift

    def output_bound(self, input_bound):
        return input_bound  # unbounded before the clip that follows


@dataclass(frozen=True)
class AddDrift:
    beta: float
    selects_by_value: ClassVar[bool] = False

    def apply(self, update, ctx):
        drift = _drift(ctx, self.beta)
        return update if drift is None else update - drift

    def output_bound(self, input_bound):
        return input_bound
