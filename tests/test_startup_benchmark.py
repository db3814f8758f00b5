"""benchmarks/startup.py reads the start-up's processes off /proc: their roles from Ray's command
lines, which process is below which, when each was spawned and the CPU it used."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.startup import ProcessSample, by_role, descendants, main, role_of

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc (Linux only)")


@pytest.mark.parametrize(
    ("command_line", "role"),
    [
        (".venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x", "gcs"),
        (
            ".venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket",
            "raylet",
        ),
        ("ray::DashboardAgent", "dashboard_agent"),
        ("python -u .../ray/dashboard/agent.py --node-ip-address=127.0.0.1", "dashboard_agent"),
        ("ray::RuntimeEnvAgent", "runtime_env_agent"),
        ("ray::ClientHostActor.info", "host_actor"),
        ("ray::IDLE", "idle_worker"),
        ("python .../ray/_private/workers/default_worker.py --node-ip-address", "idle_worker"),
        ("python -m cluster.tracking.service 7 --preload", "tracking"),
        ("sleep 30", "other"),
    ],
)
def test_a_process_s_role_comes_from_its_command_line(command_line, role):
    assert role_of(command_line) == role


def test_descendants_finds_a_grandchild_with_its_spawn_time_and_cpu():
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    # a shell (child) that starts a busy Python (grandchild) and waits for it
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    burn = f"{sys.executable} -c '{busy}time.sleep(30)'; true"  # not exec'd: a grandchild
    shell = subprocess.Popen(["sh", "-c", burn], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            found = descendants(shell.pid)
            if found and found[0].cpu_s >= 0.3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [s.parent for s in found] == [shell.pid]
        (python,) = found
        assert python.cpu_s >= 0.29  # clock ticks of 10 ms
        assert before - 0.02 <= python.started_s <= time.clock_gettime(time.CLOCK_BOOTTIME)
        assert shell.pid in {s.pid for s in descendants(1)}  # and below the shell's ancestors
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # the shell and its child: no orphan left
        shell.wait()


def test_by_role_sums_cpu_after_the_call_and_takes_the_first_spawn_of_each_role():
    samples = [
        ProcessSample(11, 1, "host_actor", started_s=105.0, cpu_s=3.0),
        ProcessSample(10, 1, "raylet", started_s=101.5, cpu_s=0.25),
        ProcessSample(12, 1, "host_actor", started_s=104.5, cpu_s=2.5),
        ProcessSample(9, 1, "tracking", started_s=98.0, cpu_s=2.0),  # prestarted, 1.5 s before
    ]
    roles = by_role(samples, call_boot_s=100.0, cpu_before={9: 1.5})
    assert roles == {
        "tracking": {"processes": 1, "cpu_seconds": 0.5, "spawned_at": -2.0},
        "raylet": {"processes": 1, "cpu_seconds": 0.25, "spawned_at": 1.5},
        "host_actor": {"processes": 2, "cpu_seconds": 5.5, "spawned_at": 4.5},
    }


@pytest.mark.slow
def test_a_start_up_of_the_embedded_ray_is_timed_with_its_processes(tmp_path, capsys):
    """B at 200 clients, one repeat: the embedded Ray's processes are all found, in the order
    Ray starts them, and the floor is their CPU over the cores."""
    out = tmp_path / "startup.json"
    small = ["data.num_clients=200", "cohort.size=20"]
    assert (
        main(
            ["--workload", "B", "--repeat", "1", *(f"--set={s}" for s in small), "--out", str(out)]
        )
        == 0
    )
    line = json.loads(out.read_text())
    (run,) = line["runs"]
    roles = run["processes"]
    assert {"gcs", "raylet", "dashboard_agent", "runtime_env_agent", "tracking"} <= set(roles)
    assert roles["host_actor"]["processes"] == 2  # benchmarks.workloads' `ray`: 2 actors
    assert roles["gcs"]["spawned_at"] < roles["raylet"]["spawned_at"]
    assert roles["raylet"]["spawned_at"] < roles["host_actor"]["spawned_at"]
    assert 0 < run["ray_connected"] < run["actors_ready"] <= run["first_round_started"]
    cpu = sum(r["cpu_seconds"] for r in roles.values()) + run["driver_cpu_seconds"]
    assert run["cpu_seconds_until_actors_ready"] == pytest.approx(cpu, abs=0.01)
    assert run["floor_seconds"] == pytest.approx(cpu / run["cores"], abs=0.01)


def test_a_process_whose_arguments_are_not_utf8_is_read_too():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", b"\xff\xfe"])
    try:
        (found,) = [s for s in descendants(os.getpid()) if s.pid == sleeper.pid]
        assert found.role == "other"
    finally:
        sleeper.kill()
        sleeper.wait()
