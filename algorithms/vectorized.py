"""Many clients' local SGD in one set of kernels: ``torch.func.vmap`` over stacked parameters.

``train_clients`` is ``LocalTrainer.train`` for n clients at once. Each client draws its own
mini-batch indices from its own generator, exactly as the sequential path does (``epoch`` and
``fresh`` batches for the whole round at once: ``algorithms.round_batches``, bit for bit the
sequential draws), so the batches, the number of steps and the learning rate are the same; the
steps of all n clients then run as vmapped steps on an ``[n, d]`` parameter matrix (a linear layer
becomes one batched matrix product, a convolution a grouped one). The weights equal the
sequential path's up to float rounding (batched kernels sum in another order);
``tests/test_vectorized.py`` checks it.

Clients of unequal sizes (the usual case under a Dirichlet partition) train together by masking:

- **batch sizes**: every step's batch is padded to the largest in the step; the padded records
  carry weight 0, so a client's loss is the mean over its own records,
  Σ_b m_b·ℓ_b / Σ_b m_b, the sequential path's ``cross_entropy`` mean;
- **step counts**: clients are ordered by their number of steps K_i, most first, so at step k
  the clients still training are a prefix ``[:m_k]`` of the matrix; only that prefix is
  computed and updated, and a finished client's weights and momentum are left as they were;
- **learning rates**: per client (``lr_scaling: inverse_sk`` depends on the client's size).

DP-SGD (``DpSgdGradient``, the sample-level presets) is vectorised too: each step takes the
per-example gradients of all m clients × B records in one ``torch.func`` pass (a ``vmap`` over
clients of a ``vmap`` over records of ``grad``: an [m, B, d] tensor), clips each client's rows
to its C (flat, or each tensor's segment: per-layer scope) with padded records weighted 0, adds
each client's own step-k noise row times κ·S·f·σ_g, and divides by the client's
B_i = min(B, n_i). A Poisson batch may be empty there (the step is the noise
alone, as sequentially): DP-SGD's step is a sum, which padding leaves exact. SCAFFOLD's
correction c − c_i (``corrections``, one row per client) is added to each client's step as
``LocalTrainer.descend`` adds it sequentially, with and without DP-SGD. The noise is the
sequential path's, bit for bit: each client's blocks of R = ``noise_block_rows(d, K)`` rows
(``algorithms.dpsgd.noise_block``, from its ``SAMPLE_NOISE`` stream), an [m, R, d] buffer
holding every client's current block and each client's next block drawn where its steps reach
it (``_ClientsNoise``).

Vectorised where it is the same computation (``vectorizable``): the plain SGD gradient or
DP-SGD with a fixed clip (not SAM or PGN; DP-SCAFFOLD's median heuristic, a per-step median of
each client's norms, stays sequential), no regularizers, no data augmentation, no dropout or
batch-norm statistics in the model, and batches drawn per epoch or afresh (or Poisson, for
DP-SGD only: an empty batch has no mean to average). Momentum and weight decay are vectorised.
Anything else trains sequentially. Clients are processed in chunks whose matrices stay under
``MAX_CHUNK_FLOATS`` (weights, gradients and momentum; for DP-SGD the [m, B, d] per-example
gradients and the [m, R, d] noise blocks held with them: B + R rows a client), and a chunk's
clients are of similar step counts (the order above), so little of a step is idle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import accumulate

import torch
from torch import nn
from torch.func import grad, grad_and_value, vmap

from algorithms.dpsgd import DpSgdGradient, clipped_sums, noise_block, noise_block_rows
from algorithms.local import LocalResult, LocalTrainer, ModelObjective, SgdGradient
from algorithms.round_batches import epoch_batches, fresh_batches
from models import GLOBAL_RNG_LAYERS

MAX_CHUNK_FLOATS = 32 * 2**20  # 128 MiB of float32 per [chunk, d] matrix

_STATEFUL_OR_RANDOM = (*GLOBAL_RNG_LAYERS, nn.modules.batchnorm._BatchNorm)


def vectorizable(trainer: LocalTrainer, objective: ModelObjective) -> bool:
    """Whether ``train_clients`` computes exactly what ``trainer.train`` would, per client."""
    gradient = trainer.gradient
    dp_sgd = isinstance(gradient, DpSgdGradient) and gradient.clip_rule == "fixed"
    samplings = ("epoch", "fresh", "poisson") if dp_sgd else ("epoch", "fresh")
    return (
        (type(gradient) is SgdGradient or dp_sgd)
        and not trainer.regularizers
        and trainer.max_grad_norm is None
        and trainer.batch_sampling in samplings
        and objective.augment is None
        and not any(isinstance(m, _STATEFUL_OR_RANDOM) for m in objective.model.modules())
    )


def train_clients(
    trainer: LocalTrainer,
    objective: ModelObjective,
    params: torch.Tensor,
    clients: ClientRows,
    generators: list[torch.Generator],
    corrections: torch.Tensor | None = None,
    noise_generators: list[torch.Generator] | None = None,
) -> list[LocalResult]:
    """``[trainer.train(objective, params, x, y, g, correction, noise_stream=...) for ...]``,
    vectorised: ``clients`` their records, ``generators`` each client's ``LOCAL_TRAINING``
    stream, ``corrections`` an [n, d] matrix of SCAFFOLD's c − c_i (None: no correction),
    ``noise_generators`` each client's ``SAMPLE_NOISE`` stream (DP-SGD with σ_g > 0 needs them).

    Every client needs at least one record.
    """
    sizes = clients.sizes
    if min(sizes, default=1) == 0:
        raise ValueError("train_clients: every client needs at least one record")
    steps = [trainer.num_steps(size) for size in sizes]
    order = sorted(range(len(sizes)), key=lambda i: -steps[i])  # most steps first (stable)
    d = params.numel()
    chunk = max(1, MAX_CHUNK_FLOATS // (d * _rows_per_client(trainer, steps, d)))
    results: list[LocalResult | None] = [None] * len(sizes)
    for start in range(0, len(order), chunk):
        members = order[start : start + chunk]
        trained = _train_chunk(
            trainer,
            objective,
            params,
            clients.of(members),
            [generators[i] for i in members],
            None if corrections is None else corrections[members],
            None if noise_generators is None else [noise_generators[i] for i in members],
        )
        for i, result in zip(members, trained, strict=True):
            results[i] = result
    return results


@dataclass(frozen=True)
class ClientRows:
    """n clients' records as rows of two tensors: client i's are the ``sizes[i]`` rows of ``x``
    and ``y`` from row ``starts[i]``. A step's batches are one ``index_select`` of those rows
    (the values of ``x_i[index]``), where a padded ``[n, max n_i, ...]`` stack of the clients,
    copied every round and indexed with two index tensors, cost ≈ 3× as much."""

    x: torch.Tensor  # [N, ...]
    y: torch.Tensor  # [N]
    starts: list[int]
    sizes: list[int]

    @classmethod
    def concatenated(cls, data: list[tuple[torch.Tensor, torch.Tensor]]) -> ClientRows:
        """The clients' ``(x, y)`` tensors, in this order, concatenated (one copy); no clients:
        empty rows (nothing to read)."""
        if not data:
            return cls(torch.empty(0), torch.empty(0, dtype=torch.int64), [], [])
        sizes = [y.shape[0] for _, y in data]
        starts = [0, *accumulate(sizes)][:-1]
        return cls(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]), starts, sizes)

    def of(self, members: list[int]) -> ClientRows:
        """The clients ``members`` (positions in this one), in that order; the same rows."""
        starts, sizes = self.starts, self.sizes
        return ClientRows(self.x, self.y, [starts[i] for i in members], [sizes[i] for i in members])

    def batches(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [m, B, ...], y [m, B]) of the [m, B] row numbers ``rows``."""
        flat = rows.flatten()
        x = self.x.index_select(0, flat).unflatten(0, rows.shape)
        return x, self.y.index_select(0, flat).view(rows.shape)


