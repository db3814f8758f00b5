"""Update transforms: small composable steps applied to a client's flat model delta.

Each transform maps ``(update, ctx) -> update`` and declares ``output_bound``: the L2 bound on
one client's output given an L2 bound on its input, and ``selects_by_value``: whether which
coordinates it keeps depends on the values it is given (top-k, LUS) or not (clipping, a mask
drawn from public randomness). ``UpdatePipeline`` (``algorithms.pipeline``) chains them around
the preset's ``GaussianMechanism`` (``algorithms.mechanism``), which alone adds noise; nothing
passes between transforms except the update itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import ClassVar, Literal, Protocol

import torch

from algorithms.layout import ParamLayout
from algorithms.norms import l2_norm, segment_l2_norms


@dataclass
class ClientContext:
    """What a transform may read (or record as a diagnostic) for one client in one round.

    ``layout`` gives the layer (parameter tensor) boundaries of the flat update; ``round_key``
    = (seed, round) is the round's public randomness (RandK's shared mask), identical for every
    client and independent of any data. ``stats`` only collects per-client diagnostics for the
    logs; no transform reads it.
    """

    noise_generator: torch.Generator
    nominal_cohort_size: float
    stats: dict[str, float] = field(default_factory=dict)
    layout: ParamLayout | None = None
    round_key: tuple[int, int] = (0, 0)
    # ∇f_i at the final local weights, on all local data ("data") or one mini-batch ("batch")
    local_gradient: Callable[[str], torch.Tensor] | None = None
    payload: dict[str, torch.Tensor] = field(default_factory=dict)  # the server's broadcast
    local_steps: int = 0  # K actually run this round
    lr: float = 0.0  # η of the local trainer
    # The client's own seeded stream for a ``Purpose`` (its private randomness, no data)
    client_stream: Callable[[int], torch.Generator] | None = None


def layer_segments(layout: ParamLayout | None, size: int) -> list[tuple[int, int]]:
    """(start, stop) of every layer of a flat update; one segment without a layout."""
    if layout is None:
        return [(0, size)]
    offsets = layout.offsets
    return list(zip(offsets[:-1], offsets[1:], strict=True))


def scoped_segments(layout: ParamLayout | None, size: int, scope: str) -> list[tuple[int, int]]:
    """The groups a per-group operation (top-k, LUS) runs in: the whole update (``global``),
    each module's tensors together (``module``), else each parameter tensor (top-k's ``layer``,
    LUS's ``tensor``)."""
    if scope == "global":
        return [(0, size)]
    if scope == "module":
        return module_segments(layout, size)
    return layer_segments(layout, size)


@lru_cache(maxsize=32)
def module_segments(layout: ParamLayout | None, size: int) -> list[tuple[int, int]]:
    """(start, stop) of every module's tensors together (``conv1.weight`` and ``conv1.bias``:
    one segment; they are adjacent in the layout); one segment without a layout. Found once
    per layout (every client of every round asks), so callers must not modify the list."""
    if layout is None:
        return [(0, size)]
    segments: list[tuple[int, int]] = []
    modules: list[str] = []
    for name, (start, stop) in zip(layout.names, layer_segments(layout, size), strict=True):
        module = name.rpartition(".")[0]
        if modules and modules[-1] == module:
            segments[-1] = (segments[-1][0], stop)
        else:
            segments.append((start, stop))
            modules.append(module)
    return segments


