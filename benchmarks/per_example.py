"""Per-example gradients, the cost centre of sample-level DP: torch.func vs Opacus vs a loop.

    uv run python -m benchmarks.per_example [--models logreg mlp_pca60 mnist_cnn] [--batches 16]

Three ways to get the B × d matrix of per-example gradients of the cross-entropy on one batch:
the project's paths (``algorithms.dpsgd.per_example_gradients``: ``vmap(grad(·))`` over
``functional_call``, the vmapped forward over expanded parameters with one autograd pass, and
``auto``, the one a run uses: per-layer outer products for Linear-only models, else one of the
two), Opacus's ``GradSampleModule`` hooks, and a plain loop of
B autograd passes. All are checked to agree before timing. Writes JSON (median ms per batch
and the ratio of ``auto`` to Opacus) to ``benchmarks/results/per_example.json``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from opacus import GradSampleModule

from algorithms.dpsgd import per_example_gradients
from algorithms.layout import ParamLayout
from algorithms.local import ModelObjective
from benchmarks import write_report
from models import build_model

METHODS = ("auto", "expanded", "vmap_grad")  # auto: the project's choice per model size
SHAPES = {"logreg": ((40,), 10), "mlp_pca60": ((60,), 10), "mnist_cnn": ((1, 28, 28), 10)}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _opacus(gsm: GradSampleModule, x, y) -> torch.Tensor:
    gsm.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(gsm(x), y, reduction="sum")
    loss.backward()
    return torch.cat([p.grad_sample.reshape(len(y), -1) for p in gsm.parameters()], dim=1)


def _loop(objective: ModelObjective, flat, x, y) -> torch.Tensor:
    return torch.stack(
        [objective.loss_and_grad(flat, x[j : j + 1], y[j : j + 1])[2] for j in range(len(y))]
    )


def measure(name: str, batch: int, repeats: int) -> dict:
    torch.manual_seed(0)
    shape, classes = SHAPES[name]
    model = build_model(name, shape, classes)
    objective = ModelObjective(model, ParamLayout.of(model))
    flat = ParamLayout.flatten(model)
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    reference = _opacus(gsm, x, y)
    max_diff = max(
        float((per_example_gradients(objective, flat, x, y, m)[2] - reference).abs().max())
        for m in METHODS
    )
    max_diff = max(max_diff, float((_loop(objective, flat, x, y) - reference).abs().max()))
    timings = {
        f"{m}_ms": _median_ms(lambda m=m: per_example_gradients(objective, flat, x, y, m), repeats)
        for m in METHODS
    }
    timings["opacus_ms"] = _median_ms(lambda: _opacus(gsm, x, y), repeats)
    timings["loop_ms"] = _median_ms(lambda: _loop(objective, flat, x, y), repeats)
    return {
        "model": name,
        "batch": batch,
        "parameters": flat.numel(),
        **timings,
        "auto_over_opacus": timings["auto_ms"] / timings["opacus_ms"],
        "max_abs_diff": max_diff,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["logreg", "mlp_pca60", "mnist_cnn"])
    parser.add_argument("--batches", nargs="+", type=int, default=[16, 64, 160])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/per_example.json")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Full backward hook")
    rows = [measure(m, b, args.repeats) for m in args.models for b in args.batches]
    for r in rows:
        print(
            f"{r['model']:<10} B={r['batch']:<4} auto {r['auto_ms']:8.2f} | expanded "
            f"{r['expanded_ms']:8.2f} | vmap(grad) {r['vmap_grad_ms']:8.2f} | opacus "
            f"{r['opacus_ms']:8.2f} | loop {r['loop_ms']:8.2f} ms | auto/opacus "
            f"{r['auto_over_opacus']:.2f} | max diff {r['max_abs_diff']:.1e}"
        )
    result = {"benchmark": "per_example", "threads": torch.get_num_threads(), "results": rows}
    print(f"wrote {write_report(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
