"""Wall time of the privacy calculator's default rows, each run in a fresh process.

Runs ``python -m cluster privacy --sigma 0.95 --q 0.1 --rounds 200 --delta 0.002`` (DP-FedSAM's
setting: the rows rdp, pld, prv, rdp_classic and rdp-wor) ``--repeat`` times from the repository
root (or ``--root``, another checkout run with this interpreter, for a before/after pair) and
prints one JSON line: every run's wall and CPU seconds (user + sys of the child), their
medians, and the 1-minute load average before and after (the machine may be shared).

Usage (from the repository root)::

    uv run python -m benchmarks.calculator [--repeat 5] [--root PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ("privacy", "--sigma", "0.95", "--q", "0.1", "--rounds", "200", "--delta", "0.002")


def _child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(root: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one calculator process started in ``root``."""
    cpu, start = _child_cpu_seconds(), time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "cluster", *ARGS], cwd=root, check=True, capture_output=True
    )
    return time.perf_counter() - start, _child_cpu_seconds() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes to time")
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout to run (default: this)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    runs = [timed_run(args.root) for _ in range(args.repeat)]
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    line = {
        "benchmark": "calculator",
        "command": "python -m cluster " + " ".join(ARGS),
        "checkout": args.root.name,
        "wall_seconds": [round(w, 3) for w in walls],
        "cpu_seconds": [round(c, 3) for c in cpus],
        "median_wall_seconds": round(statistics.median(walls), 3),
        "median_cpu_seconds": round(statistics.median(cpus), 3),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
