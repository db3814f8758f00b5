"""Sparsifying update transforms: top-k by magnitude and random-k with a shared public mask.

Both keep exactly ⌊p·n⌋ coordinates of every layer (``scope="layer"``, n = the layer's size) or
of the whole update (``scope="global"``, n = d) and zero the rest, so the L2 bound of the output
is that of the input.

Privacy. ``TopK`` decides from the update's values which coordinates survive
(``selects_by_value``): the mask is a function of the client's data. The Gaussian mechanism
stays valid only if its noise does not follow that mask (dense noise on the sum,
``algorithms.mechanism.DenseSupport``); noise on each client's kept coordinates only, as the
top-k papers describe (``UploadSupport``), or a top-k of a client's noisy update (DP-FedSAM
Eq. 12 read literally: at p = 0.4 it keeps ≈ 87% of the noise energy, since the largest noisy
coordinates are mostly noise) make the preset unaccounted. ``RandK``'s mask is drawn from the
round's public randomness (seed, round) only, the same for every client, so noise restricted to
it (``SharedMaskSupport``) is a Gaussian mechanism on the coordinates anyone can release.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from algorithms.layout import ParamLayout
from algorithms.rng import Purpose, torch_generator
from algorithms.transforms import ClientContext, scoped_segments


def _kept(p: float, n: int) -> int:
    """⌊p·n⌋ as exact arithmetic gives it: p = 1 − 0.9 is 0.0999…98 in floats, whose product
    with n = 10 would floor to 0 (a 10-wide bias never updated at LUS c = 0.9); a product
    within 5·10⁻⁷ of an integer is taken as that integer."""
    return math.floor(round(p * n, 6))


def topk_mask(score: torch.Tensor, segments, fraction: float) -> torch.Tensor:
    """1 on the ⌊p·n⌋ highest-scoring coordinates of each (start, stop) segment, 0 elsewhere."""
    mask = torch.zeros_like(score)
    for start, stop in segments:
        k = _kept(fraction, stop - start)
        if k:
            mask[start + torch.topk(score[start:stop], k, sorted=False).indices] = 1.0
    return mask


@dataclass(frozen=True)
class TopK:
    """Keep the ⌊p·n⌋ largest-``|·|`` coordinates per layer (or globally); p = 1 is the identity."""

    fraction: float
    scope: Literal["layer", "global"] = "layer"
    selects_by_value: ClassVar[bool] = True

    def apply(self, update, ctx):
        if self.fraction >= 1.0:
            return update
        segments = scoped_segments(ctx.layout, update.numel(), self.scope)
        mask = topk_mask(update.abs(), segments, self.fraction)
        ctx.stats["kept_fraction"] = float(mask.mean())
        return update * mask

    def output_bound(self, input_bound):
        return input_bound


@functools.lru_cache(maxsize=4)
def _shared_mask(randk, size, layout, round_key, device, dtype) -> torch.Tensor:
    if device != "cpu":  # drawn on the CPU, as the server draws it: a CUDA generator's
        # randperm is another stream, and server noise would miss the clients' coordinates
        return _shared_mask(randk, size, layout, round_key, "cpu", dtype).to(device)
    generator = torch_generator(*round_key, Purpose.SHARED_MASK)
    mask = torch.zeros(size, dtype=dtype)
    for start, stop in scoped_segments(layout, size, randk.scope):
        k = _kept(randk.fraction, stop - start)
        if k:
            order = torch.randperm(stop - start, generator=generator)
            mask[start + order[:k]] = 1.0
    return mask


@dataclass(frozen=True)
class RandK:
    """Keep ⌊p·n⌋ uniformly random coordinates per layer (or globally), one mask per round.

    The mask is a pure function of the round's public key (seed, round) and the layout: every
    client of a round keeps the same coordinates, and the server can recompute them.
    """

    fraction: float
    scope: Literal["layer", "global"] = "layer"
    selects_by_value: ClassVar[bool] = False

    def shared_mask(
        self,
        size: int,
        layout: ParamLayout | None,
        round_key: tuple[int, int],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The round's mask: 1 on the kept coordinates (drawn on the CPU whatever ``device``
        it is returned on, so that clients on a GPU and the server agree; do not modify).

        Every client of a round and the server ask for the same mask: the last few are cached.
        """
        return _shared_mask(self, size, layout, round_key, str(device), dtype)

    def apply(self, update, ctx: ClientContext):
        if self.fraction >= 1.0:
            return update
        mask = self.shared_mask(update.numel(), ctx.layout, ctx.round_key, update.device)
        ctx.stats["kept_fraction"] = float(mask.mean())
        return update * mask.to(update.dtype)

    def output_bound(self, input_bound):
        return input_bound
