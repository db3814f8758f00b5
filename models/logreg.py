"""Multinomial logistic regression: one linear layer; softmax lives in the loss."""

from __future__ import annotations

import torch
from torch import nn


class LogisticRegression(nn.Module):
    """``logits = x W + b`` with W ∈ R^{in×classes}; 410 parameters for 40 features, 10 classes."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))
