"""What the embedded Ray of ``python -m cluster run`` exposes to the network: nothing.

Every process it starts (GCS, raylet, autoscaler monitor, dashboard head, dashboard and
runtime-env agents, workers, the run's actors) and the driver itself listen on loopback only
(docs/security.md). Ray 2.60 puts all of them on loopback once the node IP is a loopback
address (``cluster.runtime.ray_runtime.loopback_node``). Before that, the gRPC servers of the GCS,
the raylet, the agents, the workers and the driver listened on ``::`` (all interfaces, IPv4
included), the metrics endpoints on ``0.0.0.0`` and the agents' HTTP servers on the machine's
address.
"""

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
import uuid

import pytest

ray = pytest.importorskip("ray")
import psutil  # noqa: E402  (vendored by Ray in ray/thirdparty_files: importable once Ray is)

MARKER = "DPFL_EXPOSURE_TEST"


def _is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host.split("%", 1)[0])
    # gRPC binds an IPv4 loopback address on a dual-stack socket: ::ffff:127.0.0.1.
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _processes(marker: str, also: set[int]) -> dict[int, psutil.Process]:
    """This process, the processes whose environment holds ``MARKER=marker`` (inherited from
    this one: found even where a process was re-parented), ``also``, and all their descendants.

    The environment alone misses some: Ray's agents rename themselves (``ray::DashboardAgent``)
    and then show an empty ``/proc/<pid>/environ``; they are the raylet's children.
    """
    me = psutil.Process()
    roots = {me.pid: me}
    for p in psutil.process_iter():
        try:
            if p.pid in also or p.environ().get(MARKER) == marker:
                roots[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass  # ended since listed, or another user's: not started from here
    found = dict(roots)
    for p in roots.values():
        with contextlib.suppress(psutil.NoSuchProcess):  # ended since listed
            found.update((child.pid, child) for child in p.children(recursive=True))
    return found


def _listeners(processes: dict[int, psutil.Process]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, host, port) of every TCP socket in LISTEN and every UDP socket bound
    without a peer (one that receives from anyone) of ``processes``."""
    found = []
    for pid, p in processes.items():
        try:
            name = p.name()
            connections = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # ended since it was listed (a worker Ray recycled)
        for c in connections:
            tcp_listen = c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN
            udp_open = c.type == socket.SOCK_DGRAM and not c.raddr
            if tcp_listen or udp_open:
                found.append((pid, name, c.laddr.ip, c.laddr.port))
    return found


def _off_loopback(listeners):
    return [entry for entry in listeners if not _is_loopback(entry[2])]


def test_loopback_is_told_from_every_other_address():
    assert all(map(_is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(_is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:10.0.0.1", "fe80::1"]))


@pytest.mark.timeout(30)
def test_a_listener_on_all_interfaces_in_a_marked_process_is_found():
    """The scan the next test relies on sees a process it did not start directly (marked only
    by its environment) and reports its socket on all interfaces."""
    marker = uuid.uuid4().hex
    listen = (
        "import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen();"
        "print(s.getsockname()[1], flush=True); sys.stdin.read()"
    )
    env = {**os.environ, MARKER: marker}
    # start_new_session: not in this process's group, as Ray's workers are not.
    with subprocess.Popen(
        [sys.executable, "-c", listen],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as child:
        try:
            port = int(child.stdout.readline())
            found = _off_loopback(_listeners(_processes(marker, set())))
            assert [(pid, host, p) for pid, _, host, p in found] == [(child.pid, "0.0.0.0", port)]
        finally:
            child.stdin.close()
            child.wait(timeout=10)


@pytest.mark.timeout(180)  # 77 s on 2 cores shared with a load of 13; far less alone
def test_the_embedded_ray_and_its_actors_listen_on_loopback_only(store_root, tmp_path, monkeypatch):
    """Started as the CLI starts it (``connect(None)``, no RAY_ADDRESS), during a run's first
    round: the driver, every process Ray started and the run's actors listen on loopback only.
    A new listener on another address fails this test (there is no allowlist: Ray 2.60 lets
    every one be closed)."""
    from ray._private import ray_constants

    from cluster.runtime.experiment import run_experiment
    from cluster.runtime.ray_runtime import connect, disconnect
    from tests.helpers import small_config

    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, marker)  # inherited by the GCS, the raylet, the workers
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    seen = {}

    def snapshot(record):
        if seen:
            return
        from ray._private import worker

        actors = [
            info
            for info in ray._private.state.state.actor_table(None).values()
            if info["State"] == "ALIVE"
        ]
        node = worker._global_node
        daemons = {info.process.pid for infos in node.all_processes.values() for info in infos}
        processes = _processes(marker, daemons | {info["Pid"] for info in actors})
        seen.update(
            actors=actors,
            daemons=daemons,
            processes=processes,
            listeners=_listeners(processes),
            node_ip=node.node_ip_address,
        )

    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    try:
        assert connect(None).embedded
        # Switched for the start only: a later connection to a cluster resolves as before.
        assert ray_constants.ENABLE_RAY_CLUSTER is multi_node
        config = small_config(
            store_root,
            "executor.kind=ray",
            "executor.num_actors=1",
            "rounds=1",
            f"checkpoint.dir={tmp_path}",
        )
        run_experiment(config, on_round=snapshot)
        assert list(tmp_path.iterdir())  # the run went through to its checkpoint
    finally:
        disconnect()

    # The scan saw what Ray started: its daemons, the run's actor, their servers.
    assert seen["daemons"] <= seen["processes"].keys()
    assert len(seen["actors"]) == 1
    listening = {(pid, port) for pid, _, _, port in seen["listeners"]}
    for actor in seen["actors"]:
        assert (actor["Pid"], actor["Address"]["Port"]) in listening, actor
    names = {name for _, name, _, _ in seen["listeners"]}
    assert {"gcs_server", "raylet"} <= names, names
    exposed = _off_loopback(seen["listeners"])
    assert not exposed, "off loopback: " + ", ".join(
        f"{n} (pid {p}) on {h}:{o}" for p, n, h, o in exposed
    )
    # And the addresses Ray hands out for them are loopback ones too.
    assert _is_loopback(seen["node_ip"]), seen["node_ip"]
    assert all(_is_loopback(actor["Address"]["IPAddress"]) for actor in seen["actors"])
