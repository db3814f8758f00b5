"""Where a round's CPU goes: per-thread CPU time per round of a workload on the local executor.

A round on ``c`` cores cannot take less than its total CPU time divided by ``c``; this reads
that floor off the process's threads (``/proc/self/task/*/stat``: user + system clock ticks)
between two rounds' records, so a per-round target can be checked against what the cores can do
before anything is optimised; the plain loop (``benchmarks.workloads.plain_loop``, torch's
default threads) runs the same rounds right after, for the floor's ratio to its median round.
Threads are named by role: the host threads (``client-host_*``; a single host trains on the
driver's thread), the driver's main thread, and the rest (the background ε and server-noise
threads; one that ends between the two rounds is not counted, which these long-lived threads
do not). Tracking is off (the MLflow process is another process). Linux only.

Usage (repository root)::

    uv run python -m benchmarks.round_cpu [--workload A] [--first 5] [--last 25] [--set K=V ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.workloads import EXECUTORS, plain_loop, workload_config
from cluster.runtime.experiment import run_experiment
from cluster.runtime.store import open_store

TASKS = Path("/proc/self/task")


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of each of this process's threads, by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir(TASKS):
        try:
            stat = (TASKS / tid / "stat").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the name, which may hold spaces
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def _roles() -> dict[int, str]:
    main = threading.main_thread().native_id
    return {
        t.native_id: "driver" if t.native_id == main else t.name
        for t in threading.enumerate()
        if t.native_id is not None
    }


def round_cpu(workload: str, overrides: list[str], first: int, last: int) -> dict:
    """Per-round CPU milliseconds by thread role between the records of rounds ``first`` and
    ``last`` (1-based), and the floor they imply on this machine's cores."""
    local = EXECUTORS["local"]  # one host thread per core; overrides may change that
    config = workload_config(
        workload, [*local, *overrides, "tracking.enabled=false", f"rounds={last}"]
    )
    store, _ = open_store(config)  # built outside the measurement
    marks: dict[int, tuple[float, dict[int, float], dict[int, str]]] = {}

    def on_round(record) -> None:
        if record.round in (first, last):
            marks[record.round] = (time.perf_counter(), thread_cpu_seconds(), _roles())

    run_experiment(config, on_round=on_round)
    (t0, cpu0, _), (t1, cpu1, roles) = marks[first], marks[last]
    rounds = last - first
    by_role: dict[str, float] = {}
    for tid, seconds in cpu1.items():
        role = roles.get(tid, "other")
        role = "host" if role.startswith("client-host") else role
        role = role if role in ("host", "driver") else "other"
        by_role[role] = by_role.get(role, 0.0) + (seconds - cpu0.get(tid, 0.0)) * 1e3 / rounds
    total = sum(by_role.values())
    cores = len(os.sched_getaffinity(0))
    loop = plain_loop(config, store)[1]["seconds_per_round"] * 1e3  # same machine, same minute
    return {
        "benchmark": "round_cpu",
        "workload": workload,
        "rounds": [first, last],
        "host_threads": config.executor.num_actors,
        "cores": cores,
        "cpu_ms_per_round": {role: round(ms, 1) for role, ms in sorted(by_role.items())},
        "total_cpu_ms_per_round": round(total, 1),
        "floor_ms_per_round": round(total / cores, 1),
        "wall_ms_per_round": round((t1 - t0) * 1e3 / rounds, 1),
        "plain_loop_ms_per_round": round(loop, 1),
        "floor_vs_plain_loop": round(total / cores / loop, 3),
        "wall_vs_plain_loop": round((t1 - t0) * 1e3 / rounds / loop, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.round_cpu", description=__doc__)
    parser.add_argument("--workload", choices=["A", "B"], default="A")
    parser.add_argument("--first", type=int, default=5, help="first round measured (1-based)")
    parser.add_argument("--last", type=int, default=25, help="last round, also the run's length")
    parser.add_argument("--set", action="append", default=[], help="config override")
    args = parser.parse_args(argv)
    if not 1 <= args.first < args.last:
        parser.error(f"--first {args.first} --last {args.last}: need 1 <= first < last")
    with tempfile.TemporaryDirectory(prefix="dpfl-round-cpu-") as tmp:
        os.environ.setdefault("DPFL_STORE_ROOT", str(Path(tmp) / "shards"))
        os.environ.setdefault("DPFL_CHECKPOINT_DIR", str(Path(tmp) / "checkpoints"))
        line = round_cpu(args.workload, args.set, args.first, args.last)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
