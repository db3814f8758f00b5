"""One host's share of a workload's round, alone: the CPU time of ``ClientHost.run_round``.

Issue 32's per-client host costs (the Python work between the model's kernels that grows with
the cohort) without the driver, the executor or other processes: a host of the first
``--hosted`` clients of the workload's store (default: half, as one of ``benchmarks.workloads``'
two hosts) runs the rounds' cohorts' members it hosts (≈ cohort/2) at one intra-op thread, as
executors run hosts. Each round's CPU time is this thread's (``time.thread_time``), so that
other processes on a loaded machine slow it less than the wall time; round 1 (index 0) warms up
and is left out. ``--profile``: cProfile of the measured rounds, the functions taking the most
time themselves (cProfile's own overhead inflates the Python-heavy ones).

Usage (repository root)::

    uv run python -m benchmarks.host_round [--workload B] [--rounds 9] [--profile 25]
        [--set K=V ...]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

from actors.client_host import Broadcast, ClientHost
from benchmarks.workloads import workload_config
from cluster.runtime.cohort import sample_cohort
from cluster.runtime.executors import torch_threads
from cluster.runtime.experiment import kernels
from cluster.runtime.initial_state import initial_params
from cluster.runtime.store import open_store


def host_round_cpu(workload: str, overrides: list[str], rounds: int, profile: int) -> dict:
    """CPU milliseconds of each measured round of one host (see the module docstring)."""
    config = workload_config(workload, [*overrides, "tracking.enabled=false"])
    store, _ = open_store(config)
    hosted = store.num_clients // 2
    algorithm = config.build_algorithm()
    host = ClientHost(
        store.location,
        config.task,
        algorithm,
        config.seed,
        list(range(hosted)),
        kernels=kernels(config),
    )
    _, params = initial_params(config, store)
    params = params.numpy()
    profiler = cProfile.Profile()
    cpu_ms, clients = [], []
    for r in range(rounds):
        cohort = sample_cohort(
            config.cohort.sampling, store.num_clients, config.cohort.size, config.seed, r
        )
        members = sorted(c for c in cohort.tolist() if c < hosted)
        if r and profile:
            profiler.enable()
        start = time.thread_time()
        host.run_round(r, Broadcast(params), members, float(config.cohort.size))
        if r:
            cpu_ms.append((time.thread_time() - start) * 1e3)
            clients.append(len(members))
        profiler.disable()
    if profile:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(profile)
    return {
        "benchmark": "host_round",
        "workload": workload,
        "hosted_clients": hosted,
        "clients_per_round": statistics.median(clients),
        "cpu_ms_per_round": round(statistics.median(cpu_ms), 1),
        "cpu_ms_per_round_min": round(min(cpu_ms), 1),
        "cpu_us_per_client": round(statistics.median(cpu_ms) * 1e3 / statistics.median(clients)),
        "profiled": bool(profile),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_round", description=__doc__)
    parser.add_argument("--workload", choices=["A", "B", "S"], default="B")
    parser.add_argument("--rounds", type=int, default=9, help="rounds run; the first warms up")
    parser.add_argument("--profile", type=int, default=0, help="cProfile: functions listed")
    parser.add_argument("--set", action="append", default=[], help="config override")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (the first warms up)")
    with tempfile.TemporaryDirectory(prefix="dpfl-host-round-") as tmp:
        os.environ.setdefault("DPFL_STORE_ROOT", str(Path(tmp) / "shards"))
        with torch_threads(1):
            line = host_round_cpu(args.workload, args.set, args.rounds, args.profile)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
