"""The privacy mechanism of a private preset: one object owning the clip, the sensitivity, the
noise placement and the set of coordinates that carry noise.

Release model. A round releases R = Σ_{i∈cohort} u_i + Z, where u_i is client i's clipped (and
possibly sparsified) update with ‖u_i‖₂ ≤ S (the sensitivity: C for flat clipping, C·√L for
per-layer clipping over L tensors) and Z is the Gaussian noise. This is the Gaussian mechanism
with noise multiplier σ that the accountants analyse iff

    Z ~ N(0, σ²S²k²) on every coordinate where some client's u_i may be non-zero,

(k = ``noise_scale`` = m/C_n for a noise cohort, 1 otherwise) and that set of coordinates, the
*support*, is a function of public information only. Three supports:

- ``DenseSupport``: every coordinate (DP-FedAvg and every accounted top-k variant).
- ``SharedMaskSupport``: the coordinates of a ``RandK`` mask drawn from (seed, round) only; the
  mechanism zeroes every upload outside it, so outside the mask R = 0 in every world.
- ``UploadSupport``: only the coordinates the client's own upload carries. With a top-k mask
  that depends on the client's data, a coordinate kept by n_j of the m clients of a round gets
  noise variance n_j·σ²S²/m on the sum instead of σ²S², and the support itself reveals the
  data. This is how the top-k papers describe their noise; it is *unaccounted*: the preset runs,
  but no ε is reported (``unaccounted_reason``).

Placement. ``server``: the server adds Z to the sum (``server_noise``; a trusted aggregator sees
the clipped updates). ``client``: each of the m clients adds N(0, σ²S²k²/m) on the support
(``privatize``), which sums to Z over a fixed-size cohort (secure aggregation, honest clients);
a server that sees each upload faces the per-client multiplier σ·k/√m. ``local``: each client
adds the whole N(0, σ²S²k²) to its own upload (DPSFL's Alg. 1: every upload is released as
is), so the sum carries √m times Z.

``between`` transforms act after the clip and before the noise; the sensitivity is the clip's
bound carried through their ``output_bound`` (a count sketch raises it: ``algorithms.sketch``).
A transform that claims a bound it does not have (``unaccounted_reason``, DPSFL's C√l) makes
the mechanism unaccounted, and so does a clip whose bound is each client's own (``Clip``'s
median rule, the DP-FedPGN authors' code: client i's noise std is σ·C_i·k/√m, C_i from its
data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, Protocol

import torch

from algorithms.layout import ParamLayout
from algorithms.sparsify import RandK
from algorithms.transforms import ClientContext, Clip, bind_all

Placement = Literal["server", "client", "local"]


class NoiseSupport(Protocol):
    public: ClassVar[bool]  # a function of (seed, round, layout) only, never of a client's data
    description: ClassVar[str]

    def mask(self, update: torch.Tensor, ctx: ClientContext) -> torch.Tensor | None:
        """0/1 mask of the coordinates client noise goes on (None: every coordinate)."""

    def public_mask(
        self, size: int, layout: ParamLayout | None, round_key: tuple[int, int]
    ) -> torch.Tensor | None:
        """The same mask for the server's noise; only public supports have one."""


@dataclass(frozen=True)
class DenseSupport:
    public: ClassVar[bool] = True
    description: ClassVar[str] = "every coordinate"

    def mask(self, update, ctx):
        return None

    def public_mask(self, size, layout, round_key):
        return None


DENSE = DenseSupport()


@dataclass(frozen=True)
class SharedMaskSupport:
    """The coordinates of the round's shared ``RandK`` mask (public: drawn from seed, round)."""

    randk: RandK
    public: ClassVar[bool] = True
    description: ClassVar[str] = "the round's shared random mask"

    def mask(self, update, ctx):
        if self.randk.fraction >= 1.0:
            return None
        mask = self.randk.shared_mask(update.numel(), ctx.layout, ctx.round_key, update.device)
        return mask.to(update.dtype)

    def public_mask(self, size, layout, round_key):
        if self.randk.fraction >= 1.0:
            return None
        return self.randk.shared_mask(size, layout, round_key, dtype=torch.float64)


@dataclass(frozen=True)
class UploadSupport:
    """The coordinates the client's own upload is non-zero on (data-dependent: unaccounted)."""

    public: ClassVar[bool] = False
    description: ClassVar[str] = "each client's own kept coordinates"

    def mask(self, update, ctx):
        return (update != 0).to(update.dtype)

    def public_mask(self, size, layout, round_key):
        raise ValueError("noise on each client's own support can only be added by the clients")


