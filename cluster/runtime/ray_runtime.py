"""Connecting to Ray: inside a Ray job, to a given cluster, or an embedded local instance."""

from __future__ import annotations

import inspect
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class ResourceError(RuntimeError):
    pass


@dataclass(frozen=True)
class RaySession:
    """What ``connect`` connected to, and where that Ray writes its logs."""

    where: str
    logs: str | None  # the session's log directory on this machine (None when remote)

    @property
    def embedded(self) -> bool:
        return self.where == "embedded local Ray"

    def describe(self) -> str:
        return f"Ray: {self.where}" + (f" (its logs: {self.logs})" if self.logs else "")


# The raylet connects to its own object store as soon as it has started it, and a first
# attempt that finds the store's socket not yet listening waits the retry interval, 1 s by
# default: on the 2-core machine `ray.init` took 2.36 s or 3.37 s, the slow one in about half of
# the starts. Retrying every 100 ms (as many attempts more: the same 10 s before giving up, for
# every client of the raylet) made 10 starts of 10 take 2.36–2.39 s.
EMBEDDED_SYSTEM_CONFIG = {
    "raylet_client_connect_timeout_milliseconds": 100,
    "raylet_client_num_connect_attempts": 100,
}


def connect(address: str | None, verbose: bool = False) -> RaySession:
    """Initialise Ray once, quietly unless ``verbose``.

    Quiet: Ray's own INFO/WARNING lines and the workers' stdout/stderr stay in the session's log
    directory (returned, to be printed) instead of interleaving with the run's progress; errors
    raised in actors still reach the driver through ``ray.get``.

    Ray's core failure signal handlers are left out (``without_failure_signal_handler``): the
    command handles its stop signals itself (``cluster.runtime.interrupts``).
    """
    import ray

    if ray.is_initialized():
        return RaySession("existing Ray session", _logs_dir())
    with without_failure_signal_handler():
        return _init(address, verbose)


def _init(address: str | None, verbose: bool) -> RaySession:
    import ray

    from cluster.config.runtime import effective_ray_address, in_ray_job, ray_connection
    from cluster.runtime.code_shipping import publish

    quiet = {
        "log_to_driver": verbose,
        "logging_level": logging.INFO if verbose else logging.ERROR,
    }
    how = ray_connection(address)
    effective = effective_ray_address(address)
    if how == "client":
        # Ray Client: its server process on the head unpickles the driver's objects too, and
        # only a job's working_dir gives that process our code.
        ray.init(address=address, runtime_env={"working_dir": str(PROJECT_ROOT)}, **quiet)
        return RaySession(f"Ray cluster at {effective} (Ray Client)", None)
    if how in ("cluster", "job"):
        # Ray reads $RAY_ADDRESS where ``address`` is None or auto, and a job's config (its
        # runtime environment, which for ``job`` carries the code) from the environment.
        with head_on_this_machine(effective):
            try:
                ray.init(address=address, **quiet)
            except ConnectionError as error:
                raise _not_joined(address, effective, error) from None
        if how == "cluster":
            # The workers need our code: shipped through the GCS (a job's working_dir would
            # start every worker twice: ``code_shipping``).
            try:
                publish()
            except BaseException:
                ray.shutdown()
                raise
        here = effective == "auto" or in_ray_job()  # a head on this machine: its logs here
        code = "the job's runtime environment" if how == "job" else "shipped by this driver"
        where = f"Ray cluster at {ray.get_runtime_context().gcs_address}, the code {code}"
        return RaySession(where, _logs_dir() if here else None)
    # address="local": always a fresh embedded instance, never a cluster that some earlier
    # `ray start` on this machine left in /tmp/ray/ray_current_cluster. Its processes inherit
    # this environment, so the workers find the project on PYTHONPATH; a runtime_env carrying it
    # instead would keep actors off the workers Ray prestarts at init (≈1.3 s more start-up).
    prepend_pythonpath(PROJECT_ROOT)
    with loopback_node(), lean_head(keep_log_monitor=verbose):
        ray.init(
            address="local", include_dashboard=False, _system_config=EMBEDDED_SYSTEM_CONFIG, **quiet
        )
    return RaySession("embedded local Ray", _logs_dir())


