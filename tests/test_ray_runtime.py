"""The embedded Ray that ``python -m cluster run`` starts when no cluster is named."""

from pathlib import Path

import pytest


def test_the_embedded_ray_retries_its_object_store_connection_every_100_ms():
    """Its raylet connects to its own object store right after starting it; a first attempt
    that finds the store not yet listening waited Ray's default 1 s (``ray.init`` 2.4 or 3.4 s
    on 2 cores). The embedded instance is started with 100 ms retries, as many attempts more:
    what the GCS hands every process of the cluster."""
    ray = pytest.importorskip("ray")
    from cluster.runtime.ray_runtime import EMBEDDED_SYSTEM_CONFIG, connect

    if ray.is_initialized():
        ray.shutdown()
    try:
        assert connect(None).embedded
        config = ray._private.state.state.get_system_config()
        assert {key: config.get(key) for key in EMBEDDED_SYSTEM_CONFIG} == EMBEDDED_SYSTEM_CONFIG
        timeout = EMBEDDED_SYSTEM_CONFIG["raylet_client_connect_timeout_milliseconds"]
        attempts = EMBEDDED_SYSTEM_CONFIG["raylet_client_num_connect_attempts"]
        assert timeout * attempts == 1000 * 10  # Ray's default patience: 10 attempts × 1 s
    finally:
        ray.shutdown()


@pytest.mark.timeout(300)
def test_the_embedded_ray_starts_without_the_monitors_and_the_dashboard_head():
    """``lean_head``: the GCS, the raylet (and its agents) run, the autoscaler monitor, the log
    monitor and the dashboard head do not, and a task still runs on a worker."""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    from cluster.runtime.ray_runtime import connect

    if ray.is_initialized():
        ray.shutdown()
    try:
        assert connect(None).embedded
        started = set(ray._private.worker._global_node.all_processes)
        assert {ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET} <= started
        left_out = {
            ray_constants.PROCESS_TYPE_MONITOR,
            ray_constants.PROCESS_TYPE_LOG_MONITOR,
            ray_constants.PROCESS_TYPE_DASHBOARD,
        }
        assert not started & left_out
        assert ray.get(ray.remote(lambda: 6 * 7).remote()) == 42
    finally:
        ray.shutdown()


@pytest.mark.parametrize("verbose", [False, True])
def test_lean_head_sets_the_node_parameters_for_its_block_only(verbose):
    """Inside the block a head leaves out the autoscaler monitor, keeps the log monitor only
    for a verbose session and starts no dashboard head; Ray's own classes are back after it."""
    pytest.importorskip("ray")
    from ray._private import node, parameter

    from cluster.runtime.ray_runtime import lean_head

    params, api_server = parameter.RayParams, node.Node.start_api_server
    with lean_head(keep_log_monitor=verbose):
        inside = parameter.RayParams()
        assert (inside.no_monitor, inside.include_log_monitor) == (True, verbose)
        assert node.Node.start_api_server is not api_server
    assert (parameter.RayParams, node.Node.start_api_server) == (params, api_server)
    assert parameter.RayParams().no_monitor is False


def test_lean_head_leaves_ray_as_it_is_where_its_private_api_differs(monkeypatch):
    """A Ray whose ``Node.start_api_server`` takes other parameters (or whose ``RayParams``
    lacks the fields set) than the 2.60 that ``lean_head`` was written against starts as it
    is: nothing is switched. No Ray is started."""
    pytest.importorskip("ray")
    from ray._private import node, parameter

    from cluster.runtime.ray_runtime import lean_head, lean_head_applies

    assert lean_head_applies()  # the Ray this project locks

    def start_api_server(self, *, include_dashboard, raise_on_failure, port):
        raise AssertionError("not called here")

    monkeypatch.setattr(node.Node, "start_api_server", start_api_server)
    assert not lean_head_applies()
    params = parameter.RayParams
    with lean_head(keep_log_monitor=False):
        assert node.Node.start_api_server is start_api_server
        assert parameter.RayParams is params
        assert parameter.RayParams().no_monitor is False
    assert (node.Node.start_api_server, parameter.RayParams) == (start_api_server, params)
    monkeypatch.undo()

    class OtherParams(parameter.RayParams):
        def __init__(self, node_ip_address=None):
            super().__init__(node_ip_address=node_ip_address)

    monkeypatch.setattr(parameter, "RayParams", OtherParams)
    assert not lean_head_applies()


