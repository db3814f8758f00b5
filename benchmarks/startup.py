"""Where Ray's start-up goes: a timeline and the CPU of every process until the first round of a
workload starts, with the embedded Ray or (``--running``) a running head.

``run_experiment`` with the embedded Ray (``executor.kind: ray``, no address; with
``executor.overlap_start: false``, so that the first round waits for the actors), in a fresh
interpreter per repeat started as the CLI starts (its MLflow process first, then its imports),
its clock started after the imports, as in ``benchmarks.workloads``. It
reads three moments off the run's own notices and rounds: Ray connected (``ray.init`` returned),
the actors answered (every host built: the actors' imports and data included), and the first
round started. At the second moment it reads every process below the driver from ``/proc``
(Linux only), and with ``--running`` every process below the head's ``ray start``: when each
was spawned, relative to the call, and the CPU seconds (user + system) it had used, by role: the
GCS, the raylet, Ray's dashboard and runtime-env agents, the host actors (and a job's runtime
environment's setup of their workers), Ray's idle workers, the MLflow tracking process. The
driver's own CPU over the same span is ``time.process_time``.

On ``c`` cores the start-up cannot take less than its CPU divided by ``c`` (``floor_seconds``);
the timeline shows what waits on what (the raylet spawns the workers only once its agents have
started, and an actor's imports start only when its worker runs). Tracking is on, into a
temporary SQLite store whose schema is created first, outside the timing, as in
``benchmarks.workloads``.

With ``--running`` the run connects (``executor.address``) to a head that the benchmark starts
before the timings and stops after them, as ``benchmarks.workloads``' ``ray_running``
(``running_ray``: loopback, token authentication, its own ports); its GCS, raylet and agents
ran before the call, so only what they used after it counts.

Usage (repository root)::

    uv run python -m benchmarks.startup [--workload A] [--repeat 3] [--running] [--set K=V ...]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")

# A process's role from its command line (Ray renames its Python processes ``ray::<what>``).
ROLES = (
    ("gcs_server", "gcs"),
    ("/raylet/raylet", "raylet"),
    ("DashboardAgent", "dashboard_agent"),
    ("dashboard/agent.py", "dashboard_agent"),
    ("RuntimeEnvAgent", "runtime_env_agent"),
    ("runtime_env/agent/main.py", "runtime_env_agent"),
    ("ray::ClientHostActor", "host_actor"),
    ("setup_worker.py", "worker_setup"),  # a job's runtime environment: it execs the worker
    ("ray::IDLE", "idle_worker"),
    ("default_worker.py", "idle_worker"),
    ("cluster.tracking.service", "tracking"),
)


def role_of(command_line: str) -> str:
    for marker, role in ROLES:
        if marker in command_line:
            return role
    return "other"


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    parent: int
    role: str
    started_s: float  # seconds since boot
    cpu_s: float  # user + system


def _read_process(pid: int, tick: int) -> ProcessSample | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        command = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
    except (FileNotFoundError, ProcessLookupError, PermissionError):  # it ended meanwhile
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the name, which may hold spaces
    cpu = (int(fields[11]) + int(fields[12])) / tick
    role = role_of(command.decode(errors="replace"))  # any process's arguments, any bytes
    return ProcessSample(pid, int(fields[1]), role, int(fields[19]) / tick, cpu)


def descendants(root: int) -> list[ProcessSample]:
    """Every live process below ``root`` (children, their children, ...)."""
    tick = os.sysconf("SC_CLK_TCK")
    samples = [
        s for p in PROC.iterdir() if p.name.isdigit() and (s := _read_process(int(p.name), tick))
    ]
    children: dict[int, list[ProcessSample]] = {}
    for sample in samples:
        children.setdefault(sample.parent, []).append(sample)
    found, frontier = [], [root]
    while frontier:
        below = children.get(frontier.pop(), [])
        found.extend(below)
        frontier.extend(s.pid for s in below)
    return found


def by_role(
    samples: list[ProcessSample], call_boot_s: float, cpu_before: dict[int, float]
) -> dict[str, dict]:
    """Per role: how many processes, the CPU seconds they used after the call together (a
    process that ran before it, the prestarted MLflow process, less its ``cpu_before``), and the
    first one's spawn (seconds after the call; negative: before it)."""
    roles: dict[str, dict] = {}
    for sample in sorted(samples, key=lambda s: s.started_s):
        entry = roles.setdefault(
            sample.role,
            {"processes": 0, "cpu_seconds": 0.0, "spawned_at": sample.started_s - call_boot_s},
        )
        entry["processes"] += 1
        used = sample.cpu_s - cpu_before.get(sample.pid, 0.0)
        entry["cpu_seconds"] = round(entry["cpu_seconds"] + used, 3)
        entry["spawned_at"] = round(entry["spawned_at"], 3)
    return roles


