"""Connecting to Ray: inside a Ray job, to a given cluster, or an embedded local instance."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class ResourceError(RuntimeError):
    pass


def connect(address: str | None) -> str:
    """Initialise Ray once; returns a description of what it connected to."""
    import ray

    if ray.is_initialized():
        return "existing Ray session"
    if address:
        # A remote cluster needs our code on its workers: ship the project as the working_dir.
        ray.init(
            address=address, runtime_env={"working_dir": str(PROJECT_ROOT)}, log_to_driver=True
        )
        return f"Ray cluster at {address}"
    if os.environ.get("RAY_ADDRESS"):
        # Inside `ray job submit`: the job's runtime_env already carries the working_dir.
        ray.init()
        return f"Ray cluster at {os.environ['RAY_ADDRESS']}"
    # address="local": always a fresh embedded instance, never a cluster that some earlier
    # `ray start` on this machine left in /tmp/ray/ray_current_cluster.
    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"PYTHONPATH": str(PROJECT_ROOT)}},
    )
    return "embedded local Ray"


def check_resources(num_actors: int, cpus_per_actor: float, gpus_per_actor: float) -> None:
    """Fail before creating actors that could never be scheduled on this (static) cluster."""
    import ray

    total = ray.cluster_resources()
    needs = {"CPU": num_actors * cpus_per_actor, "GPU": num_actors * gpus_per_actor}
    for resource, need in needs.items():
        have = total.get(resource, 0.0)
        if need > have + 1e-9:
            field = "cpus_per_actor" if resource == "CPU" else "gpus_per_actor"
            raise ResourceError(
                f"executor: {num_actors} actors × {field} need {need:g} {resource} but the Ray "
                f"cluster has {have:g}; lower executor.num_actors or executor.{field}"
            )