WORKING_DIR = '{"runtime_env": {"working_dir": "gcs://_ray_pkg_0.zip"}}'  # ray job submit's
HEAD, CLIENT = "ray-head:6379", "ray://ray-head:10001"
# Where a job's entrypoint finds the project it was submitted with (Ray's layout, under Ray's
# temporary directory).
RUNTIME_RESOURCES = Path("ray-temp", "session_1", "runtime_resources")
UNPACKED_PROJECT = RUNTIME_RESOURCES / "working_dir_files" / "_ray_pkg_0"
# case → (executor.address, $RAY_ADDRESS, the job config Ray hands a job's entrypoint):
# (what ray.init is given, how it joins: ``ray_connection``)
CONNECTIONS = {
    "address": ((HEAD, None, None), (HEAD, "cluster")),
    "RAY_ADDRESS": ((None, HEAD, None), (None, "cluster")),
    "auto": (("auto", None, None), ("auto", "cluster")),
    "auto, RAY_ADDRESS": (("auto", HEAD, None), ("auto", "cluster")),
    "Ray job": ((None, HEAD, WORKING_DIR), (None, "job")),
    "Ray job, address": ((HEAD, "other:1", WORKING_DIR), (HEAD, "job")),
    "Ray job, no working_dir": ((None, HEAD, '{"runtime_env": {}}'), (None, "cluster")),
    "Ray job, the project not from it": ((None, HEAD, WORKING_DIR), (None, "cluster")),
    "Ray job, no RAY_ADDRESS": ((None, None, WORKING_DIR), ("local", "embedded")),
    "embedded": ((None, None, None), ("local", "embedded")),
    "local": (("local", None, None), ("local", "embedded")),
    "RAY_ADDRESS local": ((None, "local", None), ("local", "embedded")),
    "Ray Client": ((CLIENT, None, None), (CLIENT, "client")),
    "auto, Ray Client": (("auto", CLIENT, None), ("auto", "client")),
    "init fails": ((HEAD, None, None), (HEAD, "cluster")),
}


@pytest.mark.parametrize("listening_on", ["127.0.0.1", "0.0.0.0"])
def test_a_head_on_this_machine_is_joined_as_ray_start_left_it(listening_on, monkeypatch):
    """An address of this machine gets Ray's token where one exists (Ray sends it for auto
    only), another machine's never; a loopback address whose port answers on loopback only is
    kept loopback (Ray would rewrite it to the machine's address, where nothing answers)."""
    import socket

    pytest.importorskip("ray")
    from ray._private import ray_constants, services
    from ray._private.authentication import authentication_token_setup

    from cluster.runtime.ray_runtime import head_on_this_machine

    asked = []
    monkeypatch.setattr(
        authentication_token_setup,
        "maybe_enable_token_auth_if_token_available",
        lambda warn_if_disabled: asked.append(warn_if_disabled),
    )
    with socket.socket() as head:
        head.bind((listening_on, 0))
        head.listen()
        port = head.getsockname()[1]
        with head_on_this_machine(f"127.0.0.1:{port}"):
            assert ray_constants.ENABLE_RAY_CLUSTER is (listening_on == "0.0.0.0")
        with head_on_this_machine(f"{services.get_node_ip_address()}:{port}"):
            assert ray_constants.ENABLE_RAY_CLUSTER
        assert asked == [False, False]
        with head_on_this_machine("ray-head:6379"), head_on_this_machine(None):
            assert ray_constants.ENABLE_RAY_CLUSTER
        assert asked == [False, False]  # no token offered to another machine


