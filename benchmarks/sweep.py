"""A sweep's trials concurrently vs one after another: wall time of the same 8-trial sweep.

The sweep of ``tests/test_sweep.py`` (synthetic task, 20 clients, 4 configurations × 2 seeds,
DP-FedAvg calibrated to ε = 5, one Ray actor per trial) is run twice through ``python -m
cluster sweep``, each time in a fresh process with a fresh MLflow store: with ``--concurrent
1`` (one trial at a time) and with the default (as many as the cluster holds: two on 2 CPUs).
Both pay the same start-up (Ray, the MLflow server, the trials' workers); the ratio is of the
whole command's wall time. ``--rounds`` sets the trials' length (longer trials: the ratio
tends to what the cores allow). JSON to ``benchmarks/results/sweep.json``.

    uv run python -m benchmarks.sweep [--rounds 10] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks import write_report

SPACE = {"algorithm.local.lr": [0.05, 0.2], "algorithm.clip_norm": [0.5, 1.0]}


def tiny_base(store_root: Path, checkpoint_dir: Path, rounds: int = 3) -> dict:
    """The trials' config (also ``tests/test_sweep.py``'s): a synthetic task, 20 clients,
    DP-FedAvg at ε = 5, 20% of each client's rows held out for validation, one Ray actor."""
    return {
        "rounds": rounds,
        "eval_every": 1,
        "data": {
            "num_clients": 20,
            "store_root": str(store_root),
            "synthetic": {"samples_per_user": 100},
            "validation": {"fraction": 0.2},
        },
        "cohort": {"size": 5, "sampling": "fixed"},
        "algorithm": {
            "name": "dp_fedavg",
            "clip_norm": 0.5,
            "local": {"local_steps": 3, "batch_size": 16},
        },
        "privacy": {"target_epsilon": 5.0, "calibrate": "sigma", "accountant": "rdp"},
        "executor": {"kind": "ray", "num_actors": 1, "cpus_per_actor": 0.75},
        "tracking": {"experiment": "sweep"},
        "checkpoint": {"dir": str(checkpoint_dir), "every": 0},
    }


def spec(root: Path, rounds: int) -> dict:
    return {"base": tiny_base(root / "shards", root / "ck", rounds), "space": SPACE, "seeds": 2}


def timed_sweep(rounds: int, concurrent: int) -> float:
    """Wall seconds of one ``cluster sweep`` command, in a fresh folder and store."""
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        root = Path(tmp)
        path = root / "bench.yaml"
        path.write_text(yaml.safe_dump(spec(root, rounds)))
        env = os.environ | {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
        command = [sys.executable, "-m", "cluster", "sweep", str(path), "--out", str(root / "o")]
        start = time.perf_counter()
        subprocess.run([*command, "--concurrent", str(concurrent)], env=env, check=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/sweep.json")
    args = parser.parse_args()
    sequential = timed_sweep(args.rounds, 1)
    concurrent = timed_sweep(args.rounds, 0)
    report = {
        "trials": 8,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "one_after_another_s": round(sequential, 2),
        "concurrent_s": round(concurrent, 2),
        "wall_ratio": round(sequential / concurrent, 3),
        "command": "uv run python -m benchmarks.sweep " + " ".join(sys.argv[1:]),
    }
    print(report)
    print(f"wrote {write_report(report, args.out)}")


if __name__ == "__main__":
    main()