def ray_processes() -> list[ProcessSample]:
    """This driver's processes, and the running head's where there is one
    (``running_ray``'s ``HEAD_PID_VARIABLE``)."""
    from benchmarks.workloads import HEAD_PID_VARIABLE

    head = os.environ.get(HEAD_PID_VARIABLE)
    return descendants(os.getpid()) + (descendants(int(head)) if head else [])


def child(workload: str, overrides: list[str]) -> dict:
    """One start-up of Ray, timed in this (fresh) process."""
    from benchmarks.workloads import EXECUTORS, workload_config
    from cluster.config import config_from_dict
    from cluster.runtime.experiment import run_experiment

    config = workload_config(workload, overrides)
    # The first round waits for the actors: the start measured whole, not hidden behind rounds
    # in the driver (``executor.overlap_start``).
    config = config_from_dict(config.to_dict(), [*EXECUTORS["ray_waiting"], *overrides])
    moments: dict[str, float] = {}
    snapshot: list[ProcessSample] = []
    cpu_at_ready = 0.0

    def say(message: str) -> None:
        nonlocal cpu_at_ready, snapshot
        now = time.perf_counter()
        if message.startswith("Ray:"):
            moments["ray_connected"] = now - start
        elif message.startswith("actors on"):
            moments["actors_ready"] = now - start
            cpu_at_ready = time.process_time() - cpu_start
            snapshot = ray_processes()

    rounds: list[float] = []
    cpu_before = {sample.pid: sample.cpu_s for sample in ray_processes()}
    call_boot_s = time.clock_gettime(time.CLOCK_BOOTTIME)
    cpu_start, start = time.process_time(), time.perf_counter()
    outcome = run_experiment(config, on_round=lambda r: rounds.append(time.perf_counter()), say=say)
    moments["first_round_started"] = rounds[0] - outcome.result.history[0].seconds - start
    roles = by_role(snapshot, call_boot_s, cpu_before)
    cpu = sum(entry["cpu_seconds"] for entry in roles.values()) + cpu_at_ready
    return {
        **{k: round(v, 3) for k, v in moments.items()},
        "driver_cpu_seconds": round(cpu_at_ready, 3),
        "processes": roles,
        "cpu_seconds_until_actors_ready": round(cpu, 3),
        "cores": os.cpu_count(),
        "floor_seconds": round(cpu / os.cpu_count(), 3),
    }


ONE_ROUND = ("rounds=1", "eval_every=1")  # the start-up is what is timed; one round ends the run
MEDIANS = (
    "ray_connected",
    "actors_ready",
    "first_round_started",
    "cpu_seconds_until_actors_ready",
    "floor_seconds",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__)
    parser.add_argument("--workload", choices=["A", "B"], default="A")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="config override")
    parser.add_argument("--running", action="store_true", help="connect to a running head")
    parser.add_argument("--out", type=Path, help="also write the JSON line to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # started as the CLI starts: the MLflow process first, then the imports
        from cluster.tracking.process import prestart

        prestart()
        print(json.dumps(child(args.workload, [*ONE_ROUND, *args.set])), flush=True)
        return 0
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: need at least 1")
    from benchmarks.workloads import (
        _create_tracking_schema,
        json_line_of_child,
        running_ray,
        workload_config,
    )
    from cluster.runtime.store import open_store

    with tempfile.TemporaryDirectory(prefix="dpfl-startup-") as tmp:
        os.environ.setdefault("DPFL_STORE_ROOT", str(Path(tmp) / "shards"))
        os.environ.setdefault("DPFL_CHECKPOINT_DIR", str(Path(tmp) / "checkpoints"))
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        open_store(workload_config(args.workload, args.set))  # built outside every timing
        _create_tracking_schema()
        child_args = ["benchmarks.startup", "--child", "--workload", args.workload]
        what = f"start-up of workload {args.workload}"
        head = running_ray(Path(tmp)) if args.running else nullcontext(([], None))
        with head as (address, env):
            overrides = [*args.set, *address]
            runs = [
                json_line_of_child(child_args, overrides, what, env) for _ in range(args.repeat)
            ]
    line = {
        "workload": args.workload,
        "ray": "running head" if args.running else "embedded",
        "load_average_1min": round(os.getloadavg()[0], 2),
        **{key: statistics.median(run[key] for run in runs) for key in MEDIANS},
        "runs": runs,
    }
    print(json.dumps(line), flush=True)
    if args.out:
        args.out.write_text(json.dumps(line, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
