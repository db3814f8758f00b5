"""Sample-level DP-SGD as a local gradient rule (DP-SCAFFOLD, DP-FedAvg at sample level).

Per step, on a mini-batch of B records (spec 004, Alg. 1 line 9; Abadi et al. 2016):

    g_j = ∇ℓ(w; x_j, y_j)                         per example, torch.func (vmap)
    ḡ_j = g_j · min(1, C/‖g_j‖₂)                  ``scope="flat"``: L2 bound C
    ḡ_j,l = g_j,l · min(1, C/‖g_j,l‖₂) per tensor ``scope="layer"``: L2 bound C·√L
    G = (Σ_j ḡ_j + N(0, (κ·S·σ_g)² I)) / B        S = C or C·√L

κ = 2 for replace-one adjacency (the paper's noise std 2Cσ_g/(sR) on the mean, sR = B: one
record swapped for another moves the clipped sum by up to 2S) and κ = 1 for add/remove. The
noise comes from the client's own seeded stream (``Purpose.SAMPLE_NOISE``), drawn in blocks
of R = ``noise_block_rows(d, K)`` = max(1, min(K, ``NOISE_BLOCK_FLOATS`` // d)) rows of
N(0, I_d), in order, as the steps reach them (``noise_block``): step k adds row k mod R of
block ⌊k/R⌋ (the last block has min(R, K − jR) rows), times its std. R depends on d and K
only (never on the device, the chunk or the host), so a client holds at most R·d noise floats
(16 MiB). Wherever K·d ≤ ``NOISE_BLOCK_FLOATS`` (every sample-level config in configs/: the
logistic regressions and the MLP, the largest FEMNIST's K·d = 50 × 48,670), R = K and the
round's noise is the one [K, d] draw it was before blocks, bit for bit.
One draw of K·d normals is not K draws of d (a generator fills a tensor in blocks), so this one
definition is shared by the sequential path (``for_round``), the clients-vectorised path
(``algorithms.vectorized``) and workload S's plain loop (``benchmarks.workload_s``), which
thereby add the same noise to the same client's steps.

``simulation_noise_factor`` f (default 1) multiplies that noise for a simulation of a larger
deployment (``privacy.noise_cohort_size`` C_n): f = √(m/C_n) makes the mean of the m simulated
clients' noise have the variance of the C_n deployment clients' mean, (κSσ_g/B)²/C_n per
coordinate and step. σ_g, the deployment client's multiplier, stays the accounted one.
Models with BatchNorm are refused: it mixes the records of a batch, so a per-example gradient
(and its clipping bound) does not exist.

``clip_rule="median"`` is the DP-SCAFFOLD authors' heuristic (spec 004 §1 f): every step, each
tensor's C_l is the median of the batch's per-example norms of that tensor, and its noise std is
κ·C_l·σ_g. The noise scale then depends on the batch's data, so no accountant's ε holds:
``unaccounted_reason`` says so and runs using it report none.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from algorithms.norms import l2_norms

Adjacency = Literal["replace_one", "add_remove"]


def refuse_batchnorm(model: nn.Module) -> None:
    """ValueError naming the first BatchNorm layer: per-example gradients need none."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"sample-level DP needs per-example gradients, but layer {name!r} is "
                f"{type(module).__name__}, which mixes the records of a batch; use a model with "
                "GroupNorm (every model in models/ has one)"
            )


# Below this many parameters the vmapped-forward path wins (vmap(grad)'s per-op batching
# overhead dominates small models on CPU: logreg 0.6 vs 1.2 ms per batch of 160); above it
# vmap(grad) is as fast or faster (MNIST CNN). benchmarks/per_example measures both.
EXPANDED_MAX_PARAMS = 100_000


def auto_method(objective) -> str:
    """The path ``per_example_gradients`` takes for ``objective`` under ``auto`` (below);
    ``own`` for an objective with its own ``per_example_gradients``."""
    if getattr(objective, "per_example_gradients", None) is not None:
        return "own"
    if _linear_owners(objective.model, tuple(objective.layout.names)) is not None:
        return "linear"
    return "expanded" if objective.layout.size <= EXPANDED_MAX_PARAMS else "vmap_grad"


