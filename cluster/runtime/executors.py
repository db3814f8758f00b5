"""Executors run a round's cohort and return its sum; the driver never sees single updates.

Both executors are a pool of ``ClientHost``s (``HostPool``): clients are pinned to hosts by size
(where their data and state live), each round's cohort is split over the hosts — evened out by
local steps for algorithms without client state (``actors.scheduling.balance_round``) — and the
hosts' partial aggregates are summed in host order. ``LocalExecutor``'s hosts live in this
process and run on threads (torch releases the GIL inside its kernels, so two hosts at one
intra-op thread each keep two cores busy with the convolutions of two clients at once);
``RayExecutor``'s are Ray actors, broadcast to once per round with ``ray.put``. With the same
number of hosts the two give each host the same clients (hence the same vmapped batches) and
sum the same partials in the same order: they agree bit for bit.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch

from actors.client_host import (
    AUTO_KERNELS,
    Broadcast,
    ClientHost,
    EvalResult,
    Kernels,
    TrainDiagnostics,
)
from actors.client_state import ClientStateStore
from actors.scheduling import balance_round, pin_clients
from algorithms.aggregate import PartialAggregate
from algorithms.presets import Algorithm
from cluster.runtime.central_optimum import central_optimum, store_optimum
from cluster.runtime.ray_runtime import ResourceError
from datasets.store import ShardStore
from models import draws_from_global_rng

MAX_RESTARTS = 3  # per actor (Ray restarts it), and losses of hosts per run (the driver)
POLL_S = 0.1  # how often a round waiting for its hosts looks for a stop signal
# How long lost actors may take to be running again, somewhere ($DPFL_RESTART_TIMEOUT_S: an
# autoscaling cluster may need minutes to add a node).
RESTART_TIMEOUT_S = float(os.environ.get("DPFL_RESTART_TIMEOUT_S", "120"))
PING_S = 5.0  # how long a restarted actor may take to answer its first call

Call = tuple | None  # one host's arguments for a method, or None: that host has nothing to do


class HostsLost(RuntimeError):
    """Hosts died while answering a call (their node was lost, or their process): nothing of
    the call may be used. Ray restarts such actors (``MAX_RESTARTS``) without the clients'
    states; ``RayExecutor.await_hosts`` waits for them, the driver then rolls back
    (``Simulation``)."""

    def __init__(self, hosts: list[int], cause: BaseException):
        self.hosts = hosts
        self.cause = cause
        self.detected_at = time.monotonic()
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(f"lost actor{'s' if len(hosts) > 1 else ''} {hosts}: {reason}")


class HostsUnavailable(ResourceError):
    """Lost hosts that cannot be brought back: no surviving node has room for them, or Ray
    gave up restarting them. The run stops at its last valid point (``Simulation``), where
    ``cluster.runtime.experiment`` writes its checkpoint and says where it is."""


class HostPool(ABC):
    """What an executor does with its hosts, whatever they are: pin the clients, split each
    round's cohort, fan a method out and combine the answers in host order. Subclasses say how
    a host is called (``_call``) and how a large argument is shared by all hosts (``_share``)."""

    def __init__(self, store: ShardStore, algorithm: Algorithm, num_hosts: int):
        self.assignment = pin_clients(store.client_sizes, num_hosts)
        self.owner = np.empty(store.num_clients, dtype=np.int64)
        for host_index, clients in enumerate(self.assignment):
            self.owner[clients] = host_index
        # Clients without state may train on any host: each round's cohort is evened out by
        # local steps; SCAFFOLD's stay with their c_i.
        self.steps = None
        if not algorithm.control_variates:
            self.steps = np.array([algorithm.trainer.num_steps(int(n)) for n in store.client_sizes])
        self.eval_slices = _host_slices(store.manifest["num_test"], num_hosts)
        self.validation_slices = _host_slices(store.num_validation, num_hosts)

    @property
    def num_hosts(self) -> int:
        return len(self.eval_slices)

    @property
    def can_lose_hosts(self) -> bool:
        """Whether a call may raise ``HostsLost`` (hosts in other processes, on other nodes):
        only then does the driver keep a point to roll back to (``Simulation``)."""
        return False

    @abstractmethod
    def _call(
        self, method: str, calls: list[Call], check: Callable[[], None] | None = None
    ) -> list:
        """``method(*args)`` on every host whose ``calls`` entry is not None, concurrently; the
        answers in host order. ``check`` is polled every ``POLL_S`` while they run: what it
        raises leaves the hosts' work behind (a stop signal dropping the round)."""

    def _share(self, value: Any) -> Any:
        return value

    def run_round(
        self,
        round_index: int,
        broadcast: Broadcast,
        cohort: np.ndarray,
        nominal: float,
        check: Callable[[], None] | None = None,
    ) -> PartialAggregate:
        shared = self._share(broadcast)  # once per round, for every host
        owners = self.owner[cohort]
        groups = [cohort[owners == h].tolist() for h in range(self.num_hosts)]
        if self.steps is not None:
            groups = balance_round(groups, self.steps)
        calls = [(round_index, shared, members, nominal) if members else None for members in groups]
        return PartialAggregate.combine(self._call("run_round", calls, check))

    def evaluate(self, params: np.ndarray, split: str = "test") -> EvalResult:
        """Loss and accuracy on the pooled ``test`` or ``validation`` rows, each host a slice."""
        shared = self._share(params)
        slices = self.eval_slices if split == "test" else self.validation_slices
        calls = [(shared, start, stop, split) if stop > start else None for start, stop in slices]
        return EvalResult.combine(self._call("evaluate", calls))

    def evaluate_clients(self, params: np.ndarray) -> EvalResult:
        shared = self._share(params)
        return EvalResult.combine(self._call("evaluate_clients", [(shared,)] * self.num_hosts))

    def train_diagnostics(self, params: np.ndarray) -> TrainDiagnostics:
        """Every client's F_i and ∇F_i at ``params``, summed (each on the host it is pinned to)."""
        shared = self._share(params)
        calls = [(shared,)] * self.num_hosts
        return TrainDiagnostics.combine(self._call("train_diagnostics", calls))

    @abstractmethod
    def central_optimum(self, task: str, weight_decay: float) -> float | None:
        """F(x*) for ``eval_train`` (``cluster.runtime.central_optimum``), found where the hosts
        are: it reads every client's training rows."""

    def client_states(self) -> dict:
        return ClientStateStore.merge(self._call("client_states", [()] * self.num_hosts))

    def load_client_states(self, states: dict) -> None:
        calls = [(ClientStateStore.select(states, self.owner == h),) for h in range(self.num_hosts)]
        self._call("load_client_states", calls)