class UpdateTransform(Protocol):
    selects_by_value: ClassVar[bool]  # its kept coordinates depend on the update's values

    def apply(self, update: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        """Transform one client's update."""

    def output_bound(self, input_bound: float) -> float:
        """L2 bound of the output, given the L2 bound of the input."""


@dataclass(frozen=True)
class Clip:
    """L2 clipping to norm C.

    ``scope="flat"``: the whole update, Δ ← Δ·min(1, C/‖Δ‖₂); L2 bound C.
    ``scope="layer"`` (DP-FedSAM's and DP-FedPGN's code): every parameter tensor separately,
    Δ_l ← Δ_l·min(1, C/‖Δ_l‖₂), so the whole update's L2 bound is C·√L for L tensors; the noise
    is scaled to that bound. ``num_layers`` is set by ``bind`` from the model's layout.
    Records the pre-clip norm, whether it was clipped, α = min(1, C/‖Δ‖₂) (flat norms) and the
    post-clip norm (min(‖Δ‖₂, C) flat; (Σ_l min(‖Δ_l‖₂, C)²)^½ per layer).

    ``rule="median"`` (per layer only; the DP-FedPGN authors' code, spec 003 §1c): C is not
    given but each client's own C_i = the median of its per-tensor norms ‖Δ_l‖₂ (``torch``'s
    median: the lower middle one for an even L), recorded as ``client_clip_norm``; the noise is
    then scaled to C_i (``GaussianMechanism``). The bound depends on the client's data, so there
    is none: ``output_bound`` is ∞ and no accountant's ε holds.
    """

    clip_norm: float
    scope: Literal["flat", "layer"] = "flat"
    num_layers: int | None = None
    rule: Literal["fixed", "median"] = "fixed"
    selects_by_value: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.rule not in ("fixed", "median"):
            raise ValueError(f"clip rule must be fixed or median, got {self.rule!r}")
        if self.rule == "median" and self.scope != "layer":
            raise ValueError("the median rule takes the median of per-layer norms: scope layer")
        if self.rule == "median" and not math.isnan(self.clip_norm):
            raise ValueError("the median rule picks each client's C_i: clip_norm must be nan")

    def apply(self, update, ctx, norm: float | None = None):
        """``norm``: ``algorithms.norms.l2_norm(update)`` if the caller has it (that number:
        an upper bound of ‖update‖₂, which keeps the clipped norm ≤ C; no second pass)."""
        if norm is None:
            norm = l2_norm(update)
        ctx.stats["pre_clip_norm"] = norm
        if self.scope == "flat":
            ctx.stats.update(self.flat_stats(norm))
            return update if norm <= self.clip_norm else update * (self.clip_norm / norm)
        # Each layer's norm bound, then one scale per layer (1 within the bound).
        segments = layer_segments(ctx.layout, update.numel())
        sizes = torch.tensor([stop - start for start, stop in segments], device=update.device)
        norms = segment_l2_norms(update, sizes)
        clip_norm = self.clip_norm
        if self.rule == "median":
            clip_norm = float(norms.median())
            ctx.stats["client_clip_norm"] = clip_norm
        ctx.stats["alpha"] = min(1.0, clip_norm / norm) if norm > 0 else 1.0
        scale = torch.where(norms > clip_norm, clip_norm / norms, 1.0)
        ctx.stats["clipped"] = float((norms > clip_norm).any())
        ctx.stats["post_clip_norm"] = float(torch.clamp(norms, max=clip_norm).norm())
        return update * torch.repeat_interleave(scale.to(update.dtype), sizes)

    def flat_stats(self, norm: float) -> dict[str, float]:
        """The flat clip's diagnostics for a pre-clip norm ``norm``: α = min(1, C/‖Δ‖₂),
        whether it clipped (1.0 or 0.0), and the post-clip norm min(‖Δ‖₂, C)."""
        return {
            "alpha": min(1.0, self.clip_norm / norm) if norm > 0 else 1.0,
            "clipped": float(norm > self.clip_norm),
            "post_clip_norm": min(norm, self.clip_norm),
        }

    @property
    def unaccounted_reason(self) -> str | None:
        if self.rule != "median":
            return None
        return (
            "clip_rule median: each client clips every tensor to C_i, the median of its own "
            "per-tensor update norms, and scales its noise to C_i (the DP-FedPGN authors' "
            "code), so the noise depends on the data and no sensitivity holds for all clients"
        )

    def output_bound(self, input_bound):
        if self.rule == "median":
            return math.inf  # C_i is the client's own: no bound holds for every client
        if self.scope == "flat":
            return min(input_bound, self.clip_norm)
        if self.num_layers is None:
            raise ValueError("per-layer clipping needs the model's layout: call Algorithm.bind")
        return min(input_bound, self.clip_norm * math.sqrt(self.num_layers))

    def bind(self, layout: ParamLayout) -> Clip:
        return self if self.scope == "flat" else replace(self, num_layers=len(layout.names))


def bind_all(transforms: tuple, layout: ParamLayout) -> tuple:
    """``transforms`` with the layout-dependent ones resolved for ``layout``."""
    return tuple(t.bind(layout) if hasattr(t, "bind") else t for t in transforms)
