"""Executors run a round's cohort and return its sum; the driver never sees single updates.

Both executors are a pool of ``ClientHost``s (``HostPool``): clients are pinned to hosts by size
(where their data and state live), each round's cohort is split over the hosts — evened out by
local steps for algorithms without client state (``actors.scheduling.balance_round``) — and the
hosts' partial aggregates are summed in host order. ``LocalExecutor``'s hosts live in this
process and run on threads (torch releases the GIL inside its kernels, so two hosts at one
intra-op thread each keep two cores busy with the convolutions of two clients at once);
``RayExecutor``'s (``cluster.runtime.ray_executor``) are Ray actors, broadcast to once per round
with ``ray.put``. With the same number of hosts the two give each host the same clients (hence
the same vmapped batches) and sum the same partials in the same order: they agree bit for bit.
"""

from __future__ import annotations

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
from algorithms.algorithm import Algorithm
from cluster.runtime.central_optimum import central_optimum
from cluster.runtime.ray_runtime import ResourceError
from datasets.store import ShardStore
from models import draws_from_global_rng

MAX_RESTARTS = 3  # per actor (Ray restarts it), and losses of hosts per run (the driver)
POLL_S = 0.1  # how often a round waiting for its hosts looks for a stop signal

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
    """Lost hosts that cannot be brought back: no surviving node has room for them, they did
    not finish starting in time, or Ray gave up restarting them. The run stops at its last
    valid point (``Simulation``), where ``cluster.runtime.experiment`` writes its checkpoint
    and says where it is."""


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

    def between_rounds(self) -> None:
        """Called by the driver before each round, before any of it is charged or sent: where
        an executor may change hosts (``OverlappedStart``'s hand-over). A pool's never do."""
        return

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
        data_seed: int | None = None,
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
                    data_seed=data_seed,
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
