"""Many clients' local SGD in one set of kernels: ``torch.func.vmap`` over stacked parameters.

``train_clients`` is ``LocalTrainer.train`` for n clients at once. Each client draws its own
mini-batch indices from its own generator, exactly as the sequential path does, so the batches,
the number of steps and the learning rate are the same; the K steps of all n clients then run
as K vmapped steps on an ``[n, d]`` parameter matrix (a linear layer becomes one batched matrix
product, a convolution a grouped one). The weights equal the sequential path's up to float
rounding (batched kernels sum in another order); ``tests/test_vectorized.py`` checks it.

Vectorised where it is the same computation (``vectorizable``): the plain SGD gradient (no SAM,
PGN or per-step DP-SGD noise), no regularizers, no control-variate correction, no data
augmentation, no dropout in the model, and every client of the batch with the same number of
records (so every step has the same batch size across clients). Momentum and weight decay are
vectorised. Anything else trains sequentially. Clients are processed in chunks whose parameter
matrices stay under ``MAX_CHUNK_FLOATS`` (the weights, gradients and momentum of a chunk).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from algorithms.local import LocalResult, LocalTrainer, ModelObjective, SgdGradient

MAX_CHUNK_FLOATS = 32 * 2**20  # 128 MiB of float32 per [chunk, d] matrix


def vectorizable(trainer: LocalTrainer, objective: ModelObjective, sizes: list[int]) -> bool:
    """Whether ``train_clients`` computes exactly what ``trainer.train`` would, per client."""
    dropout = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
    has_dropout = any(isinstance(m, dropout) for m in objective.model.modules())
    return (
        len(sizes) > 1
        and len(set(sizes)) == 1
        and type(trainer.gradient) is SgdGradient
        and not trainer.regularizers
        and objective.augment is None
        and not has_dropout
    )


def train_clients(
    trainer: LocalTrainer,
    objective: ModelObjective,
    params: torch.Tensor,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    generators: list[torch.Generator],
) -> list[LocalResult]:
    """``[trainer.train(objective, params, x, y, g) for (x, y), g in ...]``, vectorised."""
    chunk = max(1, MAX_CHUNK_FLOATS // params.numel())
    results: list[LocalResult] = []
    for start in range(0, len(data), chunk):
        stop = start + chunk
        results += _train_chunk(
            trainer, objective, params, data[start:stop], generators[start:stop]
        )
    return results


def _train_chunk(trainer, objective, params, data, generators) -> list[LocalResult]:
    n, num_records = len(data), len(data[0][1])
    lr = trainer.local_lr(num_records)
    xs = torch.stack([x for x, _ in data])  # [n, records, ...]
    ys = torch.stack([y for _, y in data])
    rows = torch.arange(n, device=params.device)[:, None]

    def loss(w: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor):
        logits = functional_call(objective.model, objective.layout.unflatten(w), (xb,))
        return nn.functional.cross_entropy(logits, yb), logits

    step = vmap(grad_and_value(loss, has_aux=True))
    w = params.expand(n, -1).clone()
    buf = None
    loss_sum = torch.zeros(n, dtype=torch.float64, device=params.device)
    correct = torch.zeros(n, dtype=torch.int64, device=params.device)
    steps = seen = 0
    draws = [trainer.batches(num_records, g) for g in generators]
    for indices in zip(*draws, strict=True):
        index = torch.stack(indices).to(params.device)  # [n, B]: each client's own draw
        xb, yb = xs[rows, index], ys[rows, index]
        g, (batch_loss, logits) = step(w, xb, yb)
        w, buf = trainer.descend(w, g, buf, lr)
        steps += 1
        loss_sum += batch_loss.double() * index.shape[1]
        correct += (logits.argmax(-1) == yb).sum(1)
        seen += index.shape[1]
    objective.grad_evals += steps * n
    return [
        LocalResult(w[i], steps, float(loss_sum[i]), int(correct[i]), seen, steps, lr)
        for i in range(n)
    ]
