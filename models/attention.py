"""Multi-head attention pieces shared by the ViT and RoBERTa encoders."""

from __future__ import annotations

import torch


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, D) → (B, heads, N, D / heads)."""
    b, n, d = x.shape
    return x.reshape(b, n, num_heads, d // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, d) → (B, N, heads · d)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)
