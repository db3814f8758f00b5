"""Shard-store scale: a 100,000-client synthetic store builds, opens in < 1 s, reads zero-copy.

Builds DP-SCAFFOLD's synthetic(1, 1) benchmark with ``--clients`` natural users (``--samples``
rows each, 80% train) into a shard store, then measures, in a fresh process state:

* ``open_seconds``: ``ShardStore.open`` (manifest + offsets index; median of 5);
* ``python_objects_created_by_open``: growth of ``gc.get_objects()`` across an open — O(1) in the
  number of clients (the offsets are one NumPy array, the manifest has no per-client entry);
* ``client_read_us``: median time to read one random client's rows (x, y), and whether the
  arrays are read-only views of the memory map (zero-copy);

side by side with the plain way many simulators keep client data: a pickled Python list of
per-client NumPy arrays (``baseline_pickle_*``), which must be loaded whole, creating several
Python objects per client. JSON to ``benchmarks/results/store_scale.json``; ``checks`` holds the
issue's targets (open < 1 s, O(1) objects, zero-copy) as booleans.

    uv run python -m benchmarks.store_scale [--clients 100000] [--samples 10] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from cluster.config import SyntheticConfig
from datasets.sources import build_store
from datasets.store import ShardStore


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(clients: int, samples: int, workdir: Path) -> dict:
    params = {**asdict(SyntheticConfig()), "samples_per_user": samples, "num_users": clients}
    start = time.perf_counter()
    store = build_store(workdir / "store", "synthetic", params, {"method": "natural"}, clients, 0)
    build_seconds = time.perf_counter() - start
    size_bytes = sum(p.stat().st_size for p in store.path.iterdir())

    gc.collect()
    before = len(gc.get_objects())
    opened = ShardStore.open(store.path)
    objects = len(gc.get_objects()) - before
    open_seconds = _median_seconds(lambda: ShardStore.open(store.path), 5)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, clients, size=2000)
    opened.client(0)  # map the file once
    reads = []
    for cid in ids:
        t = time.perf_counter()
        rows = opened.client(int(cid))
        reads.append(time.perf_counter() - t)
    zero_copy = not rows.x.flags.writeable and not rows.x.flags.owndata

    per_client = [opened.client(c) for c in range(clients)]
    # The baseline is the pickled list a plain loop would keep. This file is written just above,
    # in the benchmark's own temporary directory, and never comes from a user.
    baseline = workdir / "clients.pkl"
    with open(baseline, "wb") as f:
        pickle.dump([(np.array(c.x), np.array(c.y)) for c in per_client], f, protocol=5)
    del per_client
    gc.collect()
    before = len(gc.get_objects())
    with open(baseline, "rb") as f:
        loaded = pickle.load(f)
    baseline_objects = len(gc.get_objects()) - before
    del loaded

    def load_pickle():
        with open(baseline, "rb") as f:
            pickle.load(f)

    baseline_seconds = _median_seconds(load_pickle, 3)
    return {
        "clients": clients,
        "rows_per_client": samples,
        "build_seconds": round(build_seconds, 2),
        "store_bytes": size_bytes,
        "manifest_bytes": (store.path / "manifest.json").stat().st_size,
        "open_seconds": open_seconds,
        "python_objects_created_by_open": objects,
        "client_read_us_median": 1e6 * statistics.median(reads),
        "client_read_zero_copy": bool(zero_copy),
        "baseline_pickle_load_seconds": baseline_seconds,
        "baseline_pickle_python_objects": baseline_objects,
        "checks": {
            "open_under_1s": open_seconds < 1.0,
            "open_objects_O(1)": objects < 1000,
            "zero_copy_reads": bool(zero_copy),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/store_scale.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.clients, args.samples, Path(tmp))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
