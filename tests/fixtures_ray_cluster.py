"""A three-node Ray cluster on this machine: a head and two worker nodes, each its own raylet.

``ray.cluster_utils.Cluster`` starts every node in-process as separate daemons (GCS on the head,
one raylet and object store per node), so a worker node can be killed alone: ``drive`` has its
driver SIGKILL one's raylet, as if the machine had gone (the actor processes on it exit when their
raylet does). What the harness pins down:

* Placement is observable: the head has no CPU (no actor lands there, the driver stays alone),
  and each worker node has a custom resource naming it (``worker_a``, ``worker_b``), which
  ``node_name`` reads back from a node id that an actor reports.
* Loopback only: the nodes are started with Ray's single-node address rule switched on
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, see ``cluster.runtime.ray_runtime.loopback_node``), so
  every node's IP is 127.0.0.1 and its servers listen on loopback; nothing outside this machine
  is contacted. The nodes' processes keep the variable (a job's driver resolves its node's
  address by the same rule), and so do the drivers ``drive`` starts.
* Node death is detected in about 2 s instead of Ray's ~15 s: the GCS probes each raylet every
  ``HEALTH_PERIOD_MS`` and declares it dead after ``HEALTH_FAILURES`` probes unanswered within
  ``HEALTH_TIMEOUT_MS`` (generous enough not to declare a live node dead on 2 busy cores).
* Its own temporary directory (``RAY_TMPDIR`` while its nodes start and stop): the address
  file that ``Cluster`` writes for ``ray.init(address="auto")`` goes there, not to
  ``/tmp/ray`` where others would find it (or lose theirs when it is deleted).
* Worker nodes have 2 logical CPUs each: a pool of two 1-CPU actors spread over them fits on
  one survivor after the other is killed. Each test gets a cluster of its own
  (``ray_cluster``; ≈ 20 s to start on 2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from cluster.runtime.ray_runtime import (
    PROJECT_ROOT,
    loopback_node,
    prepend_pythonpath,
)

HEALTH_PERIOD_MS = 500
HEALTH_TIMEOUT_MS = 1000
HEALTH_FAILURES = 2
WORKER_CPUS = 2
WORKERS = ("worker_a", "worker_b")
LOST_NODE = "worker_b"  # the worker node ``drive`` kills
NODE_MEMORY = 100 * 1024 * 1024  # each node's object store: the tests' objects are small

SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": HEALTH_PERIOD_MS,
    "health_check_timeout_ms": HEALTH_TIMEOUT_MS,
    "health_check_failure_threshold": HEALTH_FAILURES,
    # the embedded Ray's quicker object-store connection (cluster.runtime.ray_runtime)
    "raylet_client_connect_timeout_milliseconds": 100,
    "raylet_client_num_connect_attempts": 100,
}


@dataclass
class LocalCluster:
    """The running cluster: ``address`` to connect to, worker nodes by resource name."""

    cluster: object  # ray.cluster_utils.Cluster
    temp_dir: str
    env: dict = field(default_factory=dict)  # the nodes' environment besides this process's
    dashboard_port: int | None = None  # the job server's, on 127.0.0.1
    workers: dict = field(default_factory=dict)  # resource name → ray._private.node.Node
    # Where each node gets a temporary directory of its own (``tmp-<node>``), if it does
    node_temp_root: Path | None = None

    @property
    def address(self) -> str:
        return self.cluster.address

    def node_temp_dir(self, name: str) -> Path:
        """The ``TMPDIR`` of node ``name`` (``head`` or a worker's resource name)."""
        assert self.node_temp_root is not None, "the nodes share this process's TMPDIR"
        return self.node_temp_root / f"tmp-{name}"

    def _node_env(self, name: str) -> dict[str, str]:
        if self.node_temp_root is None:
            return self.env
        self.node_temp_dir(name).mkdir(mode=0o700)
        return {**self.env, "TMPDIR": str(self.node_temp_dir(name))}

    def add_worker(self, name: str) -> None:
        with _node_environment(self.temp_dir, self._node_env(name)):
            self.workers[name] = self.cluster.add_node(
                num_cpus=WORKER_CPUS,
                resources={name: 1},
                object_store_memory=NODE_MEMORY,
                temp_dir=self.temp_dir,
            )

    def node_name(self, node_id: str) -> str:
        """``head`` or the worker's resource name, for a node id an actor reported."""
        for node in self.cluster.global_state.node_table():
            if node["NodeID"] == node_id:
                names = [w for w in WORKERS if w in node["Resources"]]
                return names[0] if names else "head"
        raise KeyError(f"no node {node_id} in the cluster")

    def raylet_pid(self, name: str) -> int:
        return self.workers[name].all_processes["raylet"][0].process.pid

    def drive(
        self,
        overrides: list[str],
        kill_after: int | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 240,
        kill_into: float | None = None,
        cwd: Path = PROJECT_ROOT,
    ) -> DriverReport:
        """Run the experiment of ``overrides`` with a driver process of its own connected to
        this cluster (``python -m tests.fixtures_ray_cluster``, ``env`` added to its
        environment), ``LOST_NODE``'s raylet SIGKILLed by that driver once round
        ``kill_after`` is done: at once (the next round's calls go to a dead node), or with
        ``kill_into`` that fraction of round ``kill_after``'s time later, from a thread (in the
        middle of the next round, if it lasts as long); its ``DriverReport``. The driver joins
        as a run with ``executor.address`` does (``ray_runtime.connect``: the code shipped
        through the GCS), in ``cwd``, with the project on its ``PYTHONPATH``; before the run,
        one plain task reports whether a fresh worker finds the project without the package.

        A driver of its own, not this process: in a process that has started an embedded Ray
        while this cluster runs, the cluster's next driver has its first actors cancelled as
        soon as they are scheduled (Ray 2.60: "all references to the actor were removed"),
        so the comparisons' embedded runs have their own processes too (``drive_embedded``);
        and a fresh process is what a real driver is."""
        request = {
            "address": self.address,
            "kill_pid": self.raylet_pid(LOST_NODE) if kill_after is not None else None,
            "kill_after": kill_after,
            "kill_into": kill_into,
        }
        # RAY_ADDRESS: the run's preflight checks the cluster, not this machine's CPUs
        env = {**LOOPBACK, "RAY_ADDRESS": self.address, **(env or {})}
        report = _run_driver(overrides, request, env, timeout, cwd)
        report.nodes = [self.node_name(node_id) for node_id in report.node_ids]
        return report


def drive_embedded(overrides: list[str], timeout: float = 240) -> DriverReport:
    """The experiment of ``overrides`` run by a driver process of its own on an embedded Ray
    (see ``LocalCluster.drive``)."""
    return _run_driver(overrides, {"address": None}, {}, timeout)


# Seen now and then on this 2-core machine when a second or later driver creates its actors
# on the three-node cluster, after an embedded Ray ran on the machine meanwhile (Ray 2.60; not
# understood): the GCS cancels an actor's creation at once, "all references to the actor were
# removed", and the run fails before its first round (in ``make_executor``), having killed
# nothing. Such a driver is started again, once; each test has a cluster of its own.
START_CANCELLED = "The actor never ran - it was cancelled before it started running"


def _run_driver(
    overrides: list[str], request: dict, env: dict, timeout: float, cwd: Path = PROJECT_ROOT
) -> DriverReport:
    import subprocess

    out = Path(tempfile.mkdtemp(prefix="driver-")) / "report.pt"
    request = {"kill_after": None, **request, "overrides": overrides, "out": str(out)}
    path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    try:
        for attempt in (1, 2):
            done = subprocess.run(
                [sys.executable, "-m", "tests.fixtures_ray_cluster", json.dumps(request)],
                cwd=cwd,
                env={**os.environ, "PYTHONPATH": path, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
                check=False,
            )
            if done.returncode == 0 and out.exists():
                break
            started = START_CANCELLED not in done.stdout or "make_executor" not in done.stdout
            if attempt == 2 or started:
                raise DriverFailed(done.returncode, done.stdout)
        report = torch.load(out, weights_only=False)  # written just now by our own driver
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    report.output = done.stdout
    return report


class DriverFailed(RuntimeError):
    def __init__(self, code: int, output: str):
        self.code, self.output = code, output
        super().__init__(f"the driver exited {code}:\n{output[-4000:]}")


@dataclass
class DriverReport:
    """What a driver run on the cluster ended with (``drive``)."""

    params: torch.Tensor
    epsilons: list
    test_accuracies: list
    recoveries: list  # cluster.runtime.simulation.Recovery
    node_ids: list[str]  # each actor's node (the last it ran on)
    killed_at: float | None  # time.monotonic() of the SIGKILL, in the driver
    lines: list[str]
    error: str | None = None  # a HostsUnavailable's message: the run stopped
    checkpoint: str | None = None
    output: str = ""
    nodes: list[str] = field(default_factory=list)
    shipped: str | None = None  # the digest of the code shipped through the GCS
    plain_task_finds_the_project: bool | None = None  # without the shipped package


def _drive(request: dict) -> None:
    """The driver process: connect, run, SIGKILL the raylet on cue, write the report."""
    import signal
    import threading

    import ray

    from cluster.config import load_config
    from cluster.runtime.code_shipping import shipped_digest
    from cluster.runtime.executors import HostsUnavailable
    from cluster.runtime.experiment import run_experiment
    from cluster.runtime.ray_runtime import connect

    report = DriverReport(torch.empty(0), [], [], [], [], None, [])
    if request["address"] is not None:  # else run_experiment starts an embedded Ray
        connect(request["address"])  # loopback addresses: LOOPBACK is in this environment
        report.shipped = shipped_digest()
        finds = ray.remote(lambda: __import__("importlib.util").util.find_spec("actors"))
        report.plain_task_finds_the_project = ray.get(finds.remote()) is not None
    config = load_config(None, request["overrides"])

    def kill() -> None:
        os.kill(request["kill_pid"], signal.SIGKILL)
        report.killed_at = time.monotonic()

    def on_round(record) -> None:
        # once: a roll-back replays the round, and calls this again for it
        if record.round != request["kill_after"] or report.killed_at is not None:
            return
        if request["kill_into"] is None:
            kill()
        else:
            threading.Timer(record.seconds * request["kill_into"], kill).start()

    try:
        outcome = run_experiment(config, on_round=on_round, say=report.lines.append)
    except HostsUnavailable as error:
        report.error = str(error)
    else:
        history = outcome.result.history
        report.params = outcome.result.params
        report.epsilons = [r.epsilon for r in history]
        report.test_accuracies = [r.test_accuracy for r in history]
        report.recoveries = outcome.result.recoveries
        report.checkpoint = str(outcome.checkpoint)
    finally:
        report.node_ids = _actor_nodes() if ray.is_initialized() else []
        ray.shutdown()
    torch.save(report, request["out"])


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's single-node address rule


@contextmanager
def _node_environment(temp_dir: str, env: dict[str, str]) -> Iterator[None]:
    """While a node starts: its processes take loopback addresses, the cluster's own
    ``RAY_TMPDIR`` and ``env``. Only then: an embedded Ray started later by this process
    (other tests, the comparisons here) in the same ``RAY_TMPDIR`` would repoint its
    ``session_latest`` and address file, and this cluster's next driver finds its actors
    cancelled at once."""
    values = {"RAY_TMPDIR": str(Path(temp_dir).parent), **LOOPBACK, **env}
    with _environment(**values), loopback_node():
        yield


@contextmanager
def local_cluster(
    dashboard_port: int | None = None,
    env: dict[str, str] | None = None,
    project_on_nodes: bool = True,
) -> Iterator[LocalCluster]:
    """A head (0 CPUs; with the job server on ``dashboard_port`` when given) and two worker
    nodes, their processes started with ``env`` besides this process's environment; stopped
    (every process of theirs, nothing else) when the block ends. With ``project_on_nodes``
    false the nodes' ``PYTHONPATH`` is empty: their workers find the project only where it is
    shipped to them (or a driver's working directory, which Ray puts on their path, holds it),
    and each node has a ``TMPDIR`` of its own (``LocalCluster.node_temp_dir``), where its
    workers unpack that code, as on machines of their own."""
    from ray.cluster_utils import Cluster

    # Short: Ray's unix sockets live under it and a socket path must stay under 108 bytes.
    root = tempfile.mkdtemp(prefix="rc-")
    temp_dir = os.path.join(root, "ray")  # Ray's own rule for $RAY_TMPDIR: <it>/ray
    os.mkdir(temp_dir)
    cluster = None
    saved_pythonpath = os.environ.get("PYTHONPATH")
    if project_on_nodes:
        prepend_pythonpath(PROJECT_ROOT)  # the nodes' workers import the project
    else:  # also where an embedded Ray of this process put the project there
        env = {**(env or {}), "PYTHONPATH": ""}
    running = LocalCluster(None, temp_dir, env or {}, dashboard_port)
    running.node_temp_root = None if project_on_nodes else Path(root)
    try:
        with _node_environment(temp_dir, running._node_env("head")):
            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,
                    "object_store_memory": NODE_MEMORY,
                    "include_dashboard": dashboard_port is not None,
                    "dashboard_port": dashboard_port,
                    "dashboard_host": "127.0.0.1",
                    "temp_dir": temp_dir,
                    "_system_config": SYSTEM_CONFIG,
                },
                shutdown_at_exit=True,
            )
        running.cluster = cluster
        for name in WORKERS:
            running.add_worker(name)
        cluster.wait_for_nodes()
        yield running
    finally:
        if cluster is not None:
            with _node_environment(temp_dir, env or {}):
                cluster.shutdown()
        if saved_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_pythonpath
        (os.environ.get("KEEP_RC") or shutil.rmtree(root, ignore_errors=True))


@pytest.fixture
def ray_cluster() -> Iterator[LocalCluster]:
    """A three-node cluster of the test's own: a cluster's first driver has always started
    its actors, later ones now and then not (``START_CANCELLED``), and a killed node would
    have to be replaced anyway."""
    pytest.importorskip("ray")
    with local_cluster() as running:
        yield running


def _actor_nodes() -> list[str]:
    """The node of each host actor this driver created (where it ran last: a restarted
    actor's new node)."""
    import ray
    from ray._private.state import actors  # the GCS's actor table; no public API without
    # the dashboard

    job = ray.get_runtime_context().get_job_id()
    mine = [
        a
        for a in actors().values()
        if a["JobID"] == job and a["ActorClassName"] == "ClientHostActor"
    ]
    return [a["Address"]["NodeID"] for a in mine]


if __name__ == "__main__":  # the report's classes pickled by their importable module's name
    from tests.fixtures_ray_cluster import _drive as drive

    drive(json.loads(sys.argv[1]))
