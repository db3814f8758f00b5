"""``Algorithm``: one named algorithm as its parts — a local trainer, a client update pipeline
(transforms, the privacy mechanism, uploads) and a server rule — with what follows from them
(privacy unit, the mechanism, whether an accountant's ε holds). The presets that build one are
in ``algorithms.presets``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from algorithms.adaptive_clip import AdaptiveClip
from algorithms.dpsgd import DpSgdGradient
from algorithms.fetchsgd import FetchSgdServerRule
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer
from algorithms.mechanism import (
    GaussianMechanism,
)
from algorithms.pipeline import UpdatePipeline
from algorithms.server import MeanServerRule, ServerContext, ServerState


@dataclass(frozen=True)
class Algorithm:
    name: str
    trainer: LocalTrainer
    pipeline: UpdatePipeline = field(default_factory=UpdatePipeline)
    server: MeanServerRule | FetchSgdServerRule = field(default_factory=MeanServerRule)
    control_variates: bool = False
    # DP-SCAFFOLD-warm: rounds that only compute c_i⁰ = (1/K) Σ_k H̃_i^k(x⁰) (None: cold)
    warm_start: Literal["paper", "authors_code"] | None = None
    # DPSFL-AC: C_t moves with the clients' noisy bits; the server keeps it in "clip_norm"
    adaptive_clip: AdaptiveClip | None = None
    # Driver rounds before the first training round (DP-SCAFFOLD-warm's c_i⁰ rounds)
    warmup_rounds: int = 0

    @property
    def sample_dp(self) -> DpSgdGradient | None:
        """The DP-SGD rule of a sample-level preset (None for every other preset)."""
        gradient = self.trainer.gradient
        return gradient if isinstance(gradient, DpSgdGradient) else None

    @property
    def privacy_unit(self) -> Literal["client", "sample", "none"]:
        if self.sample_dp is not None and self.sample_dp.noise_multiplier > 0:
            return "sample"
        return "client" if self.pipeline.noise_multiplier > 0 else "none"

    @property
    def unaccounted_reason(self) -> str | None:
        """Why no accountant's ε holds for what this algorithm releases (None: one does)."""
        own = self.pipeline if self.sample_dp is None else self.sample_dp
        return own.unaccounted_reason or getattr(self.server, "unaccounted_reason", None)

    @property
    def mechanism(self) -> GaussianMechanism | None:
        return self.pipeline.mechanism

    def training_round(self, round_index: int) -> int:
        """t = max(r − W, 0): the training round of driver round r (from 0) after W warm-up
        rounds (0 during the warm-up). The one index the lr decay reads, on the driver and in
        every client (both call ``at_round`` with the driver's round r)."""
        return max(round_index - self.warmup_rounds, 0)

    def at_round(self, round_index: int) -> Algorithm:
        """Driver round ``round_index``'s algorithm: the trainer's lr decayed for training round
        t = ``training_round(round_index)``, η_t = η·lr_decay^t (``LocalTrainer.at_round``).

        A server scale tied to the local lr (PGN's γ = η·K) follows the decayed η_t.
        """
        trainer = self.trainer.at_round(self.training_round(round_index))
        if trainer is self.trainer:
            return self
        server = self.server.with_local_lr_factor(trainer.lr / self.trainer.lr)
        return replace(self, trainer=trainer, server=server)

    def bind(self, layout: ParamLayout) -> Algorithm:
        """Resolve layout-dependent parts (per-layer clipping, sketch size) for a model."""
        server = self.server.bind(layout) if hasattr(self.server, "bind") else self.server
        return replace(self, pipeline=self.pipeline.bind(layout), server=server)

    def initial_extras(self, params) -> dict:
        """The server state at round 0 beyond the model (what ``server_step`` evolves)."""
        extras = self.server.initial_extras(params)
        if self.control_variates:
            extras["control"] = torch.zeros_like(params)
        if self.warm_start == "authors_code":  # every client's c_i⁰ is taken at x⁰
            extras["warm_start_point"] = params.clone()
        if self.adaptive_clip is not None:
            extras["clip_norm"] = torch.tensor([self.mechanism.clip.clip_norm], dtype=torch.float64)
        return extras

    def client_state_widths(self, params) -> dict[str, int]:
        """What each client keeps between rounds (``client_round``'s state): its name → how
        many values (SCAFFOLD's c_i, one per parameter)."""
        return {"control": params.numel()} if self.control_variates else {}

    def with_state(self, extras: dict) -> Algorithm:
        """The round's algorithm under the server state (or broadcast) ``extras``: the
        adaptive clip norm C_t, when there is one, bounds the clip and sizes the noise."""
        if self.adaptive_clip is None:
            return self
        mechanism = self.mechanism
        clip = replace(mechanism.clip, clip_norm=float(extras["clip_norm"][0]))
        pipeline = replace(self.pipeline, mechanism=replace(mechanism, clip=clip))
        return replace(self, pipeline=pipeline)

    def server_step(self, state: ServerState, total, ctx: ServerContext) -> ServerState:
        """The server rule's step, then C_{t+1} from the round's noisy bits (DPSFL-AC)."""
        new = self.server.step(state, total, ctx, self.control_variates)
        if self.adaptive_clip is not None:
            count = total.sums.get("clip_bit", torch.zeros(1, dtype=torch.float64))
            clip_norm = self.adaptive_clip.next_clip_norm(
                float(state.extras["clip_norm"][0]),
                float(count[0]) + ctx.noise_on_count,
                ctx.nominal_cohort_size,
            )
            new.extras["clip_norm"] = torch.tensor([clip_norm], dtype=torch.float64)
        return new
