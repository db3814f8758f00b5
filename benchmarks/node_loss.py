"""Losing a Ray node mid-run: detection, recovery, and results bit-identical to no loss.

Starts the three-node cluster of ``tests/fixtures_ray_cluster.py`` on this machine, afresh for
each scenario (a head
without CPUs, two worker nodes of 2 logical CPUs; node death detected by the GCS after about
1 s of missed health checks instead of Ray's ~15 s), and runs a small synthetic experiment
(DP-FedAvg, then DP-SCAFFOLD) with two actors spread over the worker nodes, each from a driver
process of its own. In each run the raylet of one worker node is SIGKILLed while round
``--kill-after`` + 1 trains (a thread, half of round ``--kill-after``'s time after it ended);
then it reports, per algorithm:

* ``detection_s``: from the SIGKILL to the driver's seeing the lost actor;
* ``restart_s``: from detection until Ray has restarted the actor on the surviving node (it
  reads its clients' shards from the store) and the roll-back's states are loaded;
* ``recovery_s``: from detection until the lost round is recomputed (restart + replay);
* ``rounds_replayed``: DP-FedAvg recomputes the lost round only, DP-SCAFFOLD every round since
  its last checkpoint (``checkpoint.every``), whose c_i the driver kept;
* ``params_match`` / ``epsilon_match``: bit for bit against the same run uninterrupted, in
  process on as many host threads as the run has actors (the executors agree bit for bit).

``spread`` is the placement check: a run without loss, its actors' nodes, and whether it
matches the same run on one embedded Ray node. ``no_room``: actors of 2 CPUs, one per node, so
the lost one cannot be restarted; the run must stop with the "no surviving node" error (after
``DPFL_RESTART_TIMEOUT_S``, set to 5 s here). These cover the ``slow`` tests of
``tests/test_multinode.py``. JSON to ``benchmarks/results/node_loss.json``.

    uv run python -m benchmarks.node_loss [--rounds 8] [--kill-after 4] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks import write_report
from cluster.config import load_config
from cluster.runtime.checkpoint import load_checkpoint
from cluster.runtime.experiment import run_experiment
from tests.fixtures_ray_cluster import DriverReport, LocalCluster, drive_embedded, local_cluster

DP_FEDAVG = ["algorithm.name=dp_fedavg", "algorithm.clip_norm=0.5", "algorithm.noise_multiplier=1"]
DP_SCAFFOLD = [
    "algorithm.name=dp_scaffold",
    "algorithm.clip_norm=1.0",
    "algorithm.noise_multiplier=2.0",
    "algorithm.local.batch_size=20",
    "algorithm.local.lr=0.5",
]
ACTORS = ["executor.kind=ray", "executor.num_actors=2"]
RESTART_TIMEOUT_S = "5"


def experiment(root: Path, name: str, rounds: int, *overrides: str) -> list[str]:
    """The small synthetic experiment's overrides, with a checkpoint directory of its own."""
    return [
        f"data.store_root={root / 'shards'}",
        "data.num_clients=40",
        "data.synthetic.samples_per_user=100",
        "cohort.size=10",
        "algorithm.local.local_steps=10",
        "algorithm.local.batch_size=16",
        "tracking.enabled=false",
        f"rounds={rounds}",
        f"checkpoint.dir={root / name}",
        *overrides,
    ]


def say(line: str) -> None:
    print(line, flush=True)


@contextmanager
def cluster() -> Iterator[LocalCluster]:
    """A fresh three-node cluster for one scenario (see ``tests.fixtures_ray_cluster``: a
    cluster's later drivers now and then have their actors cancelled at start)."""
    started = time.perf_counter()
    say("  starting a 3-node Ray cluster on this machine (head + 2 worker nodes)")
    with local_cluster() as nodes:
        say(f"  up after {time.perf_counter() - started:.1f} s")
        yield nodes


def same_run(report: DriverReport, params: torch.Tensor, epsilons: list[float]) -> dict:
    return {
        "params_match": torch.equal(report.params, params),
        "epsilon_match": report.epsilons == epsilons,
        "final_epsilon": report.epsilons[-1],
    }