def test_a_job_carries_the_code_only_where_ray_unpacked_the_project_itself():
    """The project root a job's workers also get: the working_dir's or a py_module's root
    (Ray unpacks each into its own folder under ``runtime_resources``). Not a subfolder of the
    working_dir (the workers' path has its root), nor a checkout or an installed copy."""
    from cluster.config.runtime import unpacked_by_ray

    resources = RUNTIME_RESOURCES
    assert unpacked_by_ray(resources / "working_dir_files" / "_ray_pkg_0")
    assert unpacked_by_ray(resources / "py_modules_files" / "_ray_pkg_1")
    assert not unpacked_by_ray(resources / "working_dir_files" / "_ray_pkg_0" / "project")
    assert not unpacked_by_ray(Path("checkout", "dpfl"))
    assert not unpacked_by_ray(Path("venv", "lib", "python3.11", "site-packages"))


@pytest.mark.parametrize("where", list(CONNECTIONS))
def test_every_connection_joins_as_ray_would_and_ships_the_code_where_workers_lack_it(
    where, monkeypatch
):
    """``connect`` gives ``ray.init`` the address as Ray's own precedence reads it, ships the
    code through the GCS exactly where nothing else gives the workers it (not to Ray Client's
    server, which gets a working_dir, nor inside a job whose runtime environment carries it),
    starts an embedded Ray for no address or ``local``, and agrees with the preflight's
    ``starts_embedded_ray``. Each ``ray.init`` runs with ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``
    set, the constant Ray's core worker reads as it starts (its SIGTERM handler would arm a 3 s
    abort), and the constant is back afterwards, also where ``ray.init`` raised. No Ray is
    started."""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    from cluster.config import ConfigError, runtime
    from cluster.config.runtime import ExecutorConfig, starts_embedded_ray
    from cluster.runtime import code_shipping, ray_runtime

    (address, environment, job), (expected_address, how) = CONNECTIONS[where]
    if where != "Ray job, the project not from it":  # as `ray job submit --working-dir .`
        monkeypatch.setattr(runtime, "PROJECT_ROOT", UNPACKED_PROJECT)
    seen, published, environments = [], [], []

    def init(*args, **kwargs):
        seen.append((ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER, kwargs.get("address")))
        environments.append(kwargs.get("runtime_env"))
        if where == "init fails":
            raise ConnectionError("nothing answers")

    class Context:
        gcs_address = "10.0.0.9:6379"

    monkeypatch.setattr(code_shipping, "publish", lambda: published.append(where))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "get_runtime_context", Context)
    monkeypatch.setattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", False)
    monkeypatch.setenv("PYTHONPATH", "")  # the embedded branch prepends the project
    for name, value in (("RAY_ADDRESS", environment), ("RAY_JOB_CONFIG_JSON_ENV_VAR", job)):
        monkeypatch.delenv(name, raising=False)
        if value is not None:
            monkeypatch.setenv(name, value)
    if where == "init fails":  # exit 2 naming the address and the token it may lack
        with pytest.raises(ConfigError, match=r"executor\.address = 'ray-head:6379'.*RAY_AUTH"):
            ray_runtime.connect(address)
    else:
        session = ray_runtime.connect(address)
        assert session.embedded == (how == "embedded")
        if how in ("cluster", "job"):
            code = "the job's runtime environment" if how == "job" else "shipped by this driver"
            assert session.where == f"Ray cluster at 10.0.0.9:6379, the code {code}"
    assert seen == [(True, expected_address)]
    assert ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER is False
    assert published == ([where] if how == "cluster" and where != "init fails" else [])
    working_dir = [{"working_dir": str(ray_runtime.PROJECT_ROOT)}]
    assert environments == (working_dir if how == "client" else [None])
    executor = ExecutorConfig(kind="ray", address=address)
    assert starts_embedded_ray(executor) == (how == "embedded")
