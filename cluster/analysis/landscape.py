"""Loss-landscape slices around a model: the flatness figures of DP-FedSAM and DP-FedPGN.

Li et al. (2018), "Visualizing the Loss Landscape of Neural Nets", as the two papers plot it
(spec 000 Figs 1/3, spec 003 Figs 1–3 and 8): the loss at θ + α·d₁ (1-D) or θ + α·d₁ + β·d₂
(2-D) for α, β on a grid in [−span, span], where each direction d is a Gaussian draw
*filter-normalised* to the model: for every weight tensor with two or more dimensions (a conv's
kernels, a linear layer's rows), each filter d_f (a slice along dimension 0) is rescaled to the
norm of the model's own filter, d_f ← d_f·‖θ_f‖/‖d_f‖, so that a step means the same relative
change in every layer whatever its scale (a GroupNorm'd or weight-decayed layer is not flatter
for being small). One-dimensional tensors (biases, norm scales and shifts) get d = 0, as in Li
et al.'s ``ignore='biasbn'``. Directions come from an explicit seeded generator, so two runs'
landscapes can be compared along the same random draws of their own scales.

The loss is the task's mean cross-entropy on a fixed, seeded subset of rows (the training rows
by default, as Li et al. and the papers; or the test rows), in eval mode, in float64
accumulation. ``sharpness`` sums up a slice: the mean loss increase over the grid and at the
edge (``|α|`` = span, or the square's border), a number to compare runs by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from actors.client_host import evaluate_batches
from algorithms.layout import ParamLayout
from algorithms.local import ModelObjective


def filter_normalized_direction(
    layout: ParamLayout, params: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """A flat direction: N(0, 1) per coordinate, each filter of a ≥ 2-D tensor rescaled to the
    norm of the same filter of ``params``; 1-D tensors zero."""
    direction = torch.randn(params.shape, generator=generator, dtype=params.dtype)
    pieces = layout.unflatten(direction)
    for piece, theta in zip(pieces.values(), layout.unflatten(params).values(), strict=True):
        if piece.dim() <= 1:
            piece.zero_()
            continue
        filters, own = piece.flatten(1), theta.flatten(1)
        scale = own.norm(dim=1) / filters.norm(dim=1).clamp_min(torch.finfo(params.dtype).tiny)
        filters.mul_(scale[:, None])  # views: ``direction`` itself is rescaled
    return direction


@dataclass(frozen=True)
class Slice:
    """The loss (and accuracy) on a grid of ``coordinates`` along one or two directions."""

    coordinates: list[float]
    loss: np.ndarray  # [n] or [n, n]: loss[i, j] at α = coordinates[i], β = coordinates[j]
    accuracy: np.ndarray

    @property
    def center_loss(self) -> float:
        middle = len(self.coordinates) // 2
        return float(self.loss[(middle,) * self.loss.ndim])

    def sharpness(self) -> dict[str, float]:
        """Mean loss increase over the grid, and over its edge (``|α|`` = span or the border)."""
        rise = self.loss - self.center_loss
        edge = np.ones_like(rise, dtype=bool)
        edge[(slice(1, -1),) * rise.ndim] = False
        return {
            "center_loss": self.center_loss,
            "mean_loss_increase": float(rise.mean()),
            "edge_loss_increase": float(rise[edge].mean()),
            "max_loss": float(self.loss.max()),
        }


def loss_slice(
    model: nn.Module,
    params: torch.Tensor,
    directions: list[torch.Tensor],
    coordinates: list[float],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 1000,
    progress: Callable[[], None] | None = None,
) -> Slice:
    """The loss of ``model`` at params + Σ_k c_k·directions[k] for every point of the grid
    ``coordinates``^len(directions) (one or two directions), on rows ``x``, ``y``, through the
    hosts' evaluation (``evaluate_batches``: the model's own parameters are never touched);
    ``progress()`` after each point."""
    if len(directions) not in (1, 2):
        raise ValueError(f"a slice has 1 or 2 directions, got {len(directions)}")
    objective = ModelObjective(model, ParamLayout.of(model))
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(y), batch_size)]
    shape = (len(coordinates),) * len(directions)
    loss, accuracy = np.empty(shape), np.empty(shape)
    for index in np.ndindex(*shape):
        point = params.clone()
        for k, i in enumerate(index):
            point.add_(directions[k], alpha=coordinates[i])
        result = evaluate_batches(objective, point, batches)
        loss[index], accuracy[index] = result.loss_sum / result.count, result.correct / result.count
        if progress is not None:
            progress()
    return Slice(list(coordinates), loss, accuracy)
