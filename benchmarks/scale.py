"""Scale: workload B at 100,000 clients, cohort 1,000, 1,000 rounds — memory over the rounds.

Runs ``run_experiment`` (Ray, 2 actors × 1 CPU, MLflow on, as the CLI runs it) on workload B
(``benchmarks.workloads``: synthetic(1, 1) logistic regression, 50 training rows per client, 5
local steps of batch 10) with ``--clients`` clients, and records after every round the resident
memory (``VmRSS`` in ``/proc``) of the driver and of each actor (the processes Ray titles
``ray::ClientHostActor``). Reports, as one JSON line:

* ``store``: seconds to generate and write the shard store and the peak RSS of the process that
  does it (a child process, as ``python -m cluster partition`` would be: the run then opens an
  existing store, as every run after the first does);
* ``seconds_to_first_round``: from calling ``run_experiment`` to the end of round 1;
* ``driver_rss_mb``: at round 1, at the end, the peak over the rounds, and the least-squares
  slope over rounds ``--skip``..end in MB per 100 rounds (flat: ≈ 0);
* ``actor_rss_mb``: each actor's RSS at round 1 and at the end, and its largest value, and at
  the end the part that is its own (``RssAnon``) rather than pages of the memory-mapped store
  and libraries, which the actors and the page cache share (``RssFile``);
* ``seconds_per_round``: median after the first round.

    uv run python -m benchmarks.scale [--clients 100000] [--rounds 1000] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.workloads import workload_config
from cluster.runtime.experiment import run_experiment
from cluster.runtime.ray_runtime import disconnect
from cluster.runtime.store import open_store

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "scale.json"
ACTOR_TITLE = b"ray::ClientHostActor"


def rss_mb(pid: int | str = "self", field: str = "VmRSS") -> float:
    """A process's resident memory in MB from ``/proc``: ``VmRSS`` (all), ``VmHWM`` (its peak),
    ``RssAnon`` (its own pages), ``RssFile`` (file-backed: mapped files and libraries)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def actor_pids() -> list[int]:
    """Processes whose title is one of our actors (Ray sets it to ``ray::<class>``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(ACTOR_TITLE):
                    pids.append(int(entry.name))
            except OSError:  # exited meanwhile
                continue
    return sorted(pids)


def slope_per_100_rounds(samples: list[tuple[int, float]]) -> float:
    """Least-squares slope of (round, MB) in MB per 100 rounds."""
    xs, ys = [x for x, _ in samples], [y for _, y in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def _build(config, out) -> None:
    start = time.perf_counter()
    open_store(config)
    out.put({"build_seconds": time.perf_counter() - start, "peak_rss_mb": rss_mb("self", "VmHWM")})


def _build_in_child(config) -> dict:
    """Generate and write the store in a child process; its time and peak memory."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_build, args=(config, out))
    child.start()
    result = out.get()
    child.join()
    return result


def measure(clients: int, rounds: int, skip: int, overrides: list[str]) -> dict:
    config = workload_config(
        "B",
        [
            f"data.num_clients={clients}",
            f"rounds={rounds}",
            f"eval_every={max(1, rounds // 10)}",
            "executor.kind=ray",
            "executor.num_actors=2",
            "executor.cpus_per_actor=1",
            "executor.overlap_start=false",  # the driver holds no client's data: it is measured
            *overrides,
        ],
    )
    store = _build_in_child(config)

    driver: list[tuple[int, float]] = []
    actors: dict[int, list[float]] = {}
    own: dict[int, dict[str, float]] = {}
    first_round: list[float] = []

    def on_round(record) -> None:
        if not first_round:
            first_round.append(time.perf_counter() - begin)
        driver.append((record.round, rss_mb()))
        for pid in actor_pids():
            actors.setdefault(pid, []).append(rss_mb(pid))
            own[pid] = {"anon": rss_mb(pid, "RssAnon"), "file": rss_mb(pid, "RssFile")}
        if record.round % 50 == 0 or record.round == 1:
            print(f"round {record.round}: driver {driver[-1][1]:.0f} MB", flush=True)

    begin = time.perf_counter()
    outcome = run_experiment(config, on_round=on_round)
    seconds = [r.seconds for r in outcome.result.history]
    steady = [s for s in driver if s[0] > skip]
    return {
        "benchmark": "scale",
        "clients": clients,
        "cohort": config.cohort.size,
        "rounds": rounds,
        "store": store,
        "seconds_to_first_round": first_round[0],
        "seconds_per_round": statistics.median(seconds[1:]),
        "wall_seconds": time.perf_counter() - begin,
        "driver_rss_mb": {
            "round_1": driver[0][1],
            "end": driver[-1][1],
            "peak_over_rounds": max(mb for _, mb in driver),
            f"slope_per_100_rounds_after_{skip}": slope_per_100_rounds(steady),
        },
        "actor_rss_mb": [
            {
                "round_1": series[0],
                "end": series[-1],
                "peak": max(series),
                "end_own_RssAnon": own[pid]["anon"],
                "end_file_backed_RssFile": own[pid]["file"],
            }
            for pid, series in actors.items()
        ],
        "final_test_accuracy": outcome.final_accuracy,
        "epsilon": outcome.epsilon,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--skip", type=int, default=50, help="rounds left out of the slope")
    parser.add_argument("--set", action="append", default=[], help="config override")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.rounds <= args.skip + 1:
        parser.error(f"--rounds ({args.rounds}) must exceed --skip ({args.skip}) + 1")
    with tempfile.TemporaryDirectory(prefix="dpfl-scale-") as tmp:
        os.environ.setdefault("DPFL_STORE_ROOT", str(Path(tmp) / "shards"))
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        os.environ["DPFL_CHECKPOINT_DIR"] = str(Path(tmp) / "checkpoints")
        line = measure(args.clients, args.rounds, args.skip, args.set)
    disconnect()
    print(json.dumps(line), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
