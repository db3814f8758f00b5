"""The Ray actors that wrap a ``ClientHost`` on the device Ray assigns them: ``ClientHostActor``
for one run, ``WarmHostActor`` kept between runs (``executor.keep_warm_s``). Plain classes:
``cluster.runtime.code_shipping.actor_class`` makes them Ray actors (``WARM_ACTOR_OPTIONS``:
the warm one's decorator options), or their stand-ins where the code is shipped."""

from __future__ import annotations

import gc
import os
import threading
import time

import ray
import torch

from actors.client_host import Broadcast, ClientHost, EvalResult, TrainDiagnostics
from actors.scheduling import pin_clients
from algorithms.aggregate import PartialAggregate
from algorithms.dynamo_import import wait_for_dynamo_import
from datasets.store import ShardStore


class ClientStatesLost(RuntimeError):
    """A restarted actor asked for its clients' states before they were loaded back."""


class HostNotOpen(ClientStatesLost):
    """A warm actor called for a run that holds no host in it: Ray restarted its process, which
    lost the host with it, or the run's lease went to another run. The driver treats it as a
    lost host (``RayExecutor.await_hosts`` opens it again)."""


def build_host(
    cpus_per_actor: float, gpus_per_actor: float, pinned: tuple[int, int], host_kwargs: dict
) -> ClientHost:
    """This process's ``ClientHost``: ``pinned`` is (the actor's index, number of actors). The
    actor works out its clients with the driver's rule (``pin_clients``) instead of receiving
    their ids: a list of 50,000 ids would put the constructor's arguments in the object store,
    from where Ray cannot always restore them when it restarts the actor (ray-project/ray#53727).
    """
    torch.set_num_threads(max(1, int(cpus_per_actor)))
    device = "cpu"
    # Ray sets CUDA_VISIBLE_DEVICES per actor; the first visible GPU is ours.
    if gpus_per_actor > 0 and ray.get_gpu_ids() and torch.cuda.is_available():
        device = "cuda:0"
        if gpus_per_actor < 1:
            # Ray's GPU fractions are logical; cap this process to its share of memory.
            torch.cuda.set_per_process_memory_fraction(gpus_per_actor, 0)
    index, count = pinned
    sizes = ShardStore.open(host_kwargs["store_path"]).client_sizes
    host = ClientHost(device=device, client_ids=pin_clients(sizes, count)[index], **host_kwargs)
    # The actor answers once its first round runs at full speed: an embedded Ray's driver runs
    # the rounds itself until then (``overlapped_start``), where the round would otherwise wait.
    wait_for_dynamo_import()
    return host


class HostCalls:
    """The calls the driver makes on a host actor, whichever kind holds it (``host``)."""

    index: int
    states_lost: bool
    host: ClientHost | None

    def _host(self) -> ClientHost:
        if self.host is None:
            raise HostNotOpen(
                f"warm actor {self.index} holds no host for this run (Ray restarted it, or it "
                "was released): open it again"
            )
        return self.host

    def info(self) -> dict:
        """Where this actor runs: its process id, Ray worker id (hex), torch device (None: no
        host open), Ray node id and node IP."""
        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "worker_id": context.get_worker_id(),
            "device": str(self.host.device) if self.host is not None else None,
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
        }

    def _check_states(self) -> None:
        if self.states_lost:
            raise ClientStatesLost(
                f"actor {self.index} was restarted and holds none of its clients' states: "
                "load_client_states first"
            )

    def run_round(
        self, round_index: int, broadcast: Broadcast, client_ids: list[int], nominal: float
    ) -> PartialAggregate:
        self._check_states()
        return self._host().run_round(round_index, broadcast, client_ids, nominal)

    def evaluate(self, params, start: int, stop: int, split: str = "test") -> EvalResult:
        return self._host().evaluate(params, start, stop, split)

    def evaluate_clients(self, params) -> EvalResult:
        return self._host().evaluate_clients(params)

    def train_diagnostics(self, params) -> TrainDiagnostics:
        return self._host().train_diagnostics(params)

    def client_states(self) -> dict:
        self._check_states()
        return self._host().client_states()

    def load_client_states(self, states: dict) -> None:
        self._host().load_client_states(states)
        self.states_lost = False


class ClientHostActor(HostCalls):
    """One run's host: built with the actor, killed at the run's end."""

    def __init__(
        self,
        cpus_per_actor: float,
        gpus_per_actor: float,
        pinned: tuple[int, int],
        **host_kwargs,
    ):
        self.host = build_host(cpus_per_actor, gpus_per_actor, pinned, host_kwargs)
        # Restarted by Ray (its node or process died): its clients' states went with it.
        # Until the driver loads them back, a round or a state read would silently start
        # SCAFFOLD's c_i from zero: refused instead.
        self.index = pinned[0]
        self.states_lost = (
            host_kwargs["algorithm"].control_variates
            and ray.get_runtime_context().was_current_actor_reconstructed
        )


# Lease calls answer at once, also while the actor trains a round for its holder.
WARM_ACTOR_OPTIONS = {"concurrency_groups": {"lease": 1}}


