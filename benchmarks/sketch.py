"""Count-sketch throughput at DPSFL's size: d = 6,573,120 (ResNet9), 5 × 500,000, k = 50,000.

    uv run python -m benchmarks.sketch [--dim 6573120] [--rows 5] [--cols 500000] [--k 50000]

Times, per operation, the median of ``--repeats`` runs (after one warm-up; the hashes are
computed once per process and timed separately) of ``algorithms.sketch.CountSketch``:

- ``insert``: S(x) of a dense float32 x (what each client does);
- ``unsketch_top_k``: the median estimate of all d coordinates and their top-k (the server);
- ``sparse_insert``: S(Δ) of the k-sparse Δ (the server's error feedback);

next to the plain PyTorch a researcher would otherwise run on the dense vector, ``dense_top_k``
(``torch.topk`` of |x|). Reports coordinates per second and the ratio to the dense top-k, one
JSON line per device, and writes them to ``benchmarks/results/sketch.json``.

    uv run python -m benchmarks.sketch --sensitivity [--dim 6573120] [--rows 5] [--cols 500000]

prints instead the L2 sensitivity of the sketch's hashes (seed 42, ``--seed``), no timing:
the fullest bucket of every row (maxload_j), the bound ‖S(x)‖_F ≤ √(Σ_j maxload_j)·‖x‖₂
against DPSFL's C·√l, what the unit vector on row 0's fullest bucket attains, and the ratio of
the counter noise sized to that bound to the dense variant's σC·√(d/m) (``sensitivity_report``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from algorithms.sketch import CountSketch


def _median_seconds(fn, repeats: int, device: str) -> float:
    def timed() -> float:
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed()  # warm-up
    return statistics.median(timed() for _ in range(repeats))


def measure(dim: int, rows: int, cols: int, k: int, repeats: int, device: str) -> dict:
    sketch = CountSketch(dim, rows, cols, seed=42)
    start = time.perf_counter()
    sketch.hashes(device)
    hash_seconds = time.perf_counter() - start
    x = torch.randn(dim, generator=torch.Generator().manual_seed(0)).to(device)
    table = sketch.sketch(x)
    indices, values = sketch.top_k(table, k)
    recall = float(torch.isin(indices, torch.topk(x.abs(), k).indices).float().mean())
    seconds = {
        "insert": _median_seconds(lambda: sketch.sketch(x), repeats, device),
        "unsketch_top_k": _median_seconds(lambda: sketch.top_k(table, k), repeats, device),
        "sparse_insert": _median_seconds(
            lambda: sketch.accumulate(sketch.zeros(device=device), values, indices),
            repeats,
            device,
        ),
        "dense_top_k": _median_seconds(lambda: torch.topk(x.abs(), k), repeats, device),
    }
    return {
        "benchmark": "sketch",
        "device": device,
        "dim": dim,
        "rows": rows,
        "cols": cols,
        "k": k,
        "threads": torch.get_num_threads(),
        "hash_setup_s": round(hash_seconds, 3),
        "seconds": {name: round(s, 5) for name, s in seconds.items()},
        "coords_per_s": {name: round(dim / s) for name, s in seconds.items()},
        "ratio_to_dense_top_k": {
            name: round(s / seconds["dense_top_k"], 2)
            for name, s in seconds.items()
            if name != "dense_top_k"
        },
        "top_k_recall_gaussian_vector": round(recall, 4),
        "upload_compression": round(dim / (rows * cols), 2),
    }


def sensitivity_report(dim: int, rows: int, cols: int, seed: int = 42) -> dict:
    """The count sketch's L2 sensitivity for clip norm C = 1, from its actual hashes.

    ``max_loads``: maxload_j, the most coordinates hashed to one counter of row j.
    ``bound``: √(Σ_j maxload_j), with ‖S(x)‖_F ≤ bound·‖x‖₂ (Cauchy–Schwarz per bucket);
    ``replace_one_bound`` = 2·bound (two clipped vectors differ by ≤ 2C) against
    ``paper_sensitivity`` = √l (one coordinate changed by C), their ratio ``paper_shortfall``.
    ``adversarial_norm``: ‖S(v)‖_F for the unit v spread with matching signs over row 0's
    fullest bucket (√maxload₀ from row 0 alone; a lower bound on the sensitivity).
    ``mean_load`` = d/m; the dense variant's noise on a counter has std σC·√(load) ≈ σC·√(d/m),
    and ``noise_ratio`` = bound/√(d/m) is how much more noise per counter sizing Gaussian noise
    on the counters to the bound would take.
    """
    sketch = CountSketch(dim, rows, cols, seed)
    max_loads = [int(load) for load in sketch.max_loads()]
    bound = math.sqrt(sum(max_loads))
    adversarial = sketch.sketch(sketch.adversarial_unit_vector(0))
    return {
        "dim": dim,
        "rows": rows,
        "cols": cols,
        "seed": seed,
        "max_loads": max_loads,
        "sum_max_loads": sum(max_loads),
        "mean_load": dim / cols,
        "bound": bound,
        "replace_one_bound": 2 * bound,
        "paper_sensitivity": math.sqrt(rows),
        "paper_shortfall": 2 * bound / math.sqrt(rows),
        "adversarial_norm": float(torch.linalg.vector_norm(adversarial)),
        "noise_ratio": bound / math.sqrt(dim / cols),
    }


def sensitivity_lines(report: dict) -> list[str]:
    """``sensitivity_report`` in words, one line each."""
    r = report
    return [
        f"d = {r['dim']:,}, {r['rows']} × {r['cols']:,}, seed {r['seed']}: mean load "
        f"d/m = {r['mean_load']:.2f}",
        f"fullest buckets (maxload_j): {', '.join(map(str, r['max_loads']))}; "
        f"Σ = {r['sum_max_loads']}",
        f"‖S(x)‖_F ≤ √{r['sum_max_loads']}·‖x‖ = {r['bound']:.2f}·‖x‖; replace-one: "
        f"2C·√{r['sum_max_loads']} = {r['replace_one_bound']:.1f}·C against the paper's "
        f"C·√{r['rows']} = {r['paper_sensitivity']:.2f}·C ({r['paper_shortfall']:.1f}×)",
        f"unit vector on row 0's fullest bucket: ‖S(v)‖_F = {r['adversarial_norm']:.2f}",
        f"noise per counter: dense σC·√{r['mean_load']:.1f} against σC·√{r['sum_max_loads']} "
        f"sized to the bound ({r['noise_ratio']:.1f}×)",
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=6_573_120)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--cols", type=int, default=500_000)
    parser.add_argument("--k", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/sketch.json")
    parser.add_argument("--seed", type=int, default=42, help="the hashes' seed (--sensitivity)")
    parser.add_argument(
        "--sensitivity", action="store_true", help="print the hashes' L2 sensitivity; no timing"
    )
    args = parser.parse_args(argv)
    if args.sensitivity:
        report = sensitivity_report(args.dim, args.rows, args.cols, args.seed)
        print("\n".join(sensitivity_lines(report)))
        print(json.dumps(report), flush=True)
        return
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results = []
    for device in devices:
        result = measure(args.dim, args.rows, args.cols, args.k, args.repeats, device)
        print(json.dumps(result), flush=True)
        results.append(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
