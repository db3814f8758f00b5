"""The drivers of ``tests/test_warm_pool.py``: each a process of its own (one Ray job each, as
two runs of the CLI are), connected to a running head by the run's own ``executor.address``.

``python -m tests.fixtures_warm_pool REQUEST``: ``REQUEST`` is JSON with the phase, the run's
overrides and the file to write the report to (``torch.save`` of a dict of plain values).

* ``first``: one warm run; then it leases the pool again and exits without releasing it, as a
  driver killed mid-run would.
* ``second``: a warm run (it takes the lease over from the dead first job) whose actor 1 is
  SIGKILLed after round 1 (Ray restarts it, the driver opens it again), then the rules
  called directly: a second lease while one is held, an actor asked for other code, an idle
  pool ending only where its room is needed, and a pool kept 1 s after its release ending by
  itself.
"""

from __future__ import annotations

import json
import re
import sys
import time

import torch

from cluster.runtime.warm_pool import warm_actor_names

PIDS = re.compile(r"pid (\d+)")


def _run(overrides: list[str], kill_after: int | None = None) -> dict:
    """One run; with ``kill_after``, actor 1's process is SIGKILLed once that round is done
    (Ray restarts it; the driver opens it again and replays what was lost)."""
    import os
    import signal

    from cluster.config import load_config
    from cluster.runtime.experiment import run_experiment

    lines: list[str] = []

    def on_round(record) -> None:
        if record.round == kill_after and not killed:
            killed.append(_pids(lines)[1])
            os.kill(killed[0], signal.SIGKILL)

    killed: list[int] = []
    outcome = run_experiment(load_config(None, overrides), on_round=on_round, say=lines.append)
    return {
        "params": outcome.result.params,
        "epsilons": [r.epsilon for r in outcome.result.history],
        "placement": _placement(lines),
        "pids": _pids(lines),
        "recoveries": len(outcome.result.recoveries),
        "lines": lines,
    }


def _placement(lines: list[str]) -> str:
    return next(line for line in lines if " on 1 node: " in line)


def _pids(lines: list[str]) -> list[int]:
    return [int(pid) for pid in PIDS.findall(_placement(lines))]


def _lease_rules(options: dict) -> dict:
    """The lease, code and room rules, called directly on the pool the runs left (idle, 2
    actors of 0.5 CPU on a head of 2 CPUs)."""
    import ray

    from actors.code_digest import code_digest
    from cluster.runtime.warm_pool import (
        NAMESPACE,
        actor_name,
        lease_warm_hosts,
        make_room,
        pool_key,
        release,
    )

    rules: dict = {}
    held = lease_warm_hosts(2, options, 60.0)  # actor 1 started afresh
    rules["refused"] = lease_warm_hosts(2, options, 60.0)  # while held: why not, as a string
    release(held)
    context = ray.get_runtime_context()
    key = pool_key(code_digest(), options, dict(context.runtime_env))
    first = ray.get_actor(actor_name(key, 0), namespace=NAMESPACE)
    rules["other_code"] = ray.get(first.lease.remote("t", context.get_job_id(), "0" * 64, 60.0))
    make_room(1, 0.5, 0.0)  # 1 CPU free: nothing ends
    rules["after_room_for_half"] = sorted(warm_actor_names())
    make_room(1, 1.5, 0.0)  # the idle pool's CPU is needed: it ends
    rules["after_room_for_more"] = _wait_until_pool(lambda names: not names, 10)
    short = lease_warm_hosts(1, options, 1.0)  # started afresh, kept 1 s after its release
    rules["short_names"] = sorted(warm_actor_names())
    release(short)
    rules["after_idle"] = _wait_until_pool(lambda names: not names, 30)
    return rules


def _wait_until_pool(done, timeout_s: float) -> list[str]:
    """The pool's actor names once ``done(names)``, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done(warm_actor_names()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return sorted(warm_actor_names())


def main(request: dict) -> None:
    from cluster.runtime.ray_executor import actor_options
    from cluster.runtime.warm_pool import lease_warm_hosts

    warm = [*request["overrides"], "executor.keep_warm_s=60"]
    options = actor_options(0.5, 0.0, "pack")
    if request["phase"] == "first":
        report = {"warm": _run(warm)}
        lease_warm_hosts(2, options, 60.0)  # held by this job until it exits
    else:
        report = {"warm": _run(warm, kill_after=1)}
        # The restarted actor 1 ends at its release (its restart budget is partly spent)
        report["after_restarted_release"] = _wait_until_pool(lambda names: len(names) == 1, 30)
        report.update(_lease_rules(options))
    torch.save(report, request["out"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