def _masked_loss(objective: ModelObjective):
    """Loss of one client's padded batch: the mean cross-entropy over its real records. NCHW
    whatever ``objective.channels_last`` says: vmap cannot batch a channels-last copy."""
    nchw = replace(objective, channels_last=False)

    def loss(w: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor):
        logits = nchw.logits(w, xb)
        per_record = nn.functional.cross_entropy(logits, yb, reduction="none")
        return (per_record * mask).sum() / mask.sum(), logits

    return loss


def _rows_per_client(trainer: LocalTrainer, steps: list[int], dim: int) -> int:
    """d-sized rows a client holds in a chunk: 1 (weights), or for DP-SGD its B per-example
    gradients and, held with them, its R = ``noise_block_rows(d, K)`` noise rows (σ_g > 0)."""
    gradient = trainer.gradient
    if not isinstance(gradient, DpSgdGradient):
        return 1
    noise = noise_block_rows(dim, max(steps, default=1)) if gradient.noise_multiplier > 0 else 0
    return max(trainer.batch_size, 1) + noise


def _train_chunk(
    trainer, objective, params, clients, generators, corrections, noise_generators
) -> list[LocalResult]:
    """Clients ordered by step count, most first: at step k the active ones are a prefix."""
    device, sizes = params.device, clients.sizes
    n = len(sizes)
    steps = [trainer.num_steps(size) for size in sizes]
    rates = [trainer.local_lr(size) for size in sizes]
    lr = rates[0] if len(set(rates)) == 1 else torch.tensor(rates, device=device)[:, None]
    first_rows = torch.tensor(clients.starts, device=device)[:, None]

    if isinstance(trainer.gradient, DpSgdGradient):
        step = _ClientsDpSgd.of(trainer, objective, params, sizes, steps, noise_generators)
    else:
        step = _sgd_step(objective)
    w, buf = params.expand(n, -1).clone(), None
    loss_sum = torch.zeros(n, dtype=torch.float64, device=device)
    correct, seen, evals = (torch.zeros(n, dtype=torch.int64, device=device) for _ in range(3))
    batches = _step_batches(trainer, sizes, steps, generators, device)
    for k in range(steps[0]):
        m = sum(s > k for s in steps)  # clients still training: a prefix
        index, mask = batches(k, m)
        xb, yb = clients.batches(first_rows[:m] + index)
        g, batch_loss, logits = step(k, w[:m], xb, yb, mask)
        lr_m = lr if isinstance(lr, float) else lr[:m]
        correction = None if corrections is None else corrections[:m]
        _, new_buf = trainer.descend(w[:m], g, None if buf is None else buf[:m], lr_m, correction)
        if buf is None and new_buf is not None:
            buf = torch.zeros_like(w)
            buf[:m] = new_buf
        counts = mask.sum(1).long()
        loss_sum[:m] += batch_loss.double() * counts
        correct[:m] += ((logits.argmax(-1) == yb) & mask.bool()).sum(1)
        seen[:m] += counts
        evals[:m] += counts > 0  # an empty Poisson batch evaluates nothing (as sequentially)
    totals = [t.tolist() for t in (loss_sum, correct, seen, evals)]  # one copy each
    objective.grad_evals += sum(totals[3])
    return [
        LocalResult(row, step_count, loss, hits, count, calls, rate)
        for row, step_count, rate, loss, hits, count, calls in zip(
            w.unbind(0), steps, rates, *totals, strict=True
        )
    ]