@dataclass(frozen=True)
class GaussianMechanism:
    """Clip → ``between`` (norm non-increasing, e.g. top-k) → Gaussian noise on ``support``.

    ``sum_noise_std`` = σ·S·k is the per-coordinate std of Z on the sum; the mean over a nominal
    cohort of m carries σ·S·k/m. ``accountable``/``unaccounted_reason`` say whether the
    accountants' analysis applies to what is released (the support must be public).
    """

    clip: Clip
    noise_multiplier: float
    placement: Placement = "server"
    noise_scale: float = 1.0
    support: NoiseSupport = DENSE
    between: tuple = ()

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ValueError(f"noise multiplier must be >= 0, got {self.noise_multiplier}")
        if self.noise_multiplier > 0 and math.isinf(self.clip.clip_norm):
            raise ValueError("Gaussian noise needs a bounded input: a finite clip norm")
        if self.placement == "server" and not self.support.public:
            raise ValueError(f"noise on {self.support.description} can only be client-placed")
        if self.placement == "server" and self.clip.rule == "median":
            raise ValueError(
                "median clipping scales each client's noise to its own C_i, which only the "
                "client knows: client- or local-placed noise"
            )

    def bind(self, layout: ParamLayout) -> GaussianMechanism:
        return replace(self, clip=self.clip.bind(layout), between=bind_all(self.between, layout))

    @property
    def sensitivity(self) -> float:
        """S: the L2 bound of one client's contribution to the sum."""
        bound = self.clip.output_bound(math.inf)
        for transform in self.between:
            bound = transform.output_bound(bound)
        return bound

    @property
    def sum_noise_std(self) -> float:
        """σ·S·k: per-coordinate std of the noise on the sum of the cohort's updates."""
        if self.noise_multiplier == 0:
            return 0.0
        return self.noise_multiplier * self.sensitivity * self.noise_scale

    @property
    def unaccounted_reason(self) -> str | None:
        for part in (self.clip, *self.between):
            if getattr(part, "unaccounted_reason", None):
                return part.unaccounted_reason
        if self.support.public:
            return None
        return (
            f"noise only on {self.support.description}: a coordinate kept by n of the m "
            "clients of a round carries noise std σS·√(n/m) < σS on the sum, and which "
            "coordinates carry noise depends on the clients' data"
        )

    def privatize(
        self, update: torch.Tensor, ctx: ClientContext, norm: float | None = None
    ) -> torch.Tensor:
        """One client's part: clip, ``between``, then its share of client-placed noise
        (``norm``: ‖update‖₂ if known, for the clip)."""
        update = self.clip.apply(update, ctx, norm)
        for transform in self.between:
            update = transform.apply(update, ctx)
        mask = self.support.mask(update, ctx)
        if mask is not None:
            update = update * mask  # nothing is released outside the support
        if self.placement == "server" or self.noise_multiplier == 0:
            return update
        std = self.client_noise_std(ctx)
        noise = torch.randn(
            update.shape, generator=ctx.noise_generator, device=update.device, dtype=update.dtype
        )
        if mask is not None:
            noise = noise * mask
        return update + std * noise

    def client_noise_std(self, ctx: ClientContext) -> float:
        """The per-coordinate std of one client's noise: its share σSk/√m of Z (``client``), or
        all of it (``local``). Under the median rule S is the client's own C_i (``Clip``), as
        in the DP-FedPGN authors' code: std σ·C_i·k/√m."""
        if self.clip.rule == "median":
            std = self.noise_multiplier * ctx.stats["client_clip_norm"] * self.noise_scale
        else:
            std = self.sum_noise_std
        if self.placement == "client":
            std /= math.sqrt(ctx.nominal_cohort_size)
        return std

    def server_noise(
        self,
        size: int,
        layout: ParamLayout | None,
        round_key: tuple[int, int],
        generator: torch.Generator,
    ) -> torch.Tensor | None:
        """Z for the sum (float64) when the server adds it; None under client placement."""
        if self.placement != "server" or self.noise_multiplier == 0:
            return None
        noise = self.sum_noise_std * torch.randn(size, generator=generator, dtype=torch.float64)
        mask = self.support.public_mask(size, layout, round_key)
        return noise if mask is None else noise * mask