def per_example_gradients(
    objective, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, method: str = "auto"
):
    """(mean loss, logits, B × d matrix of per-example gradients of the cross-entropy at flat).

    Three paths on ``functional_call``, equal to float rounding:

    - ``vmap_grad``: ``vmap(grad(ℓ(θ; x_j, y_j)))`` over the batch, θ shared (torch.func);
    - ``expanded``: θ expanded to B per-example copies (views, no memory), the forward
      ``vmap(functional_call)`` over (θ_j, x_j), one autograd pass of Σ_j ℓ_j: ∂/∂θ_j is
      example j's gradient, since ℓ_j depends on θ_j only;
    - ``linear``: for models whose parameters all sit in ``nn.Linear`` layers, each called once
      (logistic regression, MLPs): one batched forward and one backward of Σ_j ℓ_j to each
      layer's output z; example j's gradient is g_j = ∂ℓ_j/∂z_j, W: g_j a_jᵀ, b: g_j (a_j the
      layer's input), since z_j depends on example j only.

    ``auto``: ``linear`` where it applies, else ``expanded`` below ``EXPANDED_MAX_PARAMS``
    parameters, else ``vmap_grad``. An objective with its own ``per_example_gradients``
    (crafted gradients: ``privacy.audit_sample``) is used as is.
    """
    own = getattr(objective, "per_example_gradients", None)
    if own is not None:
        return own(flat, x, y)
    layout, model = objective.layout, objective.model
    params = layout.unflatten(flat.detach())
    if method == "auto":
        method = auto_method(objective)
    objective.grad_evals += 1
    if method == "linear":
        linears = _linear_owners(model, tuple(layout.names))  # once per model: every step asks
        if linears is None:
            raise ValueError("method linear needs every parameter in an nn.Linear layer")
        logits, grads = _linear_outer_products(objective, flat, linears, x, y)
    elif method == "expanded":
        logits, grads = _expanded(model, params, x, y)
    else:
        logits, grads = _vmap_grad(model, params, x, y)
    matrix = torch.cat([grads[name].reshape(len(y), -1) for name in layout.names], dim=1)
    return nn.functional.cross_entropy(logits, y), logits, matrix


def _per_model(function):
    """``function(model, *args)`` cached for as long as ``model`` lives. An ``lru_cache`` keyed
    by the module would keep the models it saw alive (a warm actor's earlier runs' models)."""
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(function)
    def cached(model: nn.Module, *args):
        answers = cache.setdefault(model, {})
        if args not in answers:
            answers[args] = function(model, *args)
        return answers[args]

    return cached


@_per_model
def _randomness(model: nn.Module) -> str:
    """Dropout needs independent masks per example; without it, vmap skips that machinery."""
    random = any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())
    return "different" if random else "error"


def _vmap_grad(model, params, x, y):
    def example_loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0)), out.squeeze(0)

    grads, logits = vmap(
        grad(example_loss, has_aux=True), in_dims=(None, 0, 0), randomness=_randomness(model)
    )(params, x, y)
    return logits, grads


def _expanded(model, params, x, y):
    copies = {
        name: value.unsqueeze(0).expand(len(y), *value.shape).requires_grad_()
        for name, value in params.items()
    }

    def forward(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).squeeze(0)

    with torch.enable_grad():
        logits = vmap(forward, randomness=_randomness(model))(copies, x)
        total = nn.functional.cross_entropy(logits, y, reduction="sum")
        values = torch.autograd.grad(total, list(copies.values()))
    return logits.detach(), dict(zip(copies, values, strict=True))


@_per_model
def _linear_owners(model: nn.Module, names: tuple[str, ...]) -> dict[str, nn.Linear] | None:
    """Module name → ``nn.Linear`` if every parameter is a Linear's weight or bias, else None."""
    modules = dict(model.named_modules())
    owners = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        if not isinstance(module, nn.Linear) or leaf not in ("weight", "bias"):
            return None
        owners[owner] = module
    return owners