@contextmanager
def lean_head(keep_log_monitor: bool) -> Iterator[None]:
    """Within the block, a head node that this process starts leaves out three of Ray's
    Python helper processes, which an embedded Ray serving one run on one machine never uses:

    - the autoscaler monitor (a single node, never scaled: ``RayParams.no_monitor``, what
      ``ray start --no-monitor`` sets);
    - the log monitor, unless ``keep_log_monitor`` (it only forwards the workers' output to
      the driver, which a quiet session does not print: ``RayParams.include_log_monitor``);
    - the dashboard head. ``include_dashboard=False`` still starts it, with only its usage
      statistics module, and ``ray.init`` waits until it has written its URL: Ray 2.60 has no
      option to leave it out (``Node.start_head_processes``), so its start is skipped here.
      The run uses no dashboard API: actor states and resources come from the GCS.

    Starting workload A's two actors on 2 loaded cores, the processes Ray started used 23.2 s
    of CPU with them and 17.8 s without (the dashboard head 2.6 s, the two monitors 3.0 s:
    ``benchmarks/NOTES.md``). ``ray.init`` reads ``RayParams`` and ``Node`` from their modules
    when it starts a node, so both are switched here, in this process only, and restored on
    leaving: a later ``ray start`` or connection to a cluster is unchanged. Where this Ray's
    private ``Node.start_api_server`` or ``RayParams`` are not the ones it was written against
    (``lean_head_applies``), nothing is switched and Ray starts as it is.
    """
    from ray._private import node, parameter

    if not lean_head_applies():
        yield
        return
    saved_params, saved_api_server = parameter.RayParams, node.Node.start_api_server

    class LeanParams(saved_params):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.no_monitor = True
            self.include_log_monitor = keep_log_monitor

    def no_api_server(self, *, include_dashboard, raise_on_failure) -> None:
        self._webui_url = None

    parameter.RayParams, node.Node.start_api_server = LeanParams, no_api_server
    try:
        yield
    finally:
        parameter.RayParams, node.Node.start_api_server = saved_params, saved_api_server


# What ``lean_head`` replaces, as Ray 2.60 has it: Ray's private API, which pyproject's
# ray>=2.50 does not pin, so the switch is made only where it is still this.
API_SERVER_PARAMETERS = (
    ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ("include_dashboard", inspect.Parameter.KEYWORD_ONLY),
    ("raise_on_failure", inspect.Parameter.KEYWORD_ONLY),
)
LEAN_RAY_PARAMS = ("no_monitor", "include_log_monitor")


def lean_head_applies() -> bool:
    """Whether this Ray's ``Node.start_api_server`` takes exactly Ray 2.60's parameters and its
    ``RayParams`` the two that ``lean_head`` sets."""
    from ray._private import node, parameter

    try:
        api = inspect.signature(node.Node.start_api_server).parameters.values()
        params = inspect.signature(parameter.RayParams.__init__).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return tuple((p.name, p.kind) for p in api) == API_SERVER_PARAMETERS and all(
        name in params for name in LEAN_RAY_PARAMS
    )


@contextmanager
def without_failure_signal_handler() -> Iterator[None]:
    """Within the block, a driver that this process connects installs none of Ray's core
    failure signal handlers (``ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read when
    the core worker starts). Their SIGTERM handler prints a stack dump, passes the signal on
    and arms a 3 s alarm that aborts the process (exit 134): a SIGTERM while Ray or its actors
    start would kill a command still ending its run (no KILLED status, no checkpoint), and off
    the main thread (``overlapped_start``) the command's handlers come back only between
    rounds. A crash of the driver's core then prints no stack of Ray's (Python's
    ``faulthandler``, which ``ray.init`` enables, still prints the Python stacks). Switched in
    this process only and restored on leaving, as ``loopback_node`` switches its constant."""
    from ray._private import ray_constants

    saved = ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    try:
        yield
    finally:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = saved


