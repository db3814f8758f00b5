"""Many clients' local SGD in one set of kernels: ``torch.func.vmap`` over stacked parameters.

``train_clients`` is ``LocalTrainer.train`` for n clients at once. Each client draws its own
mini-batch indices from its own generator, exactly as the sequential path does, so the batches,
the number of steps and the learning rate are the same; the steps of all n clients then run as
vmapped steps on an ``[n, d]`` parameter matrix (a linear layer becomes one batched matrix
product, a convolution a grouped one). The weights equal the sequential path's up to float
rounding (batched kernels sum in another order); ``tests/test_vectorized.py`` checks it.

Clients of unequal sizes (the usual case under a Dirichlet partition) train together by masking:

- **batch sizes**: every step's batch is padded to the largest in the step; the padded records
  carry weight 0, so a client's loss is the mean over its own records,
  Σ_b m_b·ℓ_b / Σ_b m_b, the sequential path's ``cross_entropy`` mean;
- **step counts**: clients are ordered by their number of steps K_i, most first, so at step k
  the clients still training are a prefix ``[:m_k]`` of the matrix; only that prefix is
  computed and updated, and a finished client's weights and momentum are left as they were;
- **learning rates**: per client (``lr_scaling: inverse_sk`` depends on the client's size).

Vectorised where it is the same computation (``vectorizable``): the plain SGD gradient (no SAM,
PGN or per-step DP-SGD noise), no regularizers, no control-variate correction, no data
augmentation, no dropout or batch-norm statistics in the model, and batches drawn per epoch or
afresh (a Poisson batch may be empty, which the sequential path does not average). Momentum and
weight decay are vectorised. Anything else trains sequentially. Clients are processed in chunks
whose parameter matrices stay under ``MAX_CHUNK_FLOATS`` (weights, gradients and momentum), and
a chunk's clients are of similar step counts (the order above), so little of a step is idle.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.func import grad_and_value, vmap

from algorithms.local import LocalResult, LocalTrainer, ModelObjective, SgdGradient
from models import GLOBAL_RNG_LAYERS

MAX_CHUNK_FLOATS = 32 * 2**20  # 128 MiB of float32 per [chunk, d] matrix

_STATEFUL_OR_RANDOM = (*GLOBAL_RNG_LAYERS, nn.modules.batchnorm._BatchNorm)


def vectorizable(trainer: LocalTrainer, objective: ModelObjective) -> bool:
    """Whether ``train_clients`` computes exactly what ``trainer.train`` would, per client."""
    return (
        type(trainer.gradient) is SgdGradient
        and not trainer.regularizers
        and trainer.max_grad_norm is None
        and trainer.batch_sampling in ("epoch", "fresh")
        and objective.augment is None
        and not any(isinstance(m, _STATEFUL_OR_RANDOM) for m in objective.model.modules())
    )


def train_clients(
    trainer: LocalTrainer,
    objective: ModelObjective,
    params: torch.Tensor,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    generators: list[torch.Generator],
) -> list[LocalResult]:
    """``[trainer.train(objective, params, x, y, g) for (x, y), g in ...]``, vectorised.

    Every client needs at least one record.
    """
    sizes = [y.shape[0] for _, y in data]
    if min(sizes, default=1) == 0:
        raise ValueError("train_clients: every client needs at least one record")
    steps = [trainer.num_steps(size) for size in sizes]
    order = sorted(range(len(data)), key=lambda i: -steps[i])  # most steps first (stable)
    chunk = max(1, MAX_CHUNK_FLOATS // params.numel())
    results: list[LocalResult | None] = [None] * len(data)
    for start in range(0, len(order), chunk):
        members = order[start : start + chunk]
        trained = _train_chunk(
            trainer,
            objective,
            params,
            [data[i] for i in members],
            [generators[i] for i in members],
        )
        for i, result in zip(members, trained, strict=True):
            results[i] = result
    return results


def _padded_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[n, max_len, ...]``: each client's records, zero rows after its own. (``shape[0]``,
    not ``len``: ``Tensor.__len__`` costs ≈ 1.4 µs, and a round asks thousands of times.)"""
    lengths = [t.shape[0] for t in tensors]
    if min(lengths) == max(lengths):
        return torch.stack(tensors)
    out = tensors[0].new_zeros((len(tensors), max(lengths), *tensors[0].shape[1:]))
    for i, (t, length) in enumerate(zip(tensors, lengths, strict=True)):
        out[i, :length] = t
    return out


