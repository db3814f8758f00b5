"""Shard-store scale: a 100,000-client synthetic store builds, opens in < 1 s, reads zero-copy.

Builds DP-SCAFFOLD's synthetic(1, 1) benchmark with ``--clients`` natural users (``--samples``
rows each, 80% train) into a shard store, then measures, in a fresh process state:

* ``open_seconds``: ``ShardStore.open`` (manifest + offsets index; median of 5);
* ``python_objects_created_by_open``: growth of ``gc.get_objects()`` across an open — O(1) in the
  number of clients (the offsets are one NumPy array, the manifest has no per-client entry);
* ``client_read_us``: median time to read one random client's rows (x, y), and whether the
  arrays are read-only views of the memory map (zero-copy);

side by side with the plain way many simulators keep client data: a pickled Python list of
per-client NumPy arrays (``baseline_pickle_*``; unpickled from bytes in memory, so the file
read such a loop also pays is left out), which must be loaded whole, creating several Python
objects per client. JSON to ``benchmarks/results/store_scale.json``; ``checks`` holds the
issue's targets (open < 1 s, O(1) objects, zero-copy) as booleans.

With ``--s3 s3://BUCKET/PREFIX`` (the AWS variables as for a run, e.g. ``AWS_ENDPOINT_URL`` of
a local S3-compatible server) the store is also uploaded there and read as a host of
``--hosts`` reads it (``object_store``): its pinned clients' rows by byte ranges
(``ShardStore.clients``), against fetching the whole training table, and a run of neighbouring
clients of the same size.

    uv run python -m benchmarks.store_scale [--clients 100000] [--samples 10] [--out PATH]
        [--s3 s3://BUCKET/PREFIX --hosts 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pickle
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from actors.scheduling import pin_clients
from benchmarks import write_report
from cluster.config import SyntheticConfig
from datasets import locations
from datasets.sources import build_store
from datasets.store import MANIFEST, ShardStore


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_object_store(store: ShardStore, uri: str, hosts: int) -> dict:
    """``store`` uploaded to ``uri`` and read as one host of ``hosts`` reads it (seconds, one
    try each: the first read of each is the one a host makes)."""
    remote_location = locations.parse_location(uri)
    locations.check_access(remote_location)
    start = time.perf_counter()
    locations.upload_folder(store.path, remote_location, last=MANIFEST)
    upload_seconds = time.perf_counter() - start
    remote = ShardStore.open(remote_location)
    hosted = pin_clients(remote.client_sizes, hosts)[0]

    def seconds(read) -> float:
        start = time.perf_counter()
        read()
        return time.perf_counter() - start

    x_row = np.dtype(store.manifest["x_dtype"]).itemsize * math.prod(store.manifest["x_shape"])
    share = remote.client_sizes[hosted].sum() * (x_row + 8)  # x and the int64 label
    neighbours = list(range(len(hosted)))
    return {
        "uri": uri,
        "hosts": hosts,
        "upload_seconds": round(upload_seconds, 2),
        "host_clients": len(hosted),
        "host_share_bytes": int(share),
        "train_table_bytes": (store.path / "train.arrow").stat().st_size,
        "host_ranged_read_seconds": seconds(lambda: remote.clients(hosted)),
        "neighbouring_clients_ranged_read_seconds": seconds(lambda: remote.clients(neighbours)),
        "whole_table_read_seconds": seconds(
            lambda: locations.read_bytes(remote_location / "train.arrow")
        ),
    }


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
    # The baseline is the pickled list a plain loop would keep, serialised here in memory: the
    # bytes are this function's own, never a file, so nothing a user hands in is unpickled.
    blob = pickle.dumps([(np.array(c.x), np.array(c.y)) for c in per_client], protocol=5)
    del per_client
    gc.collect()
    before = len(gc.get_objects())
    loaded = pickle.loads(blob)
    baseline_objects = len(gc.get_objects()) - before
    del loaded

    def load_pickle():
        pickle.loads(blob)

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
    parser.add_argument("--s3", help="also upload the store to this s3:// prefix and read it")
    parser.add_argument("--hosts", type=int, default=8, help="with --s3: hosts sharing it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.clients, args.samples, Path(tmp))
        if args.s3:
            store = ShardStore.open(Path(tmp) / "store")
            result["object_store"] = measure_object_store(store, args.s3, args.hosts)
    write_report(result, args.out)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
