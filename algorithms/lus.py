"""Local Update Sparsification (LUS, Cheng et al. 2022): drop the coordinates that matter least.

Before clipping, each coordinate k of the local update Δ is scored by the first-order change of
the local loss if it were reset, ``|G_k·Δ_k|`` with G = ∇f_i(w_K) at the final local weights,
on all the client's data (``gradient="data"``, default) or on one mini-batch of the trainer's
batch size drawn from a per-(round, client) stream (``gradient="batch"``) — the paper leaves it
open (spec 001, [A]); ``ClientContext.local_gradient(kind)`` computes it. Per group of n
coordinates the ⌊(1 − c)·n⌋ highest-scoring are kept and the rest zeroed; the groups
(``scope``, the spec's "configurable layer grouping") are each parameter tensor (``tensor``,
default), each module's tensors together (``module``: a layer's weight and bias), or the whole
update (``global``). The mask depends only on the client's
own data before clipping, so the L2 bound of what follows is unchanged; the mechanism's noise
stays dense (LUS is not a sparse upload), so its data-dependent mask costs no privacy.
c = 0 keeps everything (the identity).

``score`` is for the spec's ablation (001 §7 check 4: "the Taylor mask raises the local loss
less than a random mask; compare also magnitude top-k"): ``taylor`` (the paper, default),
``magnitude`` (``|Δ_k|``) or ``random`` (uniform scores from the client's own seeded stream,
``Purpose.LUS_MASK``: a mask independent of the data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from algorithms.rng import Purpose
from algorithms.sparsify import topk_mask
from algorithms.transforms import scoped_segments

LusScope = Literal["tensor", "module", "global"]
LusScore = Literal["taylor", "magnitude", "random"]


@dataclass(frozen=True)
class LocalUpdateSparsification:
    sparsity: float  # c: the fraction of each group's coordinates to drop
    gradient: Literal["data", "batch"] = "data"
    scope: LusScope = "tensor"
    score: LusScore = "taylor"
    selects_by_value: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.scope not in ("tensor", "module", "global"):
            raise ValueError(f"LUS scope must be tensor, module or global, not {self.scope!r}")
        if self.score not in ("taylor", "magnitude", "random"):
            raise ValueError(f"LUS score must be taylor, magnitude or random, not {self.score!r}")

    def apply(self, update, ctx):
        if self.sparsity == 0:
            return update
        score = self._scores(update, ctx)
        segments = scoped_segments(ctx.layout, update.numel(), self.scope)
        mask = topk_mask(score, segments, 1 - self.sparsity)
        ctx.stats["kept_fraction"] = float(mask.mean())
        return update * mask

    def _scores(self, update, ctx):
        if self.score == "magnitude":
            return update.abs()
        if self.score == "random":
            if ctx.client_stream is None:
                raise ValueError("LUS's random mask needs the client's stream in the context")
            generator = ctx.client_stream(Purpose.LUS_MASK)
            return torch.rand(update.shape, generator=generator, device=update.device)
        if ctx.local_gradient is None:
            raise ValueError("LUS needs the gradient at the final local weights in the context")
        return (ctx.local_gradient(self.gradient) * update).abs()

    def output_bound(self, input_bound):
        return input_bound
