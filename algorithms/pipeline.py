"""A client's update pipeline: transforms before the mechanism, the mechanism, post-processing.

``before`` (e.g. LUS, Fed-SMP's top-k, a shared rand-k mask, DP-FedPGN's drift removal) shapes
the raw delta; the ``GaussianMechanism`` clips it and adds the client's share of the noise;
``after`` (e.g. DP-FedPGN's drift, added back) post-processes what the client uploads.

Whether the accountants' ε applies is decided here, from the parts (never from a preset's
name): the mechanism's noise support must be public, and under client-placed noise nothing
after the noise may select coordinates by value (a top-k of a client's noisy update makes the
sum's noise depend on the clients' data: DP-FedSAM Eq. 12 read literally).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from algorithms.layout import ParamLayout
from algorithms.mechanism import GaussianMechanism
from algorithms.transforms import ClientContext, bind_all


@dataclass(frozen=True)
class UpdatePipeline:
    before: tuple = ()
    mechanism: GaussianMechanism | None = None
    after: tuple = ()

    def bind(self, layout: ParamLayout) -> UpdatePipeline:
        """The pipeline with layout-dependent parts (per-layer clipping) resolved."""
        mechanism = None if self.mechanism is None else self.mechanism.bind(layout)
        return UpdatePipeline(
            bind_all(self.before, layout), mechanism, bind_all(self.after, layout)
        )

    def __call__(
        self, update: torch.Tensor, ctx: ClientContext, norm: float | None = None
    ) -> torch.Tensor:
        """``norm``: ‖update‖₂ where the caller computed it already (the client's finiteness
        check); the clip reads it only when no transform runs before the mechanism, i.e. when
        its input is this very ``update``."""
        for transform in self.before:
            update = transform.apply(update, ctx)
        if self.mechanism is not None:
            update = self.mechanism.privatize(update, ctx, None if self.before else norm)
        for transform in self.after:
            update = transform.apply(update, ctx)
        return update

    @property
    def owes_noise_share(self) -> bool:
        """Each client adds a share of the sum's noise (client placement, σ > 0): a dropped
        client must still upload it. Server-placed noise does not depend on who uploads, and
        local noise comes whole with each upload."""
        m = self.mechanism
        return m is not None and m.placement == "client" and m.noise_multiplier > 0

    def noise_share(self, like: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        """What a client whose update is dropped (not finite) still uploads: its share of
        client-placed noise on a zero update, so that the sum carries the noise the round is
        charged for (the m shares of N(0, σ²S²k²/m) make up Z; without it, (m − 1)/m of it).
        Only under ``owes_noise_share``. Under the median clip (unaccounted) a zero update's
        C_i is 0, so a dropped client adds no noise, as the authors' code would."""
        update = self.mechanism.privatize(torch.zeros_like(like), ctx)
        for transform in self.after:
            update = transform.apply(update, ctx)
        return update

    @property
    def upload_name(self) -> str:
        """What a client uploads: ``sketch`` when a transform sketches it, else ``delta``."""
        between = () if self.mechanism is None else self.mechanism.between
        names = [getattr(t, "upload_name", None) for t in (*between, *self.after)]
        return next((n for n in names if n is not None), "delta")

    @property
    def noise_multiplier(self) -> float:
        """σ of the mechanism (0 without one)."""
        return 0.0 if self.mechanism is None else self.mechanism.noise_multiplier

    @property
    def sensitivity(self) -> float:
        """L2 bound of one client's contribution (before noise); inf without a mechanism."""
        return math.inf if self.mechanism is None else self.mechanism.sensitivity

    @property
    def unaccounted_reason(self) -> str | None:
        """Why no accountant's ε holds for what this pipeline releases (None: it does)."""
        if self.mechanism is None:
            return None
        reason = self.mechanism.unaccounted_reason
        if reason is None and self.mechanism.placement == "client":
            selecting = [t for t in self.after if t.selects_by_value]
            if selecting:
                reason = (
                    f"{type(selecting[0]).__name__} after each client's noise: which noisy "
                    "coordinates reach the sum depends on the clients' data, so the sum's noise "
                    "is not N(0, σ²S²) on every coordinate"
                )
        return reason

    def server_noise(
        self,
        size: int,
        layout: ParamLayout | None,
        round_key: tuple[int, int],
        generator: torch.Generator,
    ) -> torch.Tensor | None:
        """The noise the server adds to the sum (None: none, or the clients add it)."""
        if self.mechanism is None:
            return None
        return self.mechanism.server_noise(size, layout, round_key, generator)
