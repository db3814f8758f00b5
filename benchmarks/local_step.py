"""One local SGD step on the paper models: the project's flat-vector path vs plain PyTorch.

For each model and batch size, three ways of doing the same step (cross-entropy on a random
batch, gradient, w ← w − η·g):

* ``plain_torch``: ``model(x)``, ``loss.backward()``, ``torch.optim.SGD.step()`` on the module's
  own parameters — what a hand-written loop does;
* ``project``: ``LocalTrainer``'s path, ``ModelObjective.loss_and_grad`` on one flat parameter
  vector (``functional_call`` over ``ParamLayout.unflatten`` views) and a flat update;
* ``per_slice_views``: the same with one slice view per tensor, the layout before it switched
  to a single ``split``: autograd then builds a full-size zero gradient for every tensor.

The flat path is what lets clipping, noise, sums and server rules be single vectorised ops; this
benchmark keeps its cost in view. Median of ``--repeats`` timed steps after ``--warmup``
(CUDA synchronised). The last two variants' gradients are checked equal to plain PyTorch's.

Usage (from the repository root)::

    uv run python -m benchmarks.local_step [--models mnist_cnn resnet18_gn] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from algorithms.layout import ParamLayout
from algorithms.local import ModelObjective
from models import MODELS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "local_step.json"
SHAPES = {
    "mnist_cnn": ((1, 28, 28), 10),
    "emnist_cnn": ((1, 28, 28), 62),
    "resnet10_gn": ((3, 32, 32), 10),
    "resnet18_gn": ((3, 32, 32), 10),
}
LR = 0.01


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(step: Callable[[], None], device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _slice_views(layout: ParamLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        name: flat[start:stop].view(shape)
        for name, shape, start, stop in zip(
            layout.names, layout.shapes, layout.offsets[:-1], layout.offsets[1:], strict=True
        )
    }


def bench_model(name: str, batch: int, device, warmup: int, repeats: int) -> dict:
    shape, classes = SHAPES[name]
    torch.manual_seed(0)
    model = MODELS[name](shape, classes).to(device)
    layout = ParamLayout.of(model)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    objective = ModelObjective(model, layout)
    flat = ParamLayout.flatten(model).to(device)

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def plain() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    state = {"w": flat.clone()}

    def project() -> None:
        _, _, g = objective.loss_and_grad(state["w"], x, y)
        state["w"] = state["w"] - LR * g

    def per_slice() -> None:
        w = state["w"].detach().requires_grad_(True)
        logits = functional_call(model, _slice_views(layout, w), (x,))
        (g,) = torch.autograd.grad(nn.functional.cross_entropy(logits, y), w)
        state["w"] = state["w"] - LR * g

    # Same gradient three ways, at the same point (before any timed step moves the module).
    reference = torch.autograd.grad(
        nn.functional.cross_entropy(model(x), y), list(model.parameters())
    )
    reference_flat = torch.cat([g.reshape(-1) for g in reference])
    _, _, g_project = objective.loss_and_grad(flat, x, y)
    w = flat.detach().requires_grad_(True)
    logits = functional_call(model, _slice_views(layout, w), (x,))
    (g_slice,) = torch.autograd.grad(nn.functional.cross_entropy(logits, y), w)

    row = {
        "model": name,
        "parameters": layout.size,
        "tensors": len(layout.names),
        "batch": batch,
        "grad_matches_plain": bool(
            torch.allclose(g_project, reference_flat, rtol=1e-4, atol=1e-6)
            and torch.allclose(g_project, g_slice, rtol=1e-5, atol=1e-7)
        ),
    }
    variants = {"plain_torch": plain, "project": project, "per_slice_views": per_slice}
    for label, step in variants.items():
        row[f"{label}_ms"] = round(1000 * _median_seconds(step, device, warmup, repeats), 3)
    row["project_over_plain"] = round(row["project_ms"] / row["plain_torch_ms"], 3)
    row["per_slice_over_plain"] = round(row["per_slice_views_ms"] / row["plain_torch_ms"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[4, 32])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for name in args.models:
        for batch in args.batches:
            row = bench_model(name, batch, device, args.warmup, args.repeats)
            print(json.dumps(row), flush=True)
            rows.append(row)
    report = {
        "benchmark": "local_step",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["grad_matches_plain"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
