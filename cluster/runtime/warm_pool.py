"""Warm hosts: a run's Ray actors kept alive for the next run on the same running Ray
(``executor.keep_warm_s``), so that it skips the actors' process start and imports.

Ray gives every job fresh worker processes, and each host actor's process imports Ray and torch
anew (≈ 4 s of CPU on the 2-core machine, ``docs/benchmarks.md``). A warm pool keeps them: its
actors (``actors.ray_actor.WarmHostActor``) are detached and named in ``NAMESPACE`` by a key of
everything that decides what they run (``pool_key``), so a run finds the pool that an earlier
run with the same code and executor settings left, leases it, opens its own hosts in it and
releases them at its end. Results do not depend on it: a warm actor builds each run's host as a
fresh actor does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

NAMESPACE = "dpfl-warm-hosts"
# A release or retirement that does not answer in this time (its node is gone) is left to the
# actor's idle clock.
RELEASE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WarmLease:
    """The pool's first actors, held by one run (``token``) until ``release``; kept
    ``keep_warm_s`` idle seconds after it."""

    actors: list
    token: str
    keep_warm_s: float
    digest: str  # the code's (actors.code_digest) when leased: a restarted actor runs it still


def pool_key(digest: str, actor_options: dict, runtime_env: dict) -> str:
    """What a warm actor runs and holds: the code (``actors.code_digest``), its Ray options
    (CPUs, GPUs, placement, restarts) and the job's runtime environment without its
    working_dir (whose code the digest covers; the package name changes with every file of
    the directory, a log or a database included)."""
    env = {key: value for key, value in runtime_env.items() if key != "working_dir"}
    blob = json.dumps([digest, actor_options, env], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def pool_prefix(key: str) -> str:
    """What the names of pool ``key``'s actors begin with."""
    return f"host-{key}-"


def actor_name(key: str, index: int) -> str:
    return f"{pool_prefix(key)}{index}"


def warm_actor_names() -> set[str]:
    """The names of the warm actors alive on this Ray, every pool's."""
    import ray

    listed = ray.util.list_named_actors(all_namespaces=True)
    return {entry["name"] for entry in listed if entry["namespace"] == NAMESPACE}


def lease_warm_hosts(num_actors: int, actor_options: dict, keep_warm_s: float) -> WarmLease | str:
    """The warm pool's actors 0 … ``num_actors`` − 1 for this run, created where missing, each
    leased (``WarmHostActor.lease``); else why not (nothing stays leased). Where Ray has no
    room for the missing ones, free warm actors of other pools end first (``make_room``)."""
    import ray

    from actors.code_digest import code_digest
    from actors.ray_actor import WARM_ACTOR_OPTIONS, WarmHostActor
    from cluster.runtime.code_shipping import actor_class, shipped_digest

    context = ray.get_runtime_context()
    digest = shipped_digest() or code_digest()  # the code its actors run
    key = pool_key(digest, actor_options, dict(context.runtime_env))
    names = [actor_name(key, index) for index in range(num_actors)]
    missing = set(names) - warm_actor_names()
    make_room(len(missing), actor_options["num_cpus"], actor_options["num_gpus"], keep=key)
    warm_actor = actor_class(WarmHostActor, **WARM_ACTOR_OPTIONS)
    actors = [
        warm_actor.options(
            name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, **actor_options
        ).remote(index, digest, keep_warm_s)
        for index, name in enumerate(names)
    ]
    lease = WarmLease(actors, uuid.uuid4().hex, keep_warm_s, digest)
    job_id = context.get_job_id()
    asked = [_ask(lease, actor, job_id) for actor in actors]
    try:
        refusals = [_refusal(answer) for answer in asked]
    except BaseException:  # interrupted: nothing may stay leased by this live driver
        release(lease)
        raise
    refused = [(name, why) for name, why in zip(names, refusals, strict=True) if why is not None]
    if refused:
        release(lease)
        name, why = refused[0]
        return f"warm actor {name}: {why}"
    return lease


def lease_again(lease: WarmLease, index: int) -> str | None:
    """Lease actor ``index`` again for the run that held it before Ray restarted it (without
    its host and lease): None when taken, else why not."""
    import ray

    job_id = ray.get_runtime_context().get_job_id()
    return _refusal(_ask(lease, lease.actors[index], job_id, reopen=True))


def _ask(lease: WarmLease, actor, job_id: str, reopen: bool = False):
    """``actor``'s answer to ``lease``, a future."""
    return actor.lease.remote(lease.token, job_id, lease.digest, lease.keep_warm_s, reopen)


def _refusal(answer) -> str | None:
    """A lease's answer: None (taken) or why not; an actor that died meanwhile (it was ending
    as it was found) refuses too."""
    import ray
    from ray.exceptions import RayActorError

    try:
        return ray.get(answer)
    except RayActorError as error:
        return f"it ended ({type(error).__name__})"


def release(lease: WarmLease) -> None:
    """Hand the leased actors back: their hosts are dropped, their idle clocks start."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    with contextlib.suppress(GetTimeoutError, RayActorError):  # its lease lapses with the job
        ray.get([a.release.remote(lease.token) for a in lease.actors], timeout=RELEASE_TIMEOUT_S)


def actors_that_fit(free_per_node: Iterable[dict[str, float]], cpus: float, gpus: float) -> float:
    """How many actors of ``cpus`` CPUs and ``gpus`` GPUs fit, node by node, in the free
    resources ``free_per_node`` (an actor takes its share on one node: two nodes with one
    free CPU each hold no actor of 2). Unbounded (inf) for an actor that asks for neither."""
    needs = [(kind, need) for kind, need in (("CPU", cpus), ("GPU", gpus)) if need > 0]
    if not needs:
        return math.inf
    # The tolerance absorbs float sums of fractional shares (Ray keeps them in 1e-4 units).
    return sum(
        min(math.floor((free.get(kind, 0.0) + 1e-9) / need) for kind, need in needs)
        for free in free_per_node
    )


def make_room(count: int, cpus: float, gpus: float, keep: str | None = None) -> None:
    """Where Ray's nodes have no room for ``count`` actors of ``cpus`` CPUs and ``gpus``
    GPUs (``actors_that_fit``, on each node's free resources), end the warm actors that no
    live run holds (except pool ``keep``'s): an idle pool would otherwise keep this run's
    actors waiting for its idle clock."""
    import ray
    from ray._private.state import available_resources_per_node  # no public per-node view
    from ray.exceptions import GetTimeoutError, RayActorError

    if count <= 0 or actors_that_fit(available_resources_per_node().values(), cpus, gpus) >= count:
        return
    kept = pool_prefix(keep) if keep is not None else None
    others = [name for name in warm_actor_names() if kept is None or not name.startswith(kept)]
    for name in sorted(others):
        # ValueError: it ended since it was listed; the others: while answering, or its node
        # is gone.
        with contextlib.suppress(ValueError, GetTimeoutError, RayActorError):
            actor = ray.get_actor(name, namespace=NAMESPACE)
            ray.get(actor.retire_if_free.remote(), timeout=RELEASE_TIMEOUT_S)
