"""DP-FedPGN's public drift around clipping and noise (spec 003 §1a, lines 11 and 14).

Local steps mix (1 − β)·g̃ into every gradient, so after K steps of lr η the update carries the
public drift −(1 − β)·K·η·g̃, which is a function of the previous (already private) release.
``StripDrift`` removes it before clipping, Δ̄ = Δ + (1 − β)Kη·g̃ = −ηβ·Σ_k ∇f(x_k + δ; ξ_k), so
only the private part is clipped and noised. The server puts the drift back once, on the noisy
mean (``MeanServerRule.drift_beta``; post-processing): added by each client it would be summed
over the clients who took part and divided by the nominal cohort m, so that a Poisson cohort of
n ≠ m would scale g̃'s memory term by n/m. K is the fixed number of local steps, η the trainer's
lr, g̃ the broadcast ``direction``; β = 1 (or g̃ = 0) makes it the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


def public_drift(beta: float, scale: float, direction: torch.Tensor | None) -> torch.Tensor | None:
    """(1 − β)·ηK·g̃ for ``scale`` = ηK: the drift K PGN steps of lr η add to an update, a
    function of the broadcast g̃ only (None where it vanishes: β = 1, or no g̃ yet)."""
    if beta == 1 or direction is None:
        return None
    return (1 - beta) * scale * direction


@dataclass(frozen=True)
class StripDrift:
    beta: float
    selects_by_value: ClassVar[bool] = False

    def apply(self, update, ctx):
        drift = public_drift(self.beta, ctx.local_steps * ctx.lr, ctx.payload.get("direction"))
        return update if drift is None else update + drift

    def output_bound(self, input_bound):
        return input_bound  # unbounded before the clip that follows