def _linear_outer_products(objective, flat, linears: dict[str, nn.Linear], x, y):
    """The forward through ``objective.logits`` (its parameter slots, not ``functional_call``'s
    walk of the module tree: ≈ 20 % of a sequential DP-SGD step of workload S's model)."""
    seen: dict[str, list] = {name: [] for name in linears}

    def capture(name):
        return lambda module, inputs, output: seen[name].append((inputs[0], output))

    handles = [m.register_forward_hook(capture(n)) for n, m in linears.items()]
    try:
        with torch.enable_grad():
            logits = objective.logits(flat.detach().requires_grad_(), x)  # z gets a graph
            total = nn.functional.cross_entropy(logits, y, reduction="sum")
            if any(len(calls) != 1 for calls in seen.values()):
                raise ValueError("method linear needs each Linear layer called exactly once")
            outputs = torch.autograd.grad(total, [calls[0][1] for calls in seen.values()])
    finally:
        for handle in handles:
            handle.remove()
    grads = {}
    for (name, module), g in zip(linears.items(), outputs, strict=True):
        a = seen[name][0][0].detach()
        g = g.reshape(len(y), -1, g.shape[-1])  # (B, positions, out)
        a = a.reshape(len(y), -1, a.shape[-1])  # (B, positions, in)
        grads[f"{name}.weight"] = torch.einsum("bko,bki->boi", g, a)
        if module.bias is not None:
            grads[f"{name}.bias"] = g.sum(1)
    return logits.detach(), grads


