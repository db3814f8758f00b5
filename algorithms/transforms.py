"""Update transforms: small composable steps applied to a client's flat model delta.

Each transform maps ``(update, ctx, input_bound) -> update`` and declares ``output_bound``: the
L2 bound on one client's output given an L2 bound on its input. ``UpdatePipeline`` threads the
bound through the chain, so a noise step knows the sensitivity of what it noises (like optax's
``chain``, with sensitivity bookkeeping added).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import torch

from algorithms.layout import ParamLayout


@dataclass
class ClientContext:
    """What a transform may read or record for one client in one round.

    ``layout`` gives the layer (parameter tensor) boundaries of the flat update;
    ``shared_generator`` is seeded by (seed, round) only, identical for every client (RandK's
    shared mask); ``mask`` is set by a sparsifier placed before client-placed noise, so that the
    noise lands only on the kept coordinates.
    """

    noise_generator: torch.Generator
    nominal_cohort_size: float
    stats: dict[str, float] = field(default_factory=dict)
    layout: ParamLayout | None = None
    shared_generator: torch.Generator | None = None
    mask: torch.Tensor | None = None
    # ∇f_i at the final local weights, on all local data ("data") or one mini-batch ("batch")
    local_gradient: Callable[[str], torch.Tensor] | None = None
    payload: dict[str, torch.Tensor] = field(default_factory=dict)  # the server's broadcast
    local_steps: int = 0  # K actually run this round
    lr: float = 0.0  # η of the local trainer


def layer_segments(ctx: ClientContext, size: int) -> list[tuple[int, int]]:
    """(start, stop) of every layer of the flat update; one segment without a layout."""
    if ctx.layout is None:
        return [(0, size)]
    offsets = ctx.layout.offsets
    return list(zip(offsets[:-1], offsets[1:], strict=True))


class UpdateTransform(Protocol):
    def apply(self, update: torch.Tensor, ctx: ClientContext, input_bound: float) -> torch.Tensor:
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
    Records the pre-clip norm, whether it was clipped and α = min(1, C/‖Δ‖₂) (flat norms).
    """

    clip_norm: float
    scope: Literal["flat", "layer"] = "flat"
    num_layers: int | None = None

    def apply(self, update, ctx, input_bound):
        norm = float(torch.linalg.vector_norm(update))
        ctx.stats["pre_clip_norm"] = norm
        ctx.stats["alpha"] = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        if self.scope == "flat":
            ctx.stats["clipped"] = float(norm > self.clip_norm)
            return update if norm <= self.clip_norm else update * (self.clip_norm / norm)
        # All layers at once: per-segment norms, then one scale per layer (1 within the bound).
        segments = layer_segments(ctx, update.numel())
        sizes = torch.tensor([stop - start for start, stop in segments], device=update.device)
        norms = torch.segment_reduce(update * update, "sum", lengths=sizes).sqrt()
        scale = torch.where(norms > self.clip_norm, self.clip_norm / norms, 1.0)
        ctx.stats["clipped"] = float((norms > self.clip_norm).any())
        return update * torch.repeat_interleave(scale.to(update.dtype), sizes)

    def output_bound(self, input_bound):
        if self.scope == "flat":
            return min(input_bound, self.clip_norm)
        if self.num_layers is None:
            raise ValueError("per-layer clipping needs the model's layout: call Algorithm.bind")
        return min(input_bound, self.clip_norm * math.sqrt(self.num_layers))

    def bind(self, layout: ParamLayout) -> Clip:
        return self if self.scope == "flat" else replace(self, num_layers=len(layout.names))


@dataclass(frozen=True)
class GaussianNoise:
    """Gaussian mechanism with noise multiplier σ on the sum of m clients' updates of sensitivity S.

    The sum receives N(0, σ²S²) per coordinate, so the mean over m clients has std σS/m.
    ``noise_scale`` k multiplies that std (σS·k on the sum): a noise cohort of C_n clients
    simulated with m sets k = m/C_n, so the mean carries the std σS/C_n that a cohort of C_n
    would (pfl-research's ``noise_cohort_size``; the accountant is charged q = C_n/N).
    ``placement="server"``: the server adds it once to the sum (trusted aggregator).
    ``placement="client"``: each client adds N(0, σ²S²/m) to its own update (m = nominal cohort
    size), which sums to the same distribution over a fixed-size cohort (secure aggregation).
    """

    noise_multiplier: float
    placement: Literal["server", "client"] = "server"
    noise_scale: float = 1.0

    def apply(self, update, ctx, input_bound):
        if self.placement == "server" or self.noise_multiplier == 0:
            return update
        std = self.sum_std(input_bound) / math.sqrt(ctx.nominal_cohort_size)
        noise = torch.randn(
            update.shape, generator=ctx.noise_generator, device=update.device, dtype=update.dtype
        )
        if ctx.mask is not None:  # a sparsifier ran before: noise only on the kept coordinates
            noise = noise * ctx.mask
        return update + std * noise

    def output_bound(self, input_bound):
        return input_bound

    def sum_std(self, input_bound: float) -> float:
        """Per-coordinate std of the noise on the sum of the cohort's updates: σ·S·k."""
        if self.noise_multiplier == 0:
            return 0.0
        if math.isinf(input_bound):
            raise ValueError("Gaussian noise needs a bounded input: put Clip before GaussianNoise")
        return self.noise_multiplier * input_bound * self.noise_scale


@dataclass(frozen=True)
class UpdatePipeline:
    """A chain of transforms applied in order, with the L2 bound threaded through."""

    transforms: tuple[UpdateTransform, ...] = ()

    def __post_init__(self) -> None:
        if sum(isinstance(t, GaussianNoise) for t in self.transforms) > 1:
            raise ValueError("a pipeline holds at most one GaussianNoise step")
        if all(getattr(t, "num_layers", 0) is not None for t in self.transforms):
            self.server_noise_std()  # fails early on noise without a bound

    def bind(self, layout: ParamLayout) -> UpdatePipeline:
        """The pipeline with layout-dependent transforms (per-layer clipping) resolved."""
        return UpdatePipeline(
            tuple(t.bind(layout) if hasattr(t, "bind") else t for t in self.transforms)
        )

    def __call__(self, update: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        bound = math.inf
        for transform in self.transforms:
            update = transform.apply(update, ctx, bound)
            bound = transform.output_bound(bound)
        return update

    def _noise_steps(self) -> list[tuple[GaussianNoise, float]]:
        steps, bound = [], math.inf
        for transform in self.transforms:
            if isinstance(transform, GaussianNoise):
                steps.append((transform, bound))
            bound = transform.output_bound(bound)
        return steps

    @property
    def sensitivity(self) -> float:
        """L2 bound of one client's contribution (before noise); inf when nothing bounds it."""
        bound = math.inf
        for transform in self.transforms:
            bound = transform.output_bound(bound)
        return bound

    @property
    def noise_multiplier(self) -> float:
        """σ of the pipeline's Gaussian mechanism (0 when it adds no noise)."""
        steps = self._noise_steps()
        return steps[0][0].noise_multiplier if steps else 0.0

    def server_noise_std(self) -> float:
        """Std of the noise the server must add to the sum (server-placed noise only)."""
        steps = [
            (noise, bound) for noise, bound in self._noise_steps() if noise.placement == "server"
        ]
        return steps[0][0].sum_std(steps[0][1]) if steps else 0.0
