"""Local Update Sparsification (LUS, Cheng et al. 2022): drop the coordinates that matter least.

Before clipping, each coordinate k of the local update Δ is scored by the first-order change of
the local loss if it were reset, |G_k·Δ_k| with G = ∇f_i(w_K) at the final local weights,
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from algorithms.sparsify import topk_mask
from algorithms.transforms import scoped_segments

LusScope = Literal["tensor", "module", "global"]


@dataclass(frozen=True)
class LocalUpdateSparsification:
    sparsity: float  # c: the fraction of each group's coordinates to drop
    gradient: Literal["data", "batch"] = "data"
    scope: LusScope = "tensor"
    selects_by_value: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.scope not in ("tensor", "module", "global"):
            raise ValueError(f"LUS scope must be tensor, module or global, not {self.scope!r}")

    def apply(self, update, ctx):
        if self.sparsity == 0:
            return update
        if ctx.local_gradient is None:
            raise ValueError("LUS needs the gradient at the final local weights in the context")
        score = (ctx.local_gradient(self.gradient) * update).abs()
        segments = scoped_segments(ctx.layout, update.numel(), self.scope)
        mask = topk_mask(score, segments, 1 - self.sparsity)
        ctx.stats["kept_fraction"] = float(mask.mean())
        return update * mask

    def output_bound(self, input_bound):
        return input_bound