def _sgd_step(objective: ModelObjective):
    """(k, w [m, d], x, y, mask) → (∇ of each client's masked mean loss, loss [m], logits)."""
    step = vmap(grad_and_value(_masked_loss(objective), has_aux=True))

    def call(k, w, xb, yb, mask):
        g, (batch_loss, logits) = step(w, xb, yb, mask)
        return g, batch_loss, logits

    return call


def _step_batches(trainer, sizes, steps, generators, device):
    """(k, m) → (index, mask) of step k's batches of the chunk's first m clients, as
    ``_padded_indices`` pads them: ``epoch`` and ``fresh`` batches drawn for the whole round at
    once (``algorithms.round_batches``, bit for bit ``trainer.batches``), ``poisson`` a step at
    a time from it."""
    if trainer.batch_sampling == "poisson":
        draws = [trainer.batches(size, g) for size, g in zip(sizes, generators, strict=True)]
        return lambda k, m: _padded_indices([next(draws[i]) for i in range(m)], device)
    draw = fresh_batches if trainer.batch_sampling == "fresh" else epoch_batches
    index, lengths = draw(sizes, steps, trainer.batch_size, generators)
    mask = (torch.arange(index.shape[2]) < lengths[..., None]).float()
    widest = lengths.cummax(0).values.clamp(min=1)  # [i, k]: the widest batch of clients ≤ i
    index, mask = index.to(device), mask.to(device)

    def batches(k: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = int(widest[m - 1, k])
        return index[:m, k, :width], mask[:m, k, :width]

    return batches


def _padded_indices(indices: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[m, B]`` record indices padded with 0, ``[m, B]`` float mask of the real ones); B ≥ 1
    even when every batch is empty (Poisson), so that a step still has a record axis."""
    lengths = [i.shape[0] for i in indices]
    width = max(*lengths, 1)
    if min(lengths) == width:
        index = torch.stack(indices).to(device)
        return index, torch.ones(index.shape, device=device)
    index = torch.zeros((len(indices), width), dtype=torch.int64, device=device)
    mask = torch.zeros((len(indices), width), device=device)
    for row, (i, length) in enumerate(zip(indices, lengths, strict=True)):
        index[row, :length] = i
        mask[row, :length] = 1.0
    return index, mask


@dataclass(frozen=True)
class _ClientsDpSgd:
    """``DpSgdGradient``'s step for a chunk's clients at once: client i's step k is

        G_ik = (Σ_j m_ij·clip_C(g_ij) + κ·S·f·σ_g·ξ_i[k]) / B_i

    with g_ij the [m, B, d] per-example gradients (one nested-vmap pass), m_ij the mask of its
    own records, ξ_i[k] its step-k noise row (``_ClientsNoise``: the sequential path's blocks)
    and B_i = min(B, n_i), the sequential path's denominator."""

    rule: DpSgdGradient
    per_example: Callable  # (w [m, d], x [m, B, ...], y [m, B]) → ([m, B, d], logits)
    offsets: tuple[int, ...] | None  # per-tensor segments (scope "layer"), else None
    std: float  # κ·S·f·σ_g
    noise: _ClientsNoise | None
    denominators: torch.Tensor  # [n, 1]

    @classmethod
    def of(cls, trainer, objective, params, sizes, steps, noise_generators) -> _ClientsDpSgd:
        rule, layout = trainer.gradient, objective.layout
        noise = None
        if rule.noise_multiplier > 0:
            if noise_generators is None:
                raise ValueError("DP-SGD needs each client's noise stream (noise_generators)")
            noise = _ClientsNoise.of(noise_generators, steps, params)
        denominators = [min(trainer.batch_size, size) for size in sizes]
        return cls(
            rule,
            _per_example_gradients(objective),
            tuple(layout.offsets) if rule.scope == "layer" else None,
            rule.noise_std_on_sum(len(layout.names)),
            noise,
            torch.tensor(denominators, dtype=params.dtype, device=params.device)[:, None],
        )

    def __call__(self, k: int, w, xb, yb, mask):
        """(G [m, d], each client's mean loss over its records (0 if none), logits)."""
        m = w.shape[0]
        grads, logits = self.per_example(w, xb, yb)
        total = clipped_sums(grads, mask, self.rule.clip_norm, self.offsets)
        if self.noise is not None:
            total = total + self.std * self.noise.rows(k, m)
        per_record = nn.functional.cross_entropy(
            logits.flatten(0, 1), yb.flatten(), reduction="none"
        ).view_as(mask)
        loss = (per_record * mask).sum(1) / mask.sum(1).clamp(min=1)
        return total / self.denominators[:m], loss, logits


@dataclass(frozen=True)
class _ClientsNoise:
    """The chunk's clients' DP-SGD noise, block by block (``algorithms.dpsgd.noise_block``):
    an [n, R, d] buffer whose row i holds client i's current block, R = ``noise_block_rows(d,
    K_1)`` for the most steps K_1. Client i's own R_i = min(K_i, R): a client still training
    at step k has K_i > k, so its blocks start where the chunk's do (every R steps; R_i = K_i
    is one block, drawn at step 0) and step k is row k mod R of every active client's block.
    Memory O(n·R·d), not O(n·K·d)."""

    generators: list[torch.Generator]
    steps: list[int]  # K_i, most first
    buffer: torch.Tensor  # [n, R, d]

    @classmethod
    def of(cls, generators, steps, params) -> _ClientsNoise:
        rows = noise_block_rows(params.numel(), max(steps))
        return cls(generators, steps, params.new_empty((len(steps), rows, params.numel())))

    def rows(self, k: int, m: int) -> torch.Tensor:
        """[m, d]: step k's noise row of each of the first m clients (those still training),
        drawing their next blocks where step k starts them."""
        _, rows, d = self.buffer.shape
        if k % rows == 0:
            for i in range(m):
                block = noise_block(self.generators[i], self.steps[i], d, k, self.buffer)
                self.buffer[i, : block.shape[0]] = block
        return self.buffer[:m, k % rows]


def _per_example_gradients(objective: ModelObjective):
    """vmap over clients of vmap over records of ∇ℓ(w_i; x_ij, y_ij): ([m, B, d], logits)."""
    nchw = replace(objective, channels_last=False)

    def example(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        logits = nchw.logits(w, x.unsqueeze(0))
        return nn.functional.cross_entropy(logits, y.unsqueeze(0)), logits.squeeze(0)

    return vmap(vmap(grad(example, has_aux=True), in_dims=(None, 0, 0)))
