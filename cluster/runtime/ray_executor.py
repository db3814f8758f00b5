"""``RayExecutor``: the hosts as Ray actors (``actors.ray_actor``), placed per actor
(``actor_options``) or in a trial's placement group (``in_trial_group``), and brought back
after a loss of hosts (``await_hosts``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from actors.client_host import AUTO_KERNELS, Kernels
from algorithms.algorithm import Algorithm
from cluster.config.runtime import restart_timeout_s
from cluster.runtime.central_optimum import store_optimum
from cluster.runtime.code_shipping import actor_class, remote_function
from cluster.runtime.executors import (
    MAX_RESTARTS,
    POLL_S,
    Call,
    HostPool,
    HostsLost,
    HostsUnavailable,
)
from cluster.runtime.warm_pool import (
    WarmLease,
    lease_again,
    lease_warm_hosts,
    make_room,
    release,
)
from datasets.store import ShardStore

PING_S = 5.0  # how long a restarted actor may take to answer its first call


def actor_options(cpus: float, gpus: float, placement: str) -> dict:
    """Ray options of one host actor.

    ``placement``: ``pack`` leaves Ray's default strategy (fill the driver's node, then the
    next), ``spread`` gives every actor Ray's ``SPREAD`` strategy (each on the node with the
    fewest of them that has room). A placement group would reserve the pool's bundles once;
    when a node dies Ray 2.60 reschedules its bundles (the group goes to RESCHEDULING) and the
    actors in them restart only once a new bundle is placed, which a STRICT_SPREAD group with
    more bundles than surviving nodes never is: the run would hang where a per-actor strategy
    restarts the actor on any surviving node with room. So: SPREAD, no placement group.

    Every actor may be restarted ``MAX_RESTARTS`` times, but its calls are never retried by Ray
    (``max_task_retries=0``): a restarted actor has lost its clients' states (SCAFFOLD's c_i),
    and only the driver knows what to restore first (``Simulation``'s roll-back).
    """
    return {
        "num_cpus": cpus,
        "num_gpus": gpus,
        "max_restarts": MAX_RESTARTS,
        "max_task_retries": 0,
        "scheduling_strategy": "SPREAD" if placement == "spread" else "DEFAULT",
    }


def in_trial_group(group, actor_index: int) -> dict:
    """Ray options placing actor ``actor_index`` of a trial (``cluster.analysis.trials``) in its
    placement group ``group``: bundle 0 is the trial's driver, actor i takes bundle i + 1.
    Outside a placement group (``group`` None): none, ``actor_options`` decides."""
    if group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, actor_index + 1)}


def constructor_failure(error: BaseException) -> str | None:
    """The exception (type and message) an actor's constructor raised, as Ray reports it to a
    call on that actor: an ``ActorDiedError`` whose actor failed in its constructor, or an
    ``UnserializableException`` where that exception could not be sent (asked only of an actor
    that is dead or failing to start); None for any other error."""
    from ray.exceptions import ActorDiedError, UnserializableException

    failed = isinstance(error, ActorDiedError) and error.actor_init_failed
    return _raised(str(error)) if failed or isinstance(error, UnserializableException) else None


def _raised(report: str) -> str:
    """The exception at the end of a traceback's text, its lines (a message's later lines, its
    notes) joined: from the first unindented line after the last frame (``File ...``, then its
    indented source) to the end."""
    lines = report.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    if not frames:
        return lines[-1].strip()
    after = lines[frames[-1] + 1 :]
    unindented = (i for i, line in enumerate(after) if line.strip() and not line[0].isspace())
    return " ".join(line.strip() for line in after[next(unindented, 0) :] if line.strip())


class ActorRecord(NamedTuple):
    """The GCS's record of an actor: its state (``ALIVE``, ``RESTARTING``, ``DEAD``, ...), how
    often Ray restarted it, and the worker (hex id) its process was leased: empty while a
    restart has none yet (the GCS clears the address as the restart begins and sets it with
    the new lease)."""

    state: str
    restarts: int
    worker_id: str


class RayExecutor(HostPool):
    """The hosts as Ray actors, placed by ``placement`` (``actor_options``). A call that loses
    an actor (its node or process died) raises ``HostsLost``; ``await_hosts`` then waits until
    Ray has restarted it, on a surviving node, reading its clients' shards from the store."""

    def __init__(
        self,
        store: ShardStore,
        task: str,
        algorithm: Algorithm,
        seed: int,
        num_actors: int,
        cpus_per_actor: float = 1.0,
        gpus_per_actor: float = 0.0,
        test_per_client: int | None = None,
        data_seed: int | None = None,
        kernels: Kernels = AUTO_KERNELS,
        placement: str = "pack",
        keep_warm_s: float = 0.0,
        say: Callable[[str], None] = lambda message: None,
        created: Callable[[list], None] = lambda actors: None,
    ):
        """``keep_warm_s`` > 0: the hosts are a warm pool's actors (``warm_pool``), kept that
        many idle seconds after the run for the next one; where no pool can be leased (another
        run holds it) or inside a trial's placement group, fresh actors, as ``say`` tells.
        ``created`` gets fresh actors' handles before their start is waited for (to kill them
        from another thread, which ends the wait with ``RayActorError``)."""
        import ray
        from ray.util import get_current_placement_group

        super().__init__(store, algorithm, num_actors)
        self._ray = ray
        self._store_location = store.location
        self._resources = (cpus_per_actor, gpus_per_actor)
        self._host_kwargs = {
            "store_path": store.location,
            "test_per_client": test_per_client,
            "kernels": kernels,
            "task": task,
            "algorithm": algorithm,
            "seed": seed,
            "data_seed": data_seed,
        }
        options = actor_options(cpus_per_actor, gpus_per_actor, placement)
        group = get_current_placement_group()  # a trial's, or None
        self.lease = None
        if keep_warm_s > 0:
            self.lease = self._lease(options, keep_warm_s, group, say)
        if self.lease is not None:
            self.actors = self.lease.actors
            try:
                self.placement = ray.get([self._open(index) for index in range(num_actors)])
            except BaseException:
                release(self.lease)
                raise
        else:
            if group is None:
                make_room(num_actors, cpus_per_actor, gpus_per_actor)
            self.actors = [self._fresh_actor(options, group, index) for index in range(num_actors)]
            created(self.actors)
            try:
                self.placement = self.actor_info()
            except ray.exceptions.RayError as error:
                cause = constructor_failure(error)
                if cause is None:  # killed (a cancelled start), or Ray's own failure
                    raise
                raise HostsUnavailable(f"executor: a host actor failed to start: {cause}") from None
        self.devices = [info["device"] for info in self.placement]

    def _lease(self, options: dict, keep_warm_s: float, group, say) -> WarmLease | None:
        if group is not None:
            say("executor: a trial's actors live in its placement group: no warm actors")
            return None
        lease = lease_warm_hosts(self.num_hosts, options, keep_warm_s)
        if isinstance(lease, str):
            say(f"executor: fresh actors, no warm ones ({lease})")
            return None
        return lease

    def _fresh_actor(self, options: dict, group, index: int):
        from actors.ray_actor import ClientHostActor

        host_actor = actor_class(ClientHostActor)
        return host_actor.options(**{**options, **in_trial_group(group, index)}).remote(
            *self._resources, (index, self.num_hosts), **self._host_kwargs
        )

    def _open(self, index: int, states_lost: bool = False):
        """Build this run's host in warm actor ``index``: the future of its ``info``."""
        return self.actors[index].open.remote(
            self.lease.token,
            *self._resources,
            (index, self.num_hosts),
            self._host_kwargs,
            states_lost,
        )

    def actor_info(self) -> list[dict]:
        """Each actor's ``info()``: process, device, node id and node IP."""
        return self._ray.get([actor.info.remote() for actor in self.actors])

    def describe_placement(self) -> str:
        """One line: how many nodes the actors are on, and each actor's node."""
        nodes = {info["node_id"] for info in self.placement}
        where = ", ".join(
            f"{index} on {info['node_id'][:8]} ({info['node_ip']}, pid {info['pid']})"
            for index, info in enumerate(self.placement)
        )
        kind = "warm actors" if self.lease is not None else "actors"
        return f"{kind} on {len(nodes)} node{'s' if len(nodes) > 1 else ''}: {where}"

    @property
    def can_lose_hosts(self) -> bool:
        return True

    def _share(self, value: Any) -> Any:
        return self._ray.put(value)

    def central_optimum(self, task: str, weight_decay: float) -> float | None:
        """A Ray task beside actor 0 (its node reads the store; soft: anywhere if that node is
        gone), taking no CPU of the pool: the hosts' rounds go on meanwhile."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        near = NodeAffinitySchedulingStrategy(self.placement[0]["node_id"], soft=True)
        remote = remote_function(store_optimum).options(num_cpus=0, scheduling_strategy=near)
        return self._ray.get(remote.remote(self._store_location, task, weight_decay))

    def _call(
        self, method: str, calls: list[Call], check: Callable[[], None] | None = None
    ) -> list:
        busy = [index for index, args in enumerate(calls) if args is not None]
        futures = [getattr(self.actors[index], method).remote(*calls[index]) for index in busy]
        pending = futures if check is not None else []
        while pending:
            _, pending = self._ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            if pending:
                check()
        return self._answers(busy, futures)

    def _answers(self, hosts: list[int], futures: list) -> list:
        """The calls' results in host order; ``HostsLost`` naming every host that died, or that
        Ray restarted since its last call (it refuses with ``ClientStatesLost``: its node died
        while it had nothing to do, e.g. between rounds)."""
        from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

        answers, lost, cause = [], [], None
        for host, future in zip(hosts, futures, strict=True):
            try:
                answers.append(self._ray.get(future))
            except (RayActorError, ObjectLostError) as error:  # a result on a lost node too
                lost.append(host)
                cause = cause or error
            except RayTaskError as error:
                refusal = _states_lost(error)
                if refusal is None:
                    raise
                lost.append(host)
                cause = cause or refusal  # its message, not Ray's process title
        if lost:
            raise HostsLost(lost, cause)
        return answers

    def await_hosts(
        self, timeout_s: float | None = None, check: Callable[[], None] | None = None
    ) -> None:
        """Wait until every actor answers again (Ray restarts lost ones on a node with room);
        ``placement`` is updated. ``HostsUnavailable`` when an actor is dead for good (its
        restarts spent) or not running within ``timeout_s`` (``restart_timeout_s``): no
        surviving node can host it, or its new process is still starting (``_unplaceable``).
        ``check`` is polled every ``POLL_S`` meanwhile: what it raises ends the wait (a stop
        signal)."""
        from ray.exceptions import GetTimeoutError, RayActorError, UnserializableException

        timeout_s = restart_timeout_s() if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.actors)))
        while waiting:
            if check is not None:
                check()
            for index in sorted(waiting):
                record = self._actor_record(index)
                if record.state == "DEAD":
                    raise HostsUnavailable(self._dead(index, record))
                if record.state != "ALIVE":
                    continue
                try:
                    self.placement[index] = self._ray.get(
                        self.actors[index].info.remote(), timeout=PING_S
                    )
                    waiting.discard(index)
                # Still on the dead node, for the GCS; or its restart failing, with an error
                # Ray cannot send (reported once the GCS marks it dead: ``_dead``).
                except (RayActorError, GetTimeoutError, UnserializableException):
                    continue
                if self.placement[index]["device"] is None:  # a warm actor, restarted empty
                    self._reopen(index)
            if waiting and time.monotonic() > deadline:
                raise HostsUnavailable(self._unplaceable(sorted(waiting), timeout_s))
            if waiting:
                time.sleep(POLL_S)

    def _reopen(self, index: int) -> None:
        """Lease and open again warm actor ``index``, which Ray restarted without its host
        (and lease); its clients' states, if any, are refused until the driver loads them."""
        refusal = lease_again(self.lease, index)
        if refusal is not None:
            raise HostsUnavailable(f"executor: restarted warm actor {index}: {refusal}")
        states_lost = self._host_kwargs["algorithm"].control_variates
        self.placement[index] = self._ray.get(self._open(index, states_lost))

    def _actor_record(self, index: int) -> ActorRecord:
        """What the GCS records of actor ``index`` (DEAD where it has no record). Read raw
        (Ray 2.60's actor table; no public API): the parsed ``ray._private.state.actors``
        keeps neither the worker id nor an address the GCS cleared."""
        from ray._private.state import state
        from ray.core.generated import gcs_pb2

        raw = state.get_actor_info(self.actors[index]._actor_id)
        if raw is None:
            return ActorRecord("DEAD", 0, "")
        data = gcs_pb2.ActorTableData.FromString(raw)
        name = gcs_pb2.ActorTableData.ActorState.Name(data.state)
        return ActorRecord(name, data.num_restarts, data.address.worker_id.hex())

    def _dead(self, index: int, record: ActorRecord) -> str:
        """Why actor ``index`` is dead for good: the error its constructor raised as Ray
        restarted it (``constructor_failure``), else its restarts spent."""
        try:
            self._ray.get(self.actors[index].info.remote(), timeout=PING_S)
        except Exception as error:  # noqa: BLE001  (Ray's report of the death, whatever its type)
            cause = constructor_failure(error)
            if cause is not None:
                return f"executor: actor {index} failed as Ray restarted it: {cause}"
        return (
            f"executor: actor {index} cannot be restarted (Ray restarted it "
            f"{record.restarts} times, at most {MAX_RESTARTS}); "
            "resume the run once the cluster is healthy"
        )

    def _unplaceable(self, waiting: list[int], timeout_s: float) -> str:
        """Why ``waiting`` are not running again after ``timeout_s``: Ray has leased no new
        worker for them (no room, or a node still starting the worker), or it has and that
        process has not answered. Only the GCS's record tells them apart: the free CPU count
        leaves out what a starting process holds already. One dead meanwhile: ``_dead``."""
        starting, unplaced = [], []
        for index in waiting:
            record = self._actor_record(index)
            if record.state == "DEAD":
                return self._dead(index, record)
            worker = record.worker_id  # empty: no new lease; the lost one: not noticed yet
            placed = bool(worker) and worker != self.placement[index]["worker_id"]
            (starting if placed else unplaced).append(index)
        free = self._ray.available_resources()
        nodes = sum(node["Alive"] for node in self._ray.nodes())
        reasons = []
        if unplaced:
            reasons.append(
                f"actors {unplaced} lost with their node could not be restarted within "
                f"{timeout_s:g} s: Ray has leased no new worker for them: no surviving node has "
                f"room for them ({nodes} nodes alive, free CPU {free.get('CPU', 0):g}, GPU "
                f"{free.get('GPU', 0):g}), or a node has not finished starting its worker: add a "
                "node (or lower executor.num_actors / cpus_per_actor) or give them longer "
                "($DPFL_RESTART_TIMEOUT_S), and resume the run"
            )
        if starting:
            reasons.append(
                f"actors {starting} were restarted but did not answer within {timeout_s:g} s: "
                "Ray gave them new processes, still starting (a loaded node, or a slow store or "
                "import): give them longer ($DPFL_RESTART_TIMEOUT_S) and resume the run"
            )
        return "executor: " + "; ".join(reasons)

    def close(self) -> None:
        """Kill the actors and drop their handles now, while this Ray session lasts: a handle
        released after ``ray.shutdown`` is released in the next session, where actor ids start
        again from the same numbers (job 01000000 on a fresh cluster) and it would take a
        reference off that session's actor of the same id, which then dies."""
        if self.lease is not None:
            release(self.lease)  # kept for the next run
        else:
            for actor in self.actors:
                self._ray.kill(actor)
        self.actors = []


def _states_lost(error: BaseException) -> BaseException | None:
    """A restarted actor's refusal (``ClientStatesLost``) that a failed call raised, or None.
    Ray raises it as a ``RayTaskError`` whose ``cause`` it is (and which is also an instance
    of the cause's class)."""
    from actors.ray_actor import ClientStatesLost

    cause = getattr(error, "cause", None)
    if isinstance(cause, ClientStatesLost):
        return cause
    return error if isinstance(error, ClientStatesLost) else None