def finite_segments(
    per_example: torch.Tensor, offsets: tuple[int, ...] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The segments of the per-example rows (the last axis whole, or split at ``offsets``: one
    per tensor) and each one's row L2 norms [..., 1], with every NaN or ±inf coordinate set to
    0 first (a record's non-finite features, or a backward that overflowed). Each record's row
    is then finite and clipped to C like any other; left as it was, one such record would make
    its client's clipped sum, hence its whole update, non-finite, and the client's upload
    would be dropped (``algorithms.client``): one record deciding whether its client's output
    is released. (A finite row longer than ``algorithms.norms.SHORT`` whose float32 norm
    overflows gets clip factor C/∞ = 0; the norms are upper bounds, ``algorithms.norms``.)

    On the CPU the norms, needed anyway, tell whether there is any such coordinate: the usual
    case costs nothing more. On a GPU the test would stall the host every step; the
    replacement is one kernel, in place (the per-example gradients are made anew each step
    and read only here: a copy would double their peak memory)."""
    on_cpu = per_example.device.type == "cpu"
    if not on_cpu:
        per_example = per_example.nan_to_num_(0.0, 0.0, 0.0)
    parts, norms = _split_with_norms(per_example, offsets)
    if on_cpu and not bool(torch.isfinite(torch.cat([n.flatten() for n in norms])).all()):
        parts, norms = _split_with_norms(per_example.nan_to_num(0.0, 0.0, 0.0), offsets)
    return parts, norms


def _split_with_norms(per_example: torch.Tensor, offsets: tuple[int, ...] | None):
    if offsets is None:
        parts = [per_example]
    else:
        sizes = [stop - start for start, stop in zip(offsets[:-1], offsets[1:], strict=True)]
        parts = list(per_example.split(sizes, dim=-1))
    return parts, [l2_norms(p)[..., None] for p in parts]


def clip_factor(norms: torch.Tensor, clip_norm: float, dtype: torch.dtype) -> torch.Tensor:
    """min(1, C/‖row‖₂) of rows of these (float64) norms, in the rows' ``dtype``: the factor
    that clips the row to L2 norm C (a zero row keeps factor 1)."""
    return (clip_norm / norms).clamp(max=1.0).to(dtype)


def clipped_sum(
    per_example: torch.Tensor, clip_norm: float, offsets: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Σ_j of the [B, d] per-example rows clipped to L2 norm C: whole rows, or each (start,
    stop) segment of ``offsets`` separately (per-tensor clipping); non-finite coordinates 0
    (``finite_segments``)."""
    parts, norms = finite_segments(per_example, offsets)
    return torch.cat(
        [(p * clip_factor(n, clip_norm, p.dtype)).sum(0) for p, n in zip(parts, norms, strict=True)]
    )


def clipped_sums(
    per_example: torch.Tensor,
    weights: torch.Tensor,
    clip_norm: float,
    offsets: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``clipped_sum`` for m clients at once: [m, d] rows Σ_j w_ij·clip(g_ij) of the [m, B, d]
    per-example gradients, each row clipped to C (or each segment, per tensor) as
    ``clipped_sum`` clips it, weighted by the [m, B] ``weights`` (1 a client's record, 0 a
    padded one); one batched product per segment."""
    parts, norms = finite_segments(per_example, offsets)
    return torch.cat(
        [
            torch.einsum("mb,mbd->md", clip_factor(n, clip_norm, p.dtype)[..., 0] * weights, p)
            for p, n in zip(parts, norms, strict=True)
        ],
        dim=-1,
    )


def median_clipped_sum(
    per_example: torch.Tensor, offsets: tuple[int, ...] | None, rule: DpSgdGradient
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """The authors' heuristic: clip each segment to C_l = median of its per-example norms;
    returns (clipped sum, per-coordinate noise std κ·C_l·σ_g)."""
    sums, stds = [], []
    for part, norms in zip(*finite_segments(per_example, offsets), strict=True):
        clip = norms.median()
        factor = (clip / norms).nan_to_num(1.0).clamp(max=1.0).to(part.dtype)
        sums.append((part * factor).sum(0))
        stds.append(torch.full((part.shape[-1],), float(rule.kappa * clip * rule.step_multiplier)))
    return torch.cat(sums), torch.cat(stds).to(per_example.device, per_example.dtype)


@dataclass(frozen=True)
class DpSgdGradient:
    """G = (clipped per-example sum + N(0, (κSσ_g)²)) / B; one per-example pass per step."""

    clip_norm: float
    noise_multiplier: float
    scope: Literal["flat", "layer"] = "flat"
    adjacency: Adjacency = "replace_one"
    clip_rule: Literal["fixed", "median"] = "fixed"
    simulation_noise_factor: float = 1.0  # f: √(m/C_n) under a noise cohort (module docstring)

    def __post_init__(self) -> None:
        if self.clip_rule not in ("fixed", "median"):
            raise ValueError(f"clip_rule must be fixed or median, got {self.clip_rule!r}")
        factor = self.simulation_noise_factor
        if not 0 < factor < math.inf:
            raise ValueError(f"simulation_noise_factor must be finite and > 0, got {factor}")
        if self.noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if self.clip_rule == "median":
            return
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {self.clip_norm}")
        if self.noise_multiplier > 0 and math.isinf(self.clip_norm):
            raise ValueError("per-step noise needs a finite clip norm")

    @property
    def unaccounted_reason(self) -> str | None:
        if self.clip_rule == "median" and self.noise_multiplier > 0:
            return (
                "clip_rule median: each step's C is the median of the batch's per-example "
                "gradient norms, so the noise scale depends on the data (DP-SCAFFOLD's code)"
            )
        return None

    @property
    def kappa(self) -> float:
        """2 for replace-one adjacency (a swapped record moves the sum by up to 2S), else 1."""
        return 2.0 if self.adjacency == "replace_one" else 1.0

    def sensitivity(self, num_tensors: int) -> float:
        """S: the L2 bound of one record's clipped gradient."""
        return self.clip_norm * (math.sqrt(num_tensors) if self.scope == "layer" else 1.0)

    @property
    def step_multiplier(self) -> float:
        """f·σ_g: the multiplier of the noise this client adds (σ_g without a noise cohort)."""
        return self.simulation_noise_factor * self.noise_multiplier

    def noise_std_on_sum(self, num_tensors: int) -> float:
        """κ·S·f·σ_g: per-coordinate std of the noise on the clipped sum (κ = 2 replace-one)."""
        return self.kappa * self.sensitivity(num_tensors) * self.step_multiplier

    def for_round(
        self,
        payload=None,
        noise_stream: Callable[[], torch.Generator] | None = None,
        batch_size: int | None = None,
        steps: int | None = None,
    ):
        """The rule for one client's round of ``steps`` steps: its noise stream (made once,
        here) and B, the expected batch size the noisy sum is divided by (the drawn size under
        Poisson sampling would depend on the data; None: the drawn size). The noise blocks
        (``noise_block``) are drawn as the steps reach them, when d is known."""
        if self.noise_multiplier == 0:
            return _DpSgdRound(self, None, batch_size, steps)
        if noise_stream is None:
            raise ValueError("DP-SGD needs the client's noise stream for the round")
        if steps is None:
            raise ValueError("DP-SGD needs the round's step count K to block its noise")
        return _DpSgdRound(self, noise_stream(), batch_size, steps)


NOISE_BLOCK_FLOATS = 2**22  # 16 MiB of float32: the most DP-SGD noise a client holds at once


def noise_block_rows(dim: int, steps: int) -> int:
    """R = max(1, min(K, ``NOISE_BLOCK_FLOATS`` // d)): the rows of a client's noise block for
    K steps of a d-parameter model (module docstring); a function of d and K alone."""
    return max(1, min(steps, NOISE_BLOCK_FLOATS // dim))


def noise_block(
    generator: torch.Generator, steps: int, dim: int, first: int, like: torch.Tensor
) -> torch.Tensor:
    """The block of a client's round of DP-SGD step noise that starts at step ``first`` (a
    multiple of R = ``noise_block_rows(d, K)``): min(R, K − first) rows of N(0, I_d) drawn in
    one call from its ``SAMPLE_NOISE`` stream, on ``like``'s device and dtype, the blocks
    before it drawn already; its row r is step first + r's noise before scaling by its std.
    The one definition the sequential and the vectorised paths use."""
    if first % noise_block_rows(dim, steps) or not 0 <= first < steps:
        raise ValueError(f"no noise block starts at step {first} of {steps} (d = {dim})")
    rows = min(noise_block_rows(dim, steps), steps - first)
    return torch.randn((rows, dim), generator=generator, device=like.device, dtype=like.dtype)


@dataclass
class _DpSgdRound:
    rule: DpSgdGradient
    noise_generator: torch.Generator | None
    batch_size: int | None
    steps: int | None
    _noise: torch.Tensor | None = None  # the block holding this step's row
    _step: int = 0

    def __call__(self, objective, w: torch.Tensor, x, y):
        layout = objective.layout
        if len(y):
            loss, logits, per_example = per_example_gradients(objective, w, x, y)
            offsets = tuple(layout.offsets) if self.rule.scope == "layer" else None
            if self.rule.clip_rule == "median":
                total, std = median_clipped_sum(per_example, offsets, self.rule)
            else:
                total = clipped_sum(per_example, self.rule.clip_norm, offsets)
                std = self.rule.noise_std_on_sum(len(layout.names))
        else:  # an empty Poisson batch: the step is noise alone
            loss, logits, total = torch.tensor(0.0), w.new_zeros((0, 1)), torch.zeros_like(w)
            std = self.rule.noise_std_on_sum(len(layout.names))
        if self.rule.noise_multiplier > 0:
            total = total + std * self._next_noise(total)
        return loss, logits, total / (self.batch_size or max(len(y), 1))

    def _next_noise(self, like: torch.Tensor) -> torch.Tensor:
        """Step k's noise row: row k mod R of block ⌊k/R⌋, drawn when step k starts it."""
        k, dim = self._step, like.numel()
        if k >= self.steps:
            raise ValueError(f"DP-SGD round of {self.steps} steps asked for step {k + 1}")
        rows = noise_block_rows(dim, self.steps)
        if k % rows == 0:
            self._noise = None  # the previous block is freed before the next is drawn
            self._noise = noise_block(self.noise_generator, self.steps, dim, k, like)
        self._step += 1
        return self._noise[k % rows]
