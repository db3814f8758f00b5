"""Workload S's plain PyTorch loop: DP-FedAvg at sample level as a researcher writes it.

Workload S (``benchmarks.workloads``): synthetic(1, 1) logistic regression, 10,000 clients × 50
training rows, fixed cohorts of 1,000, K = 10 DP-SGD steps of batch B = 10 drawn afresh, lr 0.1,
C = 1, σ_g = 1, replace-one adjacency (κ = 2). Per client and step::

    g_j = ∇ℓ(w; x_j, y_j)                 torch.func: vmap(grad) over the batch
    G   = (Σ_j g_j·min(1, C/‖g_j‖) + κCσ_g·ξ_k) / B
    w  ← w − η·G

with ξ_k the client's N(0, I_d) noise from its ``SAMPLE_NOISE`` stream, drawn in blocks of
R = ``noise_block_rows(d, K)`` rows as the steps reach them (``algorithms.dpsgd``: here R = K,
one [K, d] draw), and the batches from its ``LOCAL_TRAINING`` stream, so the loop computes what
the project does, one client at a time; the server adds the mean of the deltas (η_g = 1).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from actors.client_host import build_model, evaluate_batches
from algorithms.dpsgd import noise_block_rows
from algorithms.layout import ParamLayout
from algorithms.local import ModelObjective
from algorithms.rng import Purpose, stream_seed, torch_generator
from cluster.config import ExperimentConfig
from cluster.runtime.cohort import sample_cohort
from datasets.tasks import TASKS


def plain_dp_sgd_loop(config: ExperimentConfig, store) -> tuple[torch.Tensor, dict]:
    """The loop of the module docstring; (final weights, timing as ``plain_loop``'s)."""
    start = time.perf_counter()
    a, local, task = config.algorithm, config.algorithm.local, TASKS[config.task]
    clients = [_tensors(task, store.client(cid)) for cid in range(store.num_clients)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(config.seed, Purpose.MODEL_INIT))
        model = build_model(store, config.task)
    shapes = {name: p.shape for name, p in model.named_parameters()}

    def loss(params, x, y):
        logits = functional_call(model, params, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, y.unsqueeze(0))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    kappa = 1.0 if a.adjacency == "add_remove" else 2.0  # replace-one, the default (None)
    std = kappa * a.clip_norm * a.noise_multiplier
    w_global = nn.utils.parameters_to_vector(model.parameters()).detach()
    block = noise_block_rows(w_global.numel(), local.local_steps)  # noise rows drawn at once
    startup = time.perf_counter() - start
    round_seconds = []
    for r in range(config.rounds):
        t0 = time.perf_counter()
        cohort = sample_cohort("fixed", store.num_clients, config.cohort.size, config.seed, r)
        total = torch.zeros_like(w_global)
        for cid in cohort.tolist():
            x, y = clients[cid]
            batches = torch_generator(config.seed, r, cid, Purpose.LOCAL_TRAINING)
            noise_stream = torch_generator(config.seed, r, cid, Purpose.SAMPLE_NOISE)
            b = min(local.batch_size, len(y))
            w = w_global.clone()
            for k in range(local.local_steps):
                if k % block == 0:
                    shape = (min(block, local.local_steps - k), w_global.numel())
                    noise = torch.randn(shape, generator=noise_stream)
                idx = torch.randperm(len(y), generator=batches)[:b]
                params = dict(zip(shapes, _views(w, shapes), strict=True))
                grads = per_example(params, x[idx], y[idx])
                rows = torch.cat([grads[name].reshape(b, -1) for name in shapes], dim=1)
                scale = (a.clip_norm / rows.norm(dim=1, keepdim=True)).clamp(max=1.0)
                w -= local.lr * ((rows * scale).sum(0) + std * noise[k % block]) / b
            total += w - w_global
        w_global = w_global + a.server_lr * total / config.cohort.size
        round_seconds.append(time.perf_counter() - t0)
    rounds_done = time.perf_counter()
    test = store.test_rows()
    objective = ModelObjective(model, ParamLayout.of(model))
    scores = evaluate_batches(objective, w_global, [_tensors(task, test)])
    accuracy = scores.correct / scores.count
    return w_global, loop_timing(start, startup, round_seconds, rounds_done, accuracy)


def loop_timing(
    start: float, startup: float, round_seconds: list[float], rounds_done: float, accuracy: float
) -> dict:
    """A plain loop's timing from its clock readings (now: the end)."""
    end = time.perf_counter()
    return {
        "wall_seconds": end - start,
        "startup_seconds": startup,
        "end_seconds": end - rounds_done,
        "rounds_seconds": sum(round_seconds),
        "seconds_per_round": statistics.median(round_seconds[1:]),
        "final_test_accuracy": accuracy,
    }


def _views(flat: torch.Tensor, shapes: dict[str, torch.Size]) -> list[torch.Tensor]:
    """``flat`` cut into the model's tensors (views, in ``shapes``' order)."""
    views, start = [], 0
    for shape in shapes.values():
        size = shape.numel()
        views.append(flat[start : start + size].view(shape))
        start += size
    return views


def _tensors(task, rows) -> tuple[torch.Tensor, torch.Tensor]:
    return task.preprocess(torch.tensor(rows.x)), torch.tensor(rows.y)
