"""Local training on one client: the part of an algorithm that runs before the update pipeline.

``LocalTrainer`` runs K steps (or E epochs) of mini-batch SGD on a flat parameter vector with
PyTorch's SGD semantics (dampening 0, no Nesterov)::

    g ← G(w; batch) + Σ_r ∇R_r(w; w₀) + λ·w + correction   # λ = weight_decay
                                                  # R_r: regularizers (BLUR, FedProx) around w₀
                                                  # correction: SCAFFOLD c − c_i
    b ← g (first step) | μ·b + g                  # μ = momentum
    w ← w − η·b

G is the trainer's gradient rule: ``SgdGradient`` (∇f, one evaluation per step),
``SamGradient`` (SAM/ASAM, two), ``PgnGradient`` (one) or ``DpSgdGradient`` (per-example
clipping and noise, ``algorithms.dpsgd``), bound once per round to the broadcast payload, the
client's noise stream, the expected batch size (DP-SGD's denominator) and the number of steps
K (which blocks DP-SGD's noise: ``algorithms.dpsgd.noise_block``) by ``for_round``.
``ModelObjective.grad_evals`` counts every evaluation.
Mini-batches (``batch_sampling``): ``epoch``, without replacement from a fresh permutation of
the client's data each epoch (with ``local_steps`` the permutations continue across epoch
boundaries); ``fresh``, B records without replacement drawn afresh every step (DP-SCAFFOLD's
Alg. 1: each step is an s-subsample, s = B/n, independent of the others, which the sample-level
accountant needs); ``poisson``, every record independently with probability s = B/n each step
(DP-SGD's standard analysis; the batch size varies, its expectation is B).

With ``lr_decay`` γ, round t (from 0) uses η_t = η·γ^t (DP-FedSAM's and DP-FedPGN's code:
γ = 0.998). With ``lr_scaling="inverse_sk"`` the configured lr is η₀ and a client of n records
trains with η_l = η₀/(s·K), s = B/n (DP-SCAFFOLD's experiments); ``LocalResult.lr`` is the η_l
used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call

from algorithms.layout import ParamLayout
from models import draws_from_global_rng


@dataclass
class ModelObjective:
    """Loss and gradient of a model at a flat parameter vector.

    ``augment(x_batch, generator)``, when set, transforms every training mini-batch (the task's
    data augmentation); evaluation never uses it.

    ``channels_last``: run 2-D convolutions on NHWC views of the images and kernels (the flat
    vector stays as it is; autograd copies the gradients back). The same math up to float
    rounding, and on the CPU a faster kernel: the MNIST CNN's batch-16 step at one thread takes
    4.9–5.4 instead of 6.6–6.7 ms (``executor.channels_last``).

    ``autocast``: the dtype the model's forward runs in under ``torch.autocast`` (None: float32
    throughout; ``torch.bfloat16`` for ``executor.precision: bf16``). Only the model's
    operations change: its parameters (the flat vector) stay float32, the logits come back as
    float32, so the loss, every gradient w.r.t. ``flat`` (autograd casts it back through the
    autocast's casts), the step, the update, its clip and its noise are float32 as without it.
    """

    model: nn.Module
    layout: ParamLayout
    augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None
    grad_evals: int = 0  # forward/backward passes so far
    channels_last: bool = False
    autocast: torch.dtype | None = None
    # (module, attribute) of each of the layout's tensors, found once (``_parameter_slots``)
    _slots: dict[str, tuple[nn.Module, str]] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._slots = _parameter_slots(self.model, self.layout)

    @property
    def draws_from_global_rng(self) -> bool:
        """Whether a training step draws from torch's global generator (dropout)."""
        return draws_from_global_rng(self.model)

    def logits(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._forward(self.layout.unflatten(flat), x)

    def _forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            params = {k: _nhwc(v) if v.dim() == 4 else v for k, v in params.items()}
            x = _nhwc(x) if x.dim() == 4 else x
        if self.autocast is None:
            return self._call(params, x)
        with torch.autocast(x.device.type, dtype=self.autocast):
            return self._call(params, x).float()

    def _call(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self._slots is None:
            return functional_call(self.model, params, (x,))
        return _call_with(self.model, self._slots, params, x)

    def loss_and_grad(
        self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean cross-entropy, logits, ∇ of the mean loss w.r.t. ``flat``)."""
        self.grad_evals += 1
        flat = flat.detach().requires_grad_(True)
        logits = self.logits(flat, x)
        loss = nn.functional.cross_entropy(logits, y)
        (grad,) = torch.autograd.grad(loss, flat)
        return loss.detach(), logits.detach(), grad

    def sgd_step_(
        self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lr: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """w ← w − η·∇f(w) on ``flat`` in place, tensor by tensor (``torch.optim.SGD``'s
        update); returns (mean cross-entropy, logits) at the old w. The same numbers as
        ``loss_and_grad`` then ``flat.add_(grad, alpha=-lr)``, without assembling the flat
        gradient: one pass less over d floats per step (for the MNIST CNN, 2.3 MB)."""
        self.grad_evals += 1
        views = self.layout.unflatten(flat)
        leaves = {name: view.detach().requires_grad_(True) for name, view in views.items()}
        logits = self._forward(leaves, x)
        loss = nn.functional.cross_entropy(logits, y)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        with torch.no_grad():
            for view, grad in zip(views.values(), grads, strict=True):
                view.add_(grad, alpha=-lr)
        return loss.detach(), logits.detach()


AUTOCAST_DTYPES = {"float32": None, "bf16": torch.bfloat16}


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """``ModelObjective.autocast`` for ``executor.precision`` on ``device``; a ``ValueError``
    naming the setting where the device cannot run it (a GPU without bf16 arithmetic)."""
    why = precision_unsupported(precision, device)
    if why is not None:
        raise ValueError(f"executor.precision = {precision!r}: {why}")
    return AUTOCAST_DTYPES[precision]


def precision_unsupported(precision: str, device: torch.device) -> str | None:
    """Why ``device`` cannot run ``executor.precision`` (a GPU without bf16 arithmetic), and
    the fix; None where it can (float32 asks the device nothing)."""
    cuda = device.type == "cuda"
    if AUTOCAST_DTYPES[precision] is None or not cuda:
        return None
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return None
    return (
        f"{torch.cuda.get_device_name(device)} has no bf16 arithmetic (NVIDIA Ampere or later "
        "has); set executor.precision=float32"
    )


def _parameter_slots(model: nn.Module, layout: ParamLayout):
    """Where each of ``layout``'s tensors lives in ``model``: {name: (submodule, attribute)}, for
    ``_call_with``. None where a tensor is registered under two names (tied weights), which
    ``functional_call`` handles."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    if names != list(layout.names):
        return None
    slots = {}
    for name in names:
        path, _, attribute = name.rpartition(".")
        slots[name] = (model.get_submodule(path), attribute)
    return slots


def _call_with(
    model: nn.Module,
    slots: dict[str, tuple[nn.Module, str]],
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
) -> torch.Tensor:
    """``model(x)`` with its parameters replaced by ``params`` for the call, then put back: what
    ``functional_call`` does, without walking the module tree on every call (≈ 85 µs a step for
    the MNIST CNN, 2.5% of a host's round of workload A; the same numbers, bit for bit)."""
    saved = {name: module._parameters[attribute] for name, (module, attribute) in slots.items()}
    try:
        for name, tensor in params.items():
            module, attribute = slots[name]
            module._parameters[attribute] = tensor
        return model(x)
    finally:
        for name, tensor in saved.items():
            module, attribute = slots[name]
            module._parameters[attribute] = tensor


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, C, H, W] with channels-last strides, explicitly: for C = 1 both layouts are
    "contiguous", and ``contiguous(memory_format=channels_last)`` would leave the NCHW strides
    that make the convolution pick its NCHW kernel."""
    n, c, h, w = t.shape
    t = t.contiguous(memory_format=torch.channels_last)
    return t.as_strided(t.shape, (h * w * c, 1, w * c, c))


def _batch_totals(
    losses: list[torch.Tensor], outputs: list[torch.Tensor], labels: list[torch.Tensor]
) -> tuple[float, int, int]:
    """(Σ batch mean loss × batch size, correct predictions, records seen) over the steps. An
    empty step (a Poisson batch of no record: DP-SGD's noise alone) adds nothing: its loss and
    outputs are placeholders, of no class count and not on the batches' device."""
    kept = [(loss, out, y) for loss, out, y in zip(losses, outputs, labels, strict=True) if len(y)]
    if not kept:
        return 0.0, 0, 0
    losses, outputs, labels = zip(*kept, strict=True)
    y = torch.cat(labels)
    sizes = torch.tensor([b.shape[0] for b in labels], dtype=torch.float64, device=y.device)
    loss_sum = float((torch.stack(losses).double() * sizes).sum())
    return loss_sum, int((torch.cat(outputs).argmax(1) == y).sum()), y.shape[0]


@dataclass(frozen=True)
class SgdGradient:
    """G(w; ξ) = ∇f(w; ξ): one gradient evaluation per step."""

    def for_round(
        self, payload=None, noise_stream=None, batch_size=None, steps=None
    ) -> SgdGradient:
        return self

    def __call__(self, objective: ModelObjective, w: torch.Tensor, x, y):
        return objective.loss_and_grad(w, x, y)


@dataclass(frozen=True)
class SamGradient:
    """Sharpness-aware gradient (SAM, Foret et al. 2021; ASAM, Kwon et al. 2021), as DP-FedSAM.

    On the same mini-batch ξ: g = ∇f(w; ξ), then the ascent step

        e = ρ·g / ‖g‖₂                      (SAM, Eq. 9 of DP-FedSAM; norm over all parameters)
        e = ρ·w²⊙g / (‖w⊙g‖₂ + 1e-12)       (ASAM, ``adaptive=True``, the authors' code default)

    and G = ∇f(w + e; ξ): two gradient evaluations per step. The loss and logits reported are
    those at w. ρ = 0 (or g = 0) is SGD exactly, with one evaluation.
    """

    rho: float
    adaptive: bool = False

    def for_round(
        self, payload=None, noise_stream=None, batch_size=None, steps=None
    ) -> SamGradient:
        return self

    def __call__(self, objective: ModelObjective, w: torch.Tensor, x, y):
        loss, logits, g = objective.loss_and_grad(w, x, y)
        if self.rho == 0:
            return loss, logits, g
        if self.adaptive:
            scale = self.rho / (float(torch.linalg.vector_norm(w.abs() * g)) + 1e-12)
            e = w * w * g * scale
        else:
            norm = float(torch.linalg.vector_norm(g))
            if norm == 0:
                return loss, logits, g
            e = g * (self.rho / norm)
        _, _, g_sharp = objective.loss_and_grad(w + e, x, y)
        return loss, logits, g_sharp


@dataclass(frozen=True)
class PgnGradient:
    """DP-FedPGN's penalised-gradient-norm direction (Liu et al., spec 003 §1a), one evaluation.

    With g̃ the previous round's aggregated DP pseudo-gradient (broadcast as
    ``payload["direction"]``) and δ = ρ·g̃/‖g̃‖ (δ = 0 in round 0, where g̃ = 0):

        G = β·∇f(w + δ; ξ) + (1 − β)·g̃

    β = 1 and ρ = 0 is SGD exactly. ``perturbation="descent"`` takes δ = −ρ·g̃/‖g̃‖ instead:
    the authors' LESAM optimizer (``update_FedPGN2``, spec 003 §1c), the opposite sign to
    the paper's Eq. 11 ("ascent").
    """

    beta: float = 0.3
    rho: float = 0.2
    perturbation: Literal["ascent", "descent"] = "ascent"

    def for_round(self, payload=None, noise_stream=None, batch_size=None, steps=None) -> _PgnRound:
        """The rule with this round's δ and drift (1 − β)·g̃ computed once, not every step."""
        direction = (payload or {}).get("direction")
        norm = 0.0 if direction is None else float(torch.linalg.vector_norm(direction))
        signed_rho = self.rho if self.perturbation == "ascent" else -self.rho
        shift = None if self.rho == 0 or norm == 0 else direction * (signed_rho / norm)
        drift = None if self.beta == 1 or norm == 0 else (1 - self.beta) * direction
        return _PgnRound(self.beta, shift, drift)


@dataclass(frozen=True)
class _PgnRound:
    beta: float
    shift: torch.Tensor | None  # δ = ρ·g̃/‖g̃‖
    drift: torch.Tensor | None  # (1 − β)·g̃

    def __call__(self, objective: ModelObjective, w: torch.Tensor, x, y):
        # The loss reported is at the perturbed point (PGN evaluates nothing else).
        at = w if self.shift is None else w + self.shift
        loss, logits, g = objective.loss_and_grad(at, x, y)
        if self.beta == 1:
            return loss, logits, g
        g = self.beta * g
        return loss, logits, g if self.drift is None else g + self.drift


@dataclass(frozen=True)
class _ClippedGradients:
    """``objective`` whose every mini-batch gradient g is scaled to min(1, M/(‖g‖₂ + 10⁻⁶))·g
    (``torch.nn.utils.clip_grad_norm_``'s rule, as tensor ops: no host sync per step). Local
    optimisation only: the update's own clipping is what bounds a client's sensitivity."""

    inner: ModelObjective
    max_norm: float

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def loss_and_grad(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        loss, logits, grad = self.inner.loss_and_grad(flat, x, y)
        scale = (self.max_norm / (torch.linalg.vector_norm(grad) + 1e-6)).clamp(max=1.0)
        return loss, logits, grad * scale


@dataclass
class LocalResult:
    params: torch.Tensor
    steps: int
    loss_sum: float  # Σ over steps of (batch mean loss × batch size), at the pre-step parameters
    correct: int
    seen: int
    grad_evals: int = 0  # gradient evaluations (forward/backward passes) over the steps
    lr: float = math.nan  # the local lr η_l the steps used


BatchSampling = Literal["epoch", "fresh", "poisson"]


@dataclass(frozen=True)
class LocalTrainer:
    lr: float
    batch_size: int
    local_steps: int | None = None
    local_epochs: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_decay: float = 1.0  # per-round: round t trains with lr·lr_decay^t (see ``at_round``)
    gradient: SgdGradient | SamGradient | PgnGradient = field(default_factory=SgdGradient)
    regularizers: tuple = ()  # objects with grad(w, w0) -> Tensor | None (algorithms.regularizers)
    batch_sampling: BatchSampling = "epoch"
    lr_scaling: Literal["none", "inverse_sk"] = "none"
    max_grad_norm: float | None = None  # every mini-batch gradient clipped to it (``_Clipped``)

    def __post_init__(self) -> None:
        if (self.local_steps is None) == (self.local_epochs is None):
            raise ValueError("set exactly one of local_steps and local_epochs")
        if self.batch_sampling not in ("epoch", "fresh", "poisson"):
            raise ValueError(
                f"batch_sampling must be epoch, fresh or poisson, not {self.batch_sampling!r}"
            )
        if self.lr_scaling not in ("none", "inverse_sk"):
            raise ValueError(f"lr_scaling must be none or inverse_sk, not {self.lr_scaling!r}")

    def record_rate(self, num_samples: int) -> float:
        """s = B/n: the probability that a step's batch holds a given record."""
        return min(1.0, self.batch_size / max(num_samples, 1))

    def local_lr(self, num_samples: int) -> float:
        """η_l for a client of ``num_samples`` records: η, or η₀/(s·K) under ``inverse_sk``."""
        if self.lr_scaling == "none":
            return self.lr
        return self.lr / (self.record_rate(num_samples) * self.num_steps(num_samples))

    def at_round(self, round_index: int) -> LocalTrainer:
        """The trainer of round t (from 0): η_t = η·lr_decay^t, the papers' per-round decay."""
        if self.lr_decay == 1.0:
            return self
        lr = self.lr * self.lr_decay**round_index
        if lr <= 0:
            raise ValueError(f"lr {self.lr}·{self.lr_decay}^{round_index} underflows to 0")
        return replace(self, lr=lr)

    def num_steps(self, num_samples: int) -> int:
        if self.local_steps is not None:
            return self.local_steps
        return self.local_epochs * math.ceil(num_samples / self.batch_size)

    def batches(self, num_samples: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
        """Index batches for ``num_steps`` steps, drawn as ``batch_sampling`` says."""
        size = min(self.batch_size, num_samples)
        left = self.num_steps(num_samples)
        if self.batch_sampling == "fresh":
            for _ in range(left):
                yield torch.randperm(num_samples, generator=generator)[:size]
            return
        if self.batch_sampling == "poisson":
            rate = self.record_rate(num_samples)
            for _ in range(left):
                yield torch.nonzero(torch.rand(num_samples, generator=generator) < rate)[:, 0]
            return
        while left > 0:
            perm = torch.randperm(num_samples, generator=generator)
            for start in range(0, num_samples, size):
                if left == 0:
                    return
                yield perm[start : start + size]
                left -= 1

    def _round_batches(self, objective, x, y, generator, payload, noise_stream, augment_rng):
        """(the gradient rule bound to this round, iterator of (x_batch, y_batch))."""
        size = len(y)
        gradient = self.gradient.for_round(
            payload, noise_stream, min(self.batch_size, size), self.num_steps(size)
        )

        def batches():
            for index in self.batches(len(y), generator):
                index = index.to(x.device)
                xb = x[index]
                if objective.augment is not None:
                    xb = objective.augment(xb, augment_rng)
                yield xb, y[index]

        return gradient, batches()

    def train(
        self,
        objective: ModelObjective,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        correction: torch.Tensor | None = None,
        augment_generator: torch.Generator | None = None,
        payload: dict[str, torch.Tensor] | None = None,
        noise_stream: Callable[[], torch.Generator] | None = None,
    ) -> LocalResult:
        """K steps from ``params``. ``noise_stream()`` makes the client's generator for a rule
        that adds noise per step (``algorithms.dpsgd.DpSgdGradient``); others never call it."""
        w = params.clone()
        lr = self.local_lr(len(y))
        evals_before = objective.grad_evals
        gradient, batches = self._round_batches(
            objective, x, y, generator, payload, noise_stream, augment_generator
        )
        objective = self._objective(objective)
        buf = None
        # Each step's loss, logits and labels are kept (a few floats) and reduced once at the
        # end: no host sync per step (a GPU would stall), no small kernels per step.
        losses, outputs, labels = [], [], []
        plain_sgd = self._plain_sgd(gradient, correction)
        for xb, yb in batches:
            if plain_sgd:
                loss, logits = objective.sgd_step_(w, xb, yb, lr)
            else:
                loss, logits, g = gradient(objective, w, xb, yb)
                for regularizer in self.regularizers:
                    extra = regularizer.grad(w, params)
                    if extra is not None:
                        g = g + extra
                w, buf = self.descend(w, g, buf, lr, correction)
            losses.append(loss)
            outputs.append(logits)
            labels.append(yb)
        loss_sum, correct, seen = _batch_totals(losses, outputs, labels)
        return LocalResult(
            w.detach(),
            len(losses),
            loss_sum,
            correct,
            seen,
            objective.grad_evals - evals_before,
            lr,
        )

    def _plain_sgd(self, gradient, correction: torch.Tensor | None) -> bool:
        """Whether a step is w ← w − η·∇f(w) and nothing else (``ModelObjective.sgd_step_``)."""
        return (
            isinstance(gradient, SgdGradient)
            and not self.regularizers
            and correction is None
            and not self.momentum
            and not self.weight_decay
            and self.max_grad_norm is None
        )

    def _objective(self, objective: ModelObjective) -> ModelObjective | _ClippedGradients:
        """The objective the gradient rule evaluates: with ``max_grad_norm``, one whose every
        mini-batch gradient is clipped (before PGN mixes it with g̃, as the authors' code)."""
        if self.max_grad_norm is None:
            return objective
        return _ClippedGradients(objective, self.max_grad_norm)

    def descend(
        self,
        w: torch.Tensor,
        g: torch.Tensor,
        buf: torch.Tensor | None,
        lr: float | torch.Tensor,
        correction: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step from gradient ``g``: + λ·w, + correction, momentum, w − η·g (the module
        docstring's update), ``w`` and the buffer updated in place (as ``torch.optim.SGD``: a
        fresh multi-megabyte result per step costs more than the arithmetic, in page faults);
        returns ``(w, momentum buffer)``. Shapes are free: ``w`` may be one client's vector or
        the ``[n, d]`` matrix of ``algorithms.vectorized``, ``lr`` a float or an ``[n, 1]``
        column of per-client rates."""
        if self.weight_decay:
            g = g.add(w, alpha=self.weight_decay)
        if correction is not None:
            g = g + correction
        if self.momentum:
            buf = g if buf is None else buf.mul_(self.momentum).add_(g)
            g = buf
        if isinstance(lr, torch.Tensor):
            return w.addcmul_(g, lr, value=-1), buf
        return w.add_(g, alpha=-lr), buf

    def mean_gradient(
        self,
        objective: ModelObjective,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        noise_stream: Callable[[], torch.Generator] | None = None,
        augment_generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """(1/K) Σ_k G(x; ξ_k) + λ·x at fixed ``params`` x: K batches drawn as in ``train``, no
        step taken (DP-SCAFFOLD's warm start c_i⁰ = (1/K) Σ_k H̃_i^k(x⁰), with the same per-step
        noise), plus the weight decay that ``descend`` adds to every step's gradient, so that
        c_i⁰ estimates the same gradient as option II's c_i⁺ = c_i − c + (x − y_i)/(Kη_l)."""
        gradient, batches = self._round_batches(
            objective, x, y, generator, None, noise_stream, augment_generator
        )
        total, steps = torch.zeros_like(params), 0
        for xb, yb in batches:
            total += gradient(objective, params, xb, yb)[2]
            steps += 1
        return total.div_(steps).add_(params, alpha=self.weight_decay)