class WarmHostActor(HostCalls):
    """A detached host process kept between runs, so that the next run on this Ray skips the
    process start and the imports (Ray gives every job fresh worker processes otherwise).

    Created for a pool of code ``digest`` (the creating driver's ``actors.code_digest``, which
    names the pool: ``cluster.runtime.warm_pool``). A run leases it (``lease``: refused while
    another run whose driver is alive holds it), opens its own ``ClientHost`` in it (``open``:
    built exactly as ``ClientHostActor`` builds one) and releases it at its end (``release``:
    the host and its clients' states are dropped). After ``keep_warm_s`` seconds without a lease
    the actor ends itself and gives its CPUs and GPUs back to Ray.

    Ray restarts it (``max_restarts``) after its process or node died, as it restarts a fresh
    actor: the run that held it opens it again (``lease`` with ``reopen``). Its restart budget
    is then partly spent, so no later run leases it: it ends when that run releases it.
    """

    def __init__(self, index: int, digest: str, keep_warm_s: float):
        self.index, self.states_lost = index, False
        self.digest = digest
        self.host: ClientHost | None = None
        self.holder: tuple[str, str] | None = None  # (lease token, the holder's job id)
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        # Restarted: its run's driver needs time to notice and open it again.
        self.idle_s = max(keep_warm_s, RESTARTED_GRACE_S) if self.restarted else keep_warm_s
        self.idle_since = time.monotonic()
        self.ending = False  # decided to end: leases are refused from then on
        self.lock = threading.Lock()
        threading.Thread(target=self._end_when_idle, daemon=True).start()

    @ray.method(concurrency_group="lease")
    def lease(
        self, token: str, job_id: str, digest: str, keep_warm_s: float, reopen: bool = False
    ) -> str | None:
        """Take this actor for the run ``token`` of job ``job_id`` running code ``digest``,
        to be kept ``keep_warm_s`` seconds after its release: None when taken, else why not.
        ``reopen``: the run held it before Ray restarted it."""
        with self.lock:
            if self.ending:
                return "it is ending"
            if digest != self.digest:
                return "it runs other code (or other library versions) than this run"
            if self.restarted and not reopen:
                return "Ray restarted it in an earlier run (part of its restart budget is spent)"
            if self.holder is not None and self.holder[0] != token:
                if _job_alive(self.holder[1]):
                    return f"another run (Ray job {self.holder[1]}) holds it"
                self._drop()
            self.holder, self.idle_s = (token, job_id), keep_warm_s
            return None

    def open(
        self,
        token: str,
        cpus_per_actor: float,
        gpus_per_actor: float,
        pinned: tuple[int, int],
        host_kwargs: dict,
        states_lost: bool = False,
    ) -> dict:
        """Build the run's host (``build_host``) and answer ``info``. ``states_lost``: the run
        had client states in this actor before Ray restarted it; they are refused until loaded
        back, as a restarted ``ClientHostActor`` refuses them. The lock is not held during the
        build: leases asked meanwhile are answered at once."""
        with self.lock:
            self._check_holder(token)
            self._drop()
        host = build_host(cpus_per_actor, gpus_per_actor, pinned, host_kwargs)
        with self.lock:
            self._check_holder(token)  # released meanwhile (the run ended)
            self.host, self.index, self.states_lost = host, pinned[0], states_lost
        return self.info()

    @ray.method(concurrency_group="lease")
    def release(self, token: str) -> None:
        """The run ``token`` is done with this actor: its host is dropped, the idle clock
        starts; a restarted actor ends instead (its restart budget is partly spent)."""
        with self.lock:
            if self.holder is None or self.holder[0] != token:
                return
            self._drop()
            self.holder = None
            self.ending = self.restarted
        if self.ending:
            _end_self()

    @ray.method(concurrency_group="lease")
    def retire_if_free(self) -> bool:
        """End this actor now unless a live run holds it (another run needs its room):
        whether it ends."""
        with self.lock:
            self.ending = self.ending or self.holder is None or not _job_alive(self.holder[1])
        if self.ending:
            _end_self()
        return self.ending

    def _check_holder(self, token: str) -> None:
        if self.holder is None or self.holder[0] != token:
            raise HostNotOpen(f"warm actor {self.index}: this run does not hold its lease")

    def _drop(self) -> None:
        self.host, self.states_lost = None, False
        self.idle_since = time.monotonic()
        gc.collect()  # the store's memory maps and the model go now, not at some later call

    def _end_when_idle(self) -> None:
        """The idle clock's thread: until the actor ends (here, or where ``release`` or
        ``retire_if_free`` end it)."""
        while not self.ending:
            time.sleep(min(IDLE_CHECK_S, max(MIN_IDLE_CHECK_S, self.idle_s / 4)))
            try:
                if self._idle_too_long():
                    _end_self()
            except Exception:  # noqa: BLE001  (a GCS blip: look again next time)
                continue

    def _idle_too_long(self) -> bool:
        """Whether the actor has had no holder for ``idle_s`` (then it is ``ending``); a holder
        whose driver died is dropped first."""
        with self.lock:
            if self.holder is not None and not _job_alive(self.holder[1]):
                self._drop()  # its run's driver died without releasing it
                self.holder = None
            if self.holder is None and time.monotonic() - self.idle_since > self.idle_s:
                self.ending = True
            return self.ending


# How often a warm actor looks whether it is idle, or its holder's driver gone: a quarter of
# its keep_warm_s, within these bounds.
IDLE_CHECK_S, MIN_IDLE_CHECK_S = 5.0, 0.25
# How long a restarted warm actor waits for its run to open it again (the driver's wait for
# restarted actors, RayExecutor.await_hosts, is DPFL_RESTART_TIMEOUT_S, 120 s by default).
RESTARTED_GRACE_S = 300.0


def _end_self() -> None:
    """End this actor for good (no restart): Ray frees its resources and its name."""
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def _job_alive(job_id: str) -> bool:
    """Whether the GCS lists job ``job_id`` as running (its driver has not exited)."""
    from ray._private.state import jobs  # the GCS job table; no public API outside the jobs SDK

    return any(job["JobID"] == job_id and not job["IsDead"] for job in jobs())