@contextmanager
def loopback_node() -> Iterator[None]:
    """Within the block, a Ray node started by this process takes the loopback address
    (``127.0.0.1``, or ``::1`` where Ray finds only IPv6) as its node IP, and so every server it
    starts listens on loopback only.

    Ray 2.60 has no bind-address option: each of its servers picks its interface from the node
    IP, loopback only when that IP is a loopback one, else all interfaces (the gRPC servers of
    the GCS, the raylet, the agents and every worker; the autoscaler's, the dashboard's and the
    agent's metrics endpoints: ``autoscaler/_private/monitor.py``, ``dashboard/head.py``,
    ``dashboard/agent.py``, ``dashboard/modules/reporter/reporter_agent.py``) or the node IP
    itself (the agents' HTTP servers). And the node IP cannot be set to loopback through
    ``ray.init``: ``_node_ip_address="127.0.0.1"`` is replaced by the machine's routable
    address (``services.resolve_ip_for_localhost``), as is the default
    (``services.get_node_ip_address``), unless ``ray_constants.ENABLE_RAY_CLUSTER`` is false,
    as it is by default only on macOS and Windows (single-node Ray there; the variable
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` overrides it). That constant is read from the
    environment when Ray is imported, so it is switched here, in this process only, and
    restored on leaving: the processes Ray starts are told the node IP on their command lines,
    and a later connection to a real cluster resolves addresses as before.
    """
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextmanager
def head_on_this_machine(address: str | None) -> Iterator[None]:
    """Connect to a head on this machine, named by address, as ``ray start --head`` left it:

    - token authentication, which Ray ≥ 2.59 turns on for a head it starts: Ray's driver
      sends the token it finds (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN``) for ``auto`` but
      never for an address, and the GCS then refuses it after ~30 s of retries. For an
      address on this machine (a loopback host, or this machine's own address) this does what
      Ray does for ``auto``, where ``RAY_AUTH_MODE`` is unset (and leaves it set, as Ray does).
      The token goes to no other machine's address, but a loopback port forwarded to another
      machine's head is taken for this machine's;
    - a head listening on loopback only (started with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
      as docs/security.md advises): Ray replaces 127.0.0.1 by the machine's address, where
      nothing answers, and the driver waits forever. Where a loopback address's port does not
      answer on the machine's address, the driver keeps the loopback one (``loopback_node``).
    """
    from cluster.config.runtime import ray_endpoint

    endpoint = None if address is None else ray_endpoint("executor.address", address)
    if endpoint is None:  # auto: Ray's own rule applies
        yield
        return
    from ray._private import services
    from ray._private.authentication import authentication_token_setup

    host, port = endpoint
    machine = services.get_node_ip_address()
    loopback = services.is_localhost(host)
    if loopback or host == machine:
        # Quietly: Ray's own notice of it would reach the terminal before ray.init's settings.
        notices = logging.getLogger(authentication_token_setup.__name__)
        level = notices.level
        notices.setLevel(logging.ERROR)
        try:
            authentication_token_setup.maybe_enable_token_auth_if_token_available(
                warn_if_disabled=False
            )
        finally:
            notices.setLevel(level)
    if loopback and not _answers(machine, port):
        with loopback_node():
            yield
        return
    yield


def _not_joined(address: str | None, effective: str, error: ConnectionError) -> Exception:
    """What a user can fix when Ray's GCS answered the preflight's connect but not the driver:
    most often token authentication (a ``ConfigError`` on the address, exit 2)."""
    from cluster.config import ConfigError

    return ConfigError(
        "executor.address" if address == effective else "RAY_ADDRESS",
        effective,
        f"Ray refused or lost this driver ({str(error).splitlines()[0]}); a head of Ray ≥ 2.59 "
        "requires its token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or the token file "
        "~/.ray/auth_token; `ray get-auth-token` on the head prints it), and check that this "
        "machine reaches the head's address",
    )


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


# The options of `ray start --head` that take a port, besides the dashboard's and the workers'
# range: a head started beside other Rays on one machine gives each a free one.
HEAD_PORT_OPTIONS = (
    "port",  # the GCS: the address drivers connect to
    "ray-client-server-port",
    "node-manager-port",
    "object-manager-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)


def prepend_pythonpath(path: Path) -> None:
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(path) not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(path), *entries])


def _logs_dir() -> str | None:
    from ray._private import worker  # no public accessor for the session's log directory

    node = getattr(worker, "_global_node", None)
    return node.get_logs_dir_path() if node is not None else None


def resource_shortfall(
    num_actors: int, cpus_per_actor: float, gpus_per_actor: float, total: dict[str, float]
) -> tuple[str, float, str, float] | None:
    """The first of CPU/GPU the actor pool needs more of than ``total`` holds, as
    ``(executor field, need, resource, have)``; None when the pool fits."""
    needs = {"CPU": ("cpus_per_actor", cpus_per_actor), "GPU": ("gpus_per_actor", gpus_per_actor)}
    for resource, (field, per_actor) in needs.items():
        need, have = num_actors * per_actor, total.get(resource, 0.0)
        if need > have + 1e-9:
            return field, need, resource, have
    return None


def check_resources(num_actors: int, cpus_per_actor: float, gpus_per_actor: float) -> None:
    """Fail before creating actors that could never be scheduled on this (static) cluster."""
    import ray

    short = resource_shortfall(num_actors, cpus_per_actor, gpus_per_actor, ray.cluster_resources())
    if short is not None:
        field, need, resource, have = short
        raise ResourceError(
            f"executor: {num_actors} actors × {field} need {need:g} {resource} but the Ray "
            f"cluster has {have:g}; lower executor.num_actors or executor.{field}"
        )


def disconnect() -> None:
    """Leave Ray if this process joined or started it (an embedded Ray stops: its raylet and
    agents would otherwise linger after the command)."""
    import sys

    if "ray" in sys.modules:
        import ray

        from cluster.runtime.code_shipping import forget

        try:
            ray.shutdown()
        finally:
            forget()