def _host_slices(rows: int, num_hosts: int) -> list[tuple[int, int]]:
    """``rows`` pooled rows cut into one near-equal [start, stop) slice per host."""
    bounds = np.linspace(0, rows, num_hosts + 1).astype(int)
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))


@contextmanager
def torch_threads(count: int | None):
    """torch's intra-op thread count (process-wide) set to ``count`` for a block, and the
    caller's given back after it (None: left as it is)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class LocalExecutor(HostPool):
    """``num_hosts`` hosts in this process, on as many threads (one host, or a model with
    dropout: the hosts take turns on the calling thread).

    Each host trains its share of a round at torch's intra-op thread count: ``intra_op_threads``
    (``executor.cpus_per_actor``) from here until ``close``, which gives the process its own
    count back (it is process-wide), or the caller's when None."""

    def __init__(
        self,
        store: ShardStore,
        task: str,
        algorithm: Algorithm,
        seed: int,
        num_hosts: int = 1,
        device: str = "cpu",
        test_per_client: int | None = None,
        kernels: Kernels = AUTO_KERNELS,
        intra_op_threads: int | None = None,
    ):
        super().__init__(store, algorithm, num_hosts)
        self._thread_count = ExitStack()  # closed by ``close``, or here if a host fails
        self._thread_count.enter_context(torch_threads(intra_op_threads))
        try:
            self.hosts = [
                ClientHost(
                    store.location,
                    task,
                    algorithm,
                    seed,
                    clients,
                    device,
                    test_per_client=test_per_client,
                    kernels=kernels,
                )
                for clients in self.assignment
            ]
        except BaseException:
            self._thread_count.close()
            raise
        self._threads = None
        # Dropout draws from torch's one global generator, seeded per client: such hosts take
        # turns (same results, no overlap); Ray's actors each have their own.
        if num_hosts > 1 and not draws_from_global_rng(self.hosts[0].objective.model):
            self._threads = ThreadPoolExecutor(num_hosts, thread_name_prefix="client-host")

    def _call(
        self, method: str, calls: list[Call], check: Callable[[], None] | None = None
    ) -> list:
        pairs = zip(self.hosts, calls, strict=True)
        work = [(host, args) for host, args in pairs if args is not None]
        if self._threads is None or len(work) == 1:
            return [getattr(host, method)(*args) for host, args in work]
        futures = [self._threads.submit(getattr(host, method), *args) for host, args in work]
        if check is not None:
            while futures_wait(futures, timeout=POLL_S).not_done:
                check()
        return [future.result() for future in futures]

    def central_optimum(self, task: str, weight_decay: float) -> float | None:
        return central_optimum(self.hosts[0].store, task, weight_decay)

    def close(self) -> None:
        """Release the hosts' threads without waiting for a round a stop signal dropped (its
        result is discarded; the threads end when it does)."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        self._thread_count.close()


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
        kernels: Kernels = AUTO_KERNELS,
        placement: str = "pack",
    ):
        import ray
        from ray.util import get_current_placement_group

        from actors.ray_actor import ClientHostActor

        super().__init__(store, algorithm, num_actors)
        self._ray = ray
        self._store_location = store.location
        options = actor_options(cpus_per_actor, gpus_per_actor, placement)
        group = get_current_placement_group()  # a trial's, or None
        self.actors = [
            ClientHostActor.options(**{**options, **in_trial_group(group, actor_index)}).remote(
                cpus_per_actor,
                gpus_per_actor,
                (actor_index, num_actors),
                store_path=store.location,
                test_per_client=test_per_client,
                kernels=kernels,
                task=task,
                algorithm=algorithm,
                seed=seed,
            )
            for actor_index in range(num_actors)
        ]
        self.placement = self.actor_info()
        self.devices = [info["device"] for info in self.placement]

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
        return f"actors on {len(nodes)} node{'s' if len(nodes) > 1 else ''}: {where}"

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
        remote = self._ray.remote(store_optimum).options(num_cpus=0, scheduling_strategy=near)
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
        restarts spent) or not running within ``timeout_s`` (``RESTART_TIMEOUT_S``): no
        surviving node can host it. ``check`` is polled every ``POLL_S`` meanwhile: what it
        raises ends the wait (a stop signal)."""
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout_s = RESTART_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.actors)))
        while waiting:
            if check is not None:
                check()
            for index in sorted(waiting):
                state = self._actor_state(index)
                if state["State"] == "DEAD":
                    raise HostsUnavailable(
                        f"executor: actor {index} cannot be restarted (Ray restarted it "
                        f"{state.get('NumRestarts', '?')} times, at most {MAX_RESTARTS}); "
                        "resume the run once the cluster is healthy"
                    )
                if state["State"] != "ALIVE":
                    continue
                try:
                    self.placement[index] = self._ray.get(
                        self.actors[index].info.remote(), timeout=PING_S
                    )
                    waiting.discard(index)
                except (RayActorError, GetTimeoutError):  # still on the dead node, for the GCS
                    pass
            if waiting and time.monotonic() > deadline:
                raise HostsUnavailable(self._unplaceable(sorted(waiting), timeout_s))
            if waiting:
                time.sleep(POLL_S)

    def _actor_state(self, index: int) -> dict:
        """The GCS's record of actor ``index`` (State, NumRestarts, DeathCause, ...)."""
        from ray._private.state import actors  # what RuntimeContext itself reads; no public API

        return actors(actor_id=self.actors[index]._actor_id.hex()) or {"State": "DEAD"}

    def _unplaceable(self, waiting: list[int], timeout_s: float) -> str:
        free = self._ray.available_resources()
        nodes = sum(node["Alive"] for node in self._ray.nodes())
        return (
            f"executor: actors {waiting} lost with their node could not be restarted within "
            f"{timeout_s:g} s: no surviving node has room for them ({nodes} nodes alive, free "
            f"CPU {free.get('CPU', 0):g}, GPU {free.get('GPU', 0):g}): add a node (or lower "
            "executor.num_actors / cpus_per_actor) and resume the run"
        )

    def close(self) -> None:
        """Kill the actors and drop their handles now, while this Ray session lasts: a handle
        released after ``ray.shutdown`` is released in the next session, where actor ids start
        again from the same numbers (job 01000000 on a fresh cluster) and it would take a
        reference off that session's actor of the same id, which then dies."""
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
