"""``OverlappedStart``: a run's first rounds run in this process while Ray's actors start.

An embedded Ray costs a run on 2 cores 5–9 s before its actors answer: Ray's own processes
(≈ 2.7 s of CPU) and each actor's interpreter importing Ray and torch (≈ 4 s of CPU each:
``docs/benchmarks.md``), none of which a run can skip, since Ray gives every job fresh worker
processes. Meanwhile this process has the store
open, torch imported and the model built. So the rounds start at once on the local executor's
hosts, as many as the actors and each pinned the same clients (``HostPool``): every round is
bit-identical to the actors' (the two executors agree bit for bit,
``cluster.runtime.executors``). Ray starts on a thread; between rounds after its actors
answered (``between_rounds``, on the caller's thread), the clients' states (SCAFFOLD's c_i)
move to the actors, the in-process hosts are closed and the actors take every call. What the run
computes does not depend on when that happens; only its wall time does.

Applies with CPU actors on an embedded Ray only (``applies``): a running Ray's actors may be on
other machines, where this process should hold no clients' data (and on a running head the
overlap did not shorten workload A: ``docs/benchmarks.md``), and a GPU would keep this
process's CUDA context for the whole run. While both exist the clients' data is held twice
(each host caches at most ``DEFAULT_CACHE_BYTES`` of it), so ``auto`` leaves it off where that
would take more than ``MEMORY_SHARE`` of this machine's memory.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from actors.client_data import DEFAULT_CACHE_BYTES
from cluster.config import ExperimentConfig
from cluster.config.runtime import starts_embedded_ray
from cluster.runtime.central_optimum import central_optimum
from cluster.runtime.executors import HostPool, HostsUnavailable, LocalExecutor
from cluster.runtime.memory import check_fits_memory, physical_memory
from datasets.store import ShardStore
from datasets.tasks import TASKS

MEMORY_SHARE = 0.25  # of this machine's memory that a second copy of the hosts' data may take


def ray_here_only(config: ExperimentConfig) -> bool:
    """Whether this run starts a Ray of its own (``starts_embedded_ray``: its nodes are this
    machine's alone) and is not connected to one yet."""
    return starts_embedded_ray(config.executor) and not _connected()


def _connected() -> bool:
    """Whether this process is connected to a Ray already (a notebook's, an earlier run's)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def in_process_bytes(store: ShardStore, num_hosts: int, task: str) -> int:
    """The hosts' data in this process, at most: every training row as the float32 values of
    the task's model input (``Preprocess.shape``: a framed image is larger than stored) and an
    int64 label, or each host's cache budget where that is less."""
    rows = int(store.offsets[-1])
    values = int(np.prod(TASKS[task].preprocess.shape(tuple(store.manifest["x_shape"]))))
    return min(rows * (4 * values + 8), num_hosts * DEFAULT_CACHE_BYTES)


def applies(config: ExperimentConfig, store: ShardStore) -> tuple[bool, str | None]:
    """Whether this run overlaps Ray's start with its first rounds, and, where ``auto`` leaves
    it off, why (a line for the terminal). ``true`` where the data held twice exceeds this
    machine's memory is a ``ConfigError``."""
    e = config.executor
    if e.overlap_start is False or not ray_here_only(config) or e.gpus_per_actor > 0:
        forced = e.overlap_start is True and _connected()  # the rest is refused by the checks
        return False, (
            "executor: the actors start before the first round (overlap_start: this process "
            "is connected to a Ray already)"
            if forced
            else None
        )
    need, have = in_process_bytes(store, e.num_actors, config.task), physical_memory()
    if e.overlap_start is True:  # the actors hold their copy on this machine too
        check_fits_memory(
            "executor.overlap_start",
            True,
            2 * need,
            "holding the clients' data in this process and in the actors at once",
            "set executor.overlap_start: false (auto leaves it off where the data would take "
            f"over {MEMORY_SHARE:.0%} of the memory)",
            have,
        )
    elif need > MEMORY_SHARE * have:
        return False, (
            f"executor: the actors start before the first round (overlap_start: the clients' "
            f"data, {need / 2**30:.3g} GiB, would be held twice meanwhile, on a machine of "
            f"{have / 2**30:.3g} GiB)"
        )
    return True, None


class StartHooks:
    """What a Ray start on ``OverlappedStart``'s thread tells it, and asks it: ``connected()``
    once Ray is connected, ``created(actors)`` with the fresh actors' handles before their
    start is waited for, ``cancelled()`` whether the run no longer needs them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._cancelled = False
        self._actors: list = []

    def connected(self) -> None:
        self._connected.set()

    def is_connected(self) -> bool:
        return self._connected.is_set()

    def created(self, actors: list) -> None:
        with self._lock:
            self._actors = list(actors)
            if not self._cancelled:
                return
        _kill(actors)  # cancelled as they were created

    def cancelled(self) -> bool:
        with self._lock:
            return self._cancelled

    def cancel(self) -> None:
        """No actor is needed any more: those created are killed (their start's wait ends with
        an error), none is created after this."""
        with self._lock:
            self._cancelled = True
            actors = self._actors
        _kill(actors)


def _kill(actors: list) -> None:
    import ray

    for actor in actors:
        ray.kill(actor)


StartRay = Callable[[Callable[[str], None], StartHooks], HostPool | None]


class OverlappedStart:
    """Every call of a ``HostPool`` goes to the local executor until ``start_ray`` (run on a
    thread from construction) has returned the started Ray executor, and to that one from the
    first round after it. ``say`` gets, on the caller's thread, the lines the start leaves (at
    the next call) and one at the hand-over."""

    def __init__(
        self,
        make_local: Callable[[], LocalExecutor],
        start_ray: StartRay,
        store: ShardStore,
        say: Callable[[str], None] = lambda message: None,
    ):
        """Ray's start begins first, then ``make_local()`` builds the in-process hosts.
        ``start_ray(say, hooks)`` connects to Ray and starts the actors, telling ``hooks``
        (``StartHooks``), and returns their executor once they answer (None: cancelled first).
        It connects without Ray's core failure signal handlers (``ray_runtime.connect``), and
        off the main thread ``ray.init`` sets no SIGTERM handler: the command's stop signals
        keep theirs throughout."""
        self._store = store
        self._say = say
        self._hooks = StartHooks()
        self._lines: deque[str] = deque()  # appended by the start's thread
        self._started_at = time.monotonic()
        self.rounds_in_process = 0
        self._started: Future = Future()  # the actors' executor, or None: cancelled
        self._pending = True  # not handed over, nor closed
        starter = threading.Thread(target=self._start, args=(start_ray,), name="ray-start")
        starter.daemon = True
        starter.start()
        try:
            local = make_local()
        except BaseException:
            self._close_ray()
            raise
        self._pool: HostPool = local
        self._local: LocalExecutor | None = local

    def _start(self, start_ray: StartRay) -> None:
        """The thread that starts Ray, and then lives as long as this process: Ray's processes
        die with the thread that started them (``prctl(PR_SET_PDEATHSIG)``, in
        ``ray._private.utils``), and they must outlive ``ray.shutdown``."""
        try:
            self._started.set_result(start_ray(self._lines.append, self._hooks))
        except BaseException as error:  # noqa: BLE001  (raised where the actors are called)
            self._started.set_exception(error)
        finally:
            self._hooks.connected()  # or failed: either way no more of Ray starts
        threading.Event().wait()

    def _settle(self) -> None:
        """On the caller's thread, at every call: the start's lines said."""
        while self._lines:
            self._say(self._lines.popleft())

    def between_rounds(self) -> None:
        """The actors take over here once they answer: between rounds only, before the next
        is charged to the accountant, where the hosts' client states are those of the
        driver's last round, so that a start that failed stops the run with a checkpoint that
        matches itself."""
        self._settle()
        if self._pending and self._started.done():
            self._hand_over()

    def _hand_over(self) -> None:
        self._pending = False
        try:
            actors = self._started.result()
        except Exception as error:
            self._settle()
            raise HostsUnavailable(
                f"executor: Ray's actors did not start ({type(error).__name__}: {error}) while "
                f"{_rounds(self.rounds_in_process)} ran in this process (to see the start "
                "fail before any round, with Ray's own error, set executor.overlap_start=false; "
                "executor.kind=local needs no Ray)"
            ) from error
        local, self._pool, self._local = self._local, actors, None
        try:  # a loss of actors here is the run's to recover from: they are its hosts now
            actors.load_client_states(local.client_states())
        finally:
            local.close()
        self._settle()
        waited = time.monotonic() - self._started_at
        self._say(
            f"executor: the actors took over after round {self.rounds_in_process} (they "
            f"answered {waited:.1f} s after the start; rounds 1–{self.rounds_in_process} ran in "
            "this process meanwhile)"
            if self.rounds_in_process
            else f"executor: the actors answered after {waited:.1f} s, before the first round"
        )

    def _call(self, method: str, *args):
        self._settle()
        return getattr(self._pool, method)(*args)

    def run_round(self, round_index, broadcast, cohort, nominal, check=None):
        pool = self._pool
        result = pool.run_round(round_index, broadcast, cohort, nominal, check)
        if pool is self._local:
            self.rounds_in_process += 1
        return result

    def evaluate(self, params: np.ndarray, split: str = "test"):
        return self._call("evaluate", params, split)

    def evaluate_clients(self, params: np.ndarray):
        return self._call("evaluate_clients", params)

    def train_diagnostics(self, params: np.ndarray):
        return self._call("train_diagnostics", params)

    def client_states(self) -> dict:
        return self._call("client_states")

    def load_client_states(self, states: dict) -> None:
        self._call("load_client_states", states)

    def central_optimum(self, task: str, weight_decay: float) -> float | None:
        """In this process, from the store, whichever hosts train: it runs on its own thread
        from the run's start, and the actors are on this machine anyway. Waiting for them
        instead would hold the first evaluated round until Ray has started."""
        return central_optimum(self._store, task, weight_decay)

    @property
    def can_lose_hosts(self) -> bool:
        """True from the start: the actors, which can be lost, take over during the run, and
        a loss after that rolls back to a point kept before it."""
        return True

    def await_hosts(self, timeout_s: float | None = None, check=None) -> None:
        self._pool.await_hosts(timeout_s, check)  # only the actors lose hosts

    def describe_placement(self) -> str:
        if self._local is not None:
            return f"{self._local.num_hosts} hosts in this process (Ray's actors starting)"
        return self._pool.describe_placement()

    def _close_ray(self) -> None:
        """The start not handed over, ended: actors created are killed, none is created from
        here, and a ``ray.init`` in progress is waited for, through stop signals too (it
        cannot be cut short, and Ray must not be shut down under it); an error of that start
        changes nothing now."""
        if not self._pending:
            return
        self._pending = False
        self._hooks.cancel()
        if not self._hooks.is_connected():
            self._say("executor: waiting for ray.init to return, to stop Ray's start")
        interrupted = None
        while True:
            try:
                error = self._started.exception()
                break
            except KeyboardInterrupt as signal_error:  # the first is raised once Ray is up
                interrupted = interrupted or signal_error
        if error is None and self._started.result() is not None:
            self._started.result().close()
        if interrupted is not None:
            raise interrupted

    @property
    def num_hosts(self) -> int:
        return self._pool.num_hosts

    def close(self) -> None:
        """Close whichever executors exist. A Ray still starting is stopped (``_close_ray``)."""
        if self._local is not None and self.rounds_in_process:
            self._say(
                f"executor: every round ({self.rounds_in_process}) ran in this process before "
                "Ray's actors answered"
            )
        self._close_ray()
        self._pool.close()


def _rounds(count: int) -> str:
    return f"{count} round{'s' if count != 1 else ''}"