def node_loss(root: Path, name: str, run: list[str], args) -> dict:
    """One run losing a worker node, against the same run uninterrupted."""
    say(f"{name}: running, a worker node's raylet SIGKILLed in round {args.kill_after + 1}")
    overrides = experiment(root, name, args.rounds, *run, *ACTORS, "executor.placement=spread")
    started = time.perf_counter()
    with cluster() as nodes:
        report = nodes.drive(overrides, kill_after=args.kill_after, kill_into=0.5)
    wall = time.perf_counter() - started
    for line in report.lines:
        if line.startswith(("round ", "actors running again", "recovered")):
            say(f"  {line}")
    say(f"{name}: the same run uninterrupted, in process")
    local = experiment(root, f"{name}-reference", args.rounds, *run, "executor.num_actors=2")
    reference = run_experiment(load_config(None, local))  # in process: no Ray
    (recovery,) = report.recoveries
    history = reference.result.history
    return {
        "lost_round": recovery.round,
        "detection_s": round(recovery.detected_at - report.killed_at, 3),
        "restart_s": round(recovery.restart_s, 3),
        "recovery_s": round(recovery.seconds, 3),
        "kill_to_recovered_s": round(recovery.detected_at - report.killed_at + recovery.seconds, 3),
        "rounds_replayed": recovery.rounds_replayed,
        "rolled_back_to_round": recovery.rolled_back_to,
        "seconds_per_round": round(sum(r.seconds for r in history) / len(history), 3),
        "run_wall_s": round(wall, 1),
        "actor_nodes_after": sorted(report.nodes),
        **same_run(report, reference.result.params, [r.epsilon for r in history]),
    }


def spread(root: Path, rounds: int) -> dict:
    say("spread: a run without loss, actors spread over the worker nodes")
    run = [*DP_FEDAVG, *ACTORS]
    with cluster() as nodes:
        report = nodes.drive(experiment(root, "spread", rounds, *run, "executor.placement=spread"))
    say("spread: the same run on one embedded Ray node")
    embedded = drive_embedded(experiment(root, "embedded", rounds, *run))
    return {
        "actor_nodes": sorted(report.nodes),
        **same_run(report, embedded.params, embedded.epsilons),
    }


def no_room(root: Path, args) -> dict:
    say("no_room: actors of 2 CPUs, one per worker node; the lost one has nowhere to go")
    run = [*DP_FEDAVG, *ACTORS, "executor.placement=spread", "executor.cpus_per_actor=2"]
    overrides = experiment(root, "no-room", args.rounds, *run, "checkpoint.every=1")
    with cluster() as nodes:
        report = nodes.drive(
            overrides, kill_after=args.kill_after, env={"DPFL_RESTART_TIMEOUT_S": RESTART_TIMEOUT_S}
        )
    (checkpoint,) = (root / "no-room").glob("*.pt")
    saved = load_checkpoint(checkpoint)["simulation"]["rounds_done"]
    say(f"  {report.error}")
    return {
        "stopped_with_error": report.error is not None and "no surviving node" in report.error,
        "checkpoint_rounds_done": saved,
        "error": report.error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/node_loss.json")
    args = parser.parse_args()
    if not 1 <= args.kill_after < args.rounds:
        parser.error(f"--kill-after {args.kill_after}: must be in [1, --rounds - 1]")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
        root = Path(tmp)
        result = {
            "cluster": "1 head (0 CPUs) + 2 worker nodes (2 logical CPUs each), one machine",
            "rounds": args.rounds,
            "spread": spread(root, args.rounds),
            "dp_fedavg": node_loss(root, "dp_fedavg", DP_FEDAVG, args),
            "dp_scaffold": node_loss(
                root, "dp_scaffold", [*DP_SCAFFOLD, "checkpoint.every=3"], args
            ),
            "no_room": no_room(root, args),
        }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    write_report(result, args.out)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