def _masked_loss(objective: ModelObjective):
    """Loss of one client's padded batch: the mean cross-entropy over its real records. NCHW
    whatever ``objective.channels_last`` says: vmap cannot batch a channels-last copy."""
    nchw = replace(objective, channels_last=False)

    def loss(w: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor):
        logits = nchw.logits(w, xb)
        per_record = nn.functional.cross_entropy(logits, yb, reduction="none")
        return (per_record * mask).sum() / mask.sum(), logits

    return loss


def _train_chunk(trainer, objective, params, data, generators) -> list[LocalResult]:
    """Clients ordered by step count, most first: at step k the active ones are a prefix."""
    n, device = len(data), params.device
    sizes = [y.shape[0] for _, y in data]
    steps = [trainer.num_steps(size) for size in sizes]
    rates = [trainer.local_lr(size) for size in sizes]
    lr = rates[0] if len(set(rates)) == 1 else torch.tensor(rates, device=device)[:, None]
    xs, ys = _padded_stack([x for x, _ in data]), _padded_stack([y for _, y in data])

    step = vmap(grad_and_value(_masked_loss(objective), has_aux=True))
    w, buf = params.expand(n, -1).clone(), None
    loss_sum = torch.zeros(n, dtype=torch.float64, device=device)
    correct = torch.zeros(n, dtype=torch.int64, device=device)
    seen = torch.zeros(n, dtype=torch.int64, device=device)
    draws = [trainer.batches(size, g) for size, g in zip(sizes, generators, strict=True)]
    for k in range(steps[0]):
        m = sum(s > k for s in steps)  # clients still training: a prefix
        indices = [next(draws[i]) for i in range(m)]
        index, mask = _padded_indices(indices, device)
        rows = torch.arange(m, device=device)[:, None]
        xb, yb = xs[rows, index], ys[rows, index]
        g, (batch_loss, logits) = step(w[:m], xb, yb, mask)
        lr_m = lr if isinstance(lr, float) else lr[:m]
        _, new_buf = trainer.descend(w[:m], g, None if buf is None else buf[:m], lr_m)
        if buf is None and new_buf is not None:
            buf = torch.zeros_like(w)
            buf[:m] = new_buf
        counts = mask.sum(1).long()
        loss_sum[:m] += batch_loss.double() * counts
        correct[:m] += ((logits.argmax(-1) == yb) & mask.bool()).sum(1)
        seen[:m] += counts
    objective.grad_evals += sum(steps)
    totals = zip(loss_sum.tolist(), correct.tolist(), seen.tolist(), strict=True)  # one copy each
    return [
        LocalResult(w[i], steps[i], loss, hits, count, steps[i], rate)
        for i, (rate, (loss, hits, count)) in enumerate(zip(rates, totals, strict=True))
    ]


def _padded_indices(indices: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[m, B]`` record indices padded with 0, ``[m, B]`` float mask of the real ones)."""
    lengths = [i.shape[0] for i in indices]
    width = max(lengths)
    if min(lengths) == width:
        index = torch.stack(indices).to(device)
        return index, torch.ones(index.shape, device=device)
    index = torch.zeros((len(indices), width), dtype=torch.int64, device=device)
    mask = torch.zeros((len(indices), width), device=device)
    for row, (i, length) in enumerate(zip(indices, lengths, strict=True)):
        index[row, :length] = i
        mask[row, :length] = 1.0
    return index, mask
