"""Tasks: a named pairing of a data source with a model factory and a loss.

Metrics are loss (mean cross-entropy) and top-1 accuracy for every classification task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch
from torch import nn

from models.logreg import LogisticRegression


@dataclass(frozen=True)
class Task:
    name: str
    source: str
    build_model: Callable[[tuple[int, ...], int], nn.Module]

    def model(self, x_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return self.build_model(tuple(x_shape), int(num_classes))

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, y)


TASKS: dict[str, Task] = {
    "synthetic_logreg": Task(
        "synthetic_logreg", "synthetic", lambda shape, k: LogisticRegression(prod(shape), k)
    ),
}
