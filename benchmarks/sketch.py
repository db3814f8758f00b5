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
"""

from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=6_573_120)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--cols", type=int, default=500_000)
    parser.add_argument("--k", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/sketch.json")
    args = parser.parse_args(argv)
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
