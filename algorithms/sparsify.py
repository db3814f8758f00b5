"""Sparsifying update transforms: top-k by magnitude and random-k with a shared mask.

Both keep exactly ⌊p·n⌋ coordinates of every layer (``scope="layer"``, n = the layer's size) or
of the whole update (``scope="global"``, n = d) and zero the rest, so the L2 bound of the output
is that of the input. Placed before client-placed ``GaussianNoise``, a sparsifier records its
mask in the ``ClientContext`` and the noise then lands only on the kept coordinates (Fed-SMP;
DP-FedSAM-top_k's stated intent: expected squared noise norm p·d·σ²C²/m). ``TopK`` placed
after the noise (``source="noisy"``, DP-FedSAM Eq. 12 read literally) masks the noisy update:
at p = 0.4 it keeps ≈ 87% of the noise energy, since the largest noisy coordinates are mostly
noise.

Privacy: a top-k mask computed from the clean update depends on the data and is released
implicitly by the sparse upload; the RDP proofs of DP-FedSAM-top_k and Fed-SMP-top_k do not
cover it (spec 000 §1, ambiguity 2). The random mask of ``RandK`` is drawn from a generator
seeded by (seed, round) only: the same for every client and independent of the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from algorithms.transforms import ClientContext, layer_segments


def _segments(ctx: ClientContext, size: int, scope: str) -> list[tuple[int, int]]:
    return [(0, size)] if scope == "global" else layer_segments(ctx, size)


def _kept(p: float, n: int) -> int:
    return math.floor(p * n)


def topk_mask(score: torch.Tensor, segments, fraction: float) -> torch.Tensor:
    """1 on the ⌊p·n⌋ highest-scoring coordinates of each (start, stop) segment, 0 elsewhere."""
    mask = torch.zeros_like(score)
    for start, stop in segments:
        k = _kept(fraction, stop - start)
        if k:
            mask[start + torch.topk(score[start:stop], k, sorted=False).indices] = 1.0
    return mask


def _record(ctx: ClientContext, mask: torch.Tensor, before_noise: bool) -> None:
    ctx.stats["kept_fraction"] = float(mask.mean())
    if before_noise:
        ctx.mask = mask if ctx.mask is None else ctx.mask * mask


@dataclass(frozen=True)
class TopK:
    """Keep the ⌊p·n⌋ largest-|·| coordinates per layer (or globally); p = 1 is the identity.

    ``source="clean"``: the mask comes from this transform's input (place it before the noise;
    the noise is then restricted to the mask). ``source="noisy"``: place it after the noise.
    """

    fraction: float
    scope: Literal["layer", "global"] = "layer"
    source: Literal["clean", "noisy"] = "clean"

    def apply(self, update, ctx, input_bound):
        if self.fraction >= 1.0:
            return update
        segments = _segments(ctx, update.numel(), self.scope)
        mask = topk_mask(update.abs(), segments, self.fraction)
        _record(ctx, mask, before_noise=self.source == "clean")
        return update * mask

    def output_bound(self, input_bound):
        return input_bound


@dataclass(frozen=True)
class RandK:
    """Keep ⌊p·n⌋ uniformly random coordinates per layer (or globally), one mask per round.

    The mask is drawn from ``ctx.shared_generator`` (seeded by seed and round only), so every
    client of a round keeps the same coordinates; noise placed after it lands on them only.
    """

    fraction: float
    scope: Literal["layer", "global"] = "layer"

    def apply(self, update, ctx, input_bound):
        if self.fraction >= 1.0:
            return update
        if ctx.shared_generator is None:
            raise ValueError("RandK needs the round's shared generator in the ClientContext")
        mask = torch.zeros_like(update)
        for start, stop in _segments(ctx, update.numel(), self.scope):
            k = _kept(self.fraction, stop - start)
            if k:
                order = torch.randperm(
                    stop - start, generator=ctx.shared_generator, device=ctx.shared_generator.device
                )
                mask[start + order[:k].to(update.device)] = 1.0
        _record(ctx, mask, before_noise=True)
        return update * mask

    def output_bound(self, input_bound):
        return input_bound
