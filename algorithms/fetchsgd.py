"""FetchSGD's server rule (Rothchild et al. 2020; DPSFL's Alg. 2): momentum and error feedback in
sketch space, top-k unsketch, a sparse Δ broadcast.

Each client uploads the count sketch of its (clipped, possibly noised) one-batch update
u_i = −g_i (``algorithms.sketch.SketchUpload``); actors sum their clients' sketches before
anything crosses the wire (the sum of sketches is the sketch of the sum). With m the nominal
cohort size, β the momentum and η the server lr, round t::

    S    = (Σ_i S(u_i) + S(Z)) / m      Z: server-placed Gaussian noise on the dense sum, if any
    S_u ← β·S_u + S
    S_e ← S_e + η·S_u
    Δ    = Top-k(U(S_e))                 U: median estimate of every coordinate
    T    = {(j, h_j(i)) : i ∈ supp(Δ), j < l}   the counters Δ's coordinates hash to
    feedback "zero_error":               S_e[T] ← 0
    feedback "zero_error_and_momentum":  S_e[T] ← 0 and S_u[T] ← 0
    feedback "subtract":                 S_e ← S_e − S(Δ)
    w   ← w + Δ                          (u = −g: the paper's w − Δ on gradients)

``zero_error`` (default) is what FetchSGD's reference code runs (kiddyboots216/CommEfficient,
``_server_helper_sketched``): it zeroes S_e on the nonzero counters of S(Δ) (here on all of
T: the same unless Δ's values cancel exactly in a counter) instead of subtracting S(Δ), because
with subtraction the model diverges (the authors' comment; measured here too: MNIST CNN at 96%
by round 110, 9% at round 150, ``configs/cpu/sketch.yaml``). Its momentum line,
``Vvelocity[nz[:, 0], nz[:, 1]].zero_()``, zeroes the copy that advanced indexing returns and
leaves S_u as it was; DPSFL's Alg. 2 zeroes no momentum either (spec 002).
``zero_error_and_momentum`` zeroes S_u on T as well, what that line was meant to do (this
simulator's default before; on one seed of ``configs/cpu/sketch.yaml`` it cost FetchSGD
97.10 → 95.75% and DPSFL 86.50 → 79.10% final accuracy). ``subtract`` is error feedback as
both papers write it (FetchSGD's Alg. 1, DPSFL's Alg. 2). There is no second communication
round. S_u and S_e stay on the server (``server_only``: never broadcast); clients need only the
sparse Δ, 2k words (``sparse_broadcast``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch

from algorithms.aggregate import PartialAggregate
from algorithms.server import ServerContext, ServerState
from algorithms.sketch import CountSketch, SketchUpload

SketchFeedback = Literal["zero_error", "zero_error_and_momentum", "subtract"]
SKETCH_FEEDBACKS: tuple[SketchFeedback, ...] = ("zero_error", "zero_error_and_momentum", "subtract")


@dataclass(frozen=True)
class FetchSgdServerRule:
    upload: SketchUpload
    top_k: int = 50_000
    momentum: float = 0.9
    server_lr: float = 1.0
    feedback: SketchFeedback = "zero_error"
    weighting: Literal["uniform"] = "uniform"
    server_only: ClassVar[frozenset[str]] = frozenset({"sketch_momentum", "sketch_error"})
    sparse_broadcast: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"sketch momentum β must be in [0, 1), got {self.momentum}")
        if self.feedback not in SKETCH_FEEDBACKS:
            raise ValueError(f"feedback must be one of {SKETCH_FEEDBACKS}, got {self.feedback!r}")

    def bind(self, layout) -> FetchSgdServerRule:
        return replace(self, upload=self.upload.bind(layout))

    def with_local_lr_factor(self, factor: float) -> FetchSgdServerRule:
        return self

    def count_sketch(self, dim: int) -> CountSketch:
        return self.upload.count_sketch(dim)

    def initial_extras(self, params: torch.Tensor) -> dict[str, torch.Tensor]:
        sketch = self.count_sketch(params.numel())
        return {
            "sketch_momentum": sketch.zeros(torch.float64),
            "sketch_error": sketch.zeros(torch.float64),
        }

    def noisy_sketch_sum(self, total: PartialAggregate, dim: int, ctx: ServerContext):
        """Σ_i S(u_i) + S(Z): the round's release, as an l × m table (float64)."""
        sketch = self.count_sketch(dim)
        summed = total.sums.get("sketch")
        table = sketch.zeros(torch.float64) if summed is None else summed.view_as(sketch.zeros())
        table = table.clone()
        if ctx.noise_on_sum is not None:
            sketch.accumulate(table, ctx.noise_on_sum.double())
        return table

    def step(
        self, state: ServerState, total: PartialAggregate, ctx: ServerContext, control: bool
    ) -> ServerState:
        if control:
            raise ValueError("FetchSGD keeps no control variates")
        dim = state.params.numel()
        sketch = self.count_sketch(dim)
        mean = self.noisy_sketch_sum(total, dim, ctx) / ctx.nominal_cohort_size
        momentum = self.momentum * state.extras["sketch_momentum"] + mean
        error = state.extras["sketch_error"] + self.server_lr * momentum
        indices, values = sketch.top_k(error, self.top_k)
        if self.feedback == "subtract":
            sketch.accumulate(error, -values, indices)
        else:
            touched = sketch.counters_of(indices, error.device)
            error[touched] = 0.0
            if self.feedback == "zero_error_and_momentum":
                momentum[touched] = 0.0
        params = state.params.double()
        params[indices] += values
        extras = {**state.extras, "sketch_momentum": momentum, "sketch_error": error}
        return ServerState(params.to(state.params.dtype), extras)
