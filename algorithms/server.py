"""Server rules: turn the round's summed uploads into the next global state.

``MeanServerRule`` (FedAvg / DP-FedAvg, McMahan et al. 2018)::

    Δ̄ = (Σ_{i∈S} Δ_i + Z) / m        Z = the mechanism's server-placed noise on the sum (σS)
    x ← x + η_g Δ̄

With uniform weighting m is the *nominal* cohort size (the fixed size, or qN under Poisson
sampling), not the realised count: a data-independent denominator keeps the sensitivity of Δ̄ at
C/m. Sample-count weighting (non-private only) divides Σ n_i Δ_i by Σ n_i.
``denominator="realised"`` divides by the number of uploads ``|P_t|`` instead (BLUR+LUS's Alg. 1):
no ε holds for it (``unaccounted_reason``): ``|P_t|`` is released without noise — under Poisson
sampling it changes with one client's participation, and with any cohort when a client's update
is dropped — and the noise in Δ̄, σS/``|P_t|``, reveals it.

Options, all post-processing of the noisy mean Δ̄ (no privacy cost):

- ``smoothing``: Laplacian smoothing Δ̄ ← A_σ⁻¹Δ̄ (DP-FedAvg-LS, DP-FedPGN-LS), or the
  DP-FedPGN authors' one-step stencil (``LaplacianStencil``, which leaves g̃ unsmoothed);
- ``momentum`` μ: server momentum v ← μ·v + Δ̄, x ← x + η_g·v (v kept in the state);
- ``direction_scale`` ηK: DP-FedPGN's pseudo-gradient g̃ = −Δ̄/(ηK), kept in the state and
  broadcast to the next round's clients (with γ = ηK, x − γ·g̃ = x + Δ̄);
- ``drift_beta`` β: DP-FedPGN's public drift, stripped from each upload by the clients
  (``algorithms.pgn``), added back once: Δ̄ ← Δ̄ − (1 − β)·ηK·g̃.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import torch

from algorithms.aggregate import PartialAggregate
from algorithms.control_variates import updated_server_control
from algorithms.pgn import public_drift
from algorithms.smoothing import LaplacianSmoothing, LaplacianStencil


@dataclass(frozen=True)
class ServerContext:
    nominal_cohort_size: float
    num_clients: int
    # Z, drawn by the preset's GaussianMechanism (None: client-placed noise, or none at all)
    noise_on_sum: torch.Tensor | None = None
    # Server-placed noise on the adaptive clip's count Σ(b_i − ½) (0: none, or the clients')
    noise_on_count: float = 0.0


@dataclass
class ServerState:
    """The global model plus algorithm state the server keeps and broadcasts (e.g. SCAFFOLD c)."""

    params: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class MeanServerRule:
    server_lr: float = 1.0
    weighting: Literal["uniform", "samples"] = "uniform"
    smoothing: LaplacianSmoothing | LaplacianStencil | None = None
    momentum: float = 0.0
    direction_scale: float | None = None
    drift_beta: float | None = None
    denominator: Literal["nominal", "realised"] = "nominal"
    server_only: ClassVar[frozenset[str]] = frozenset({"momentum"})  # state never broadcast
    sparse_broadcast: ClassVar[bool] = False  # clients need the whole model

    def bind(self, layout) -> MeanServerRule:
        """The rule with per-tensor smoothing resolved to the model's tensors."""
        if self.smoothing is None:
            return self
        return replace(self, smoothing=self.smoothing.bind(layout))

    def with_local_lr_factor(self, factor: float) -> MeanServerRule:
        """The rule for a round whose local lr is ``factor`` × the base lr: γ = η·K follows it."""
        if self.direction_scale is None:
            return self
        return replace(self, direction_scale=self.direction_scale * factor)

    def initial_extras(self, params: torch.Tensor) -> dict[str, torch.Tensor]:
        """Server state this rule keeps and broadcasts, at round 0."""
        extras = {}
        if self.momentum:
            extras["momentum"] = torch.zeros_like(params)
        if self.direction_scale is not None:
            extras["direction"] = torch.zeros_like(params)
        return extras

    def noisy_mean(self, total: PartialAggregate, size: int, ctx: ServerContext) -> torch.Tensor:
        summed = total.sums.get("delta")
        if summed is None:  # empty cohort: the noise is still due
            summed = torch.zeros(size, dtype=torch.float64)
        # One new d-vector, divided in place: at the server every pass over d float64s counts.
        mean = summed.clone() if ctx.noise_on_sum is None else summed + ctx.noise_on_sum
        if self.weighting == "samples":
            return mean.div_(max(total.weight, 1.0))
        if self.denominator == "realised":
            return mean.div_(max(total.count, 1))
        return mean.div_(ctx.nominal_cohort_size)

    @property
    def unaccounted_reason(self) -> str | None:
        """Why no ε holds for the mean this rule releases (None: the mechanism's ε does)."""
        if self.denominator != "realised":
            return None
        return (
            "the noisy sum is divided by the realised cohort size |P_t|, a count released "
            "without noise (it changes with one client's participation under Poisson sampling, "
            "or with a dropped update)"
        )

    def step(
        self, state: ServerState, total: PartialAggregate, ctx: ServerContext, control: bool
    ) -> ServerState:
        mean = self.noisy_mean(total, state.params.numel(), ctx)
        if self.drift_beta is not None:
            drift = public_drift(self.drift_beta, self.direction_scale, state.extras["direction"])
            mean = mean if drift is None else mean - drift.double()
        unsmoothed = mean  # g̃'s source where the smoothing leaves g̃ alone (the stencil)
        if self.smoothing is not None:
            mean = self.smoothing(mean)
        extras = dict(state.extras)
        step = mean
        if self.momentum:
            step = self.momentum * state.extras["momentum"].double() + mean
            extras["momentum"] = step.to(state.params.dtype)
        if self.direction_scale is not None:
            source = mean if getattr(self.smoothing, "smooths_direction", True) else unsmoothed
            extras["direction"] = (-source / self.direction_scale).to(state.params.dtype)
        params = state.params.to(torch.float64, copy=True).add_(step, alpha=self.server_lr)
        params = params.to(state.params.dtype)
        new = ServerState(params, extras)
        return self.control_step(new, total, ctx) if control else new

    def control_step(
        self, state: ServerState, total: PartialAggregate, ctx: ServerContext
    ) -> ServerState:
        """c ← c + (1/N) Σ Δc_i, x unchanged (also DP-SCAFFOLD-warm's warm-up rounds)."""
        if "control" not in total.sums:
            return state
        control = updated_server_control(
            state.extras["control"],
            total.sums["control"].to(state.params.dtype),
            ctx.num_clients,
        )
        return ServerState(state.params, {**state.extras, "control": control})
