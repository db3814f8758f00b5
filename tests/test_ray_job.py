"""End to end: the quickstart submitted with `ray job submit` to a throwaway local Ray head.

What the harness pins down (each point was a real failure mode on Ray 2.60):

* Ports: the head gets its own, picked free at test time (GCS, dashboard/job server, client
  server, node/object manager, agents, metrics, worker range), so it cannot clash with
  another Ray on the machine, e.g. a developer's cluster on 6379/8265/10001.
* ``--temp-dir``: a plain ``ray.init()`` (the embedded Ray of other tests, perhaps running
  at the same time) attaches to the last ``ray start`` it finds in
  ``/tmp/ray/ray_current_cluster``. With a temp dir of its own this head writes that file
  elsewhere, so nobody else discovers it.
* Token auth: from 2.59 a local ``ray start`` turns auth on by itself (here: whenever
  ``~/.ray/auth_token`` exists), and then ``ray job submit`` fails with ``AuthenticationError:
  ... Missing authentication token`` unless the client also has ``RAY_AUTH_MODE=token``
  (having the token file is not enough). Every ray command here gets ``RAY_AUTH_MODE=token``
  and a token file private to the test (``RAY_AUTH_TOKEN_PATH``): independent of ``~/.ray``,
  and the auth path users get by default is the one exercised.
* ``ray start`` under CPU pressure: see ``_Head.ready`` (retried).
* Shards and the MLflow DB live outside the repository (``DPFL_STORE_ROOT``,
  ``MLFLOW_TRACKING_URI`` in the job's env_vars): the ``working_dir`` upload honours
  ``.gitignore`` and the job runs in a temporary copy, so relative paths would be lost.
* Stopping: only this head, never other Rays on the machine (see ``_stop_head``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from cluster.runtime.ray_runtime import HEAD_PORT_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
# The venv's own CLI first (the test runs as `uv run pytest`), then whatever is on PATH.
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")

pytestmark = pytest.mark.skipif(
    RAY is None or find_spec("aiohttp") is None,
    reason="needs the `ray` CLI with the job server (pip install 'ray[default]')",
)

ROUNDS = 3
EXPERIMENT = "quickstart"
START_TIMEOUT_S = 120
START_ATTEMPTS = 3
JOB_TIMEOUT_S = 300
WORKER_PORTS = 40  # one per worker process: job supervisor, driver, actors, idle workers
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))  # all interfaces: Ray's servers bind the node IP, not loopback
        except OSError:
            return False
    return True


def _free_port_block(size: int) -> int:
    """First port of `size` consecutive free ports, below Linux's ephemeral range (32768+)
    so that no outgoing connection can take one between this check and `ray start`."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000 - size)
        if all(_port_free(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"no block of {size} free TCP ports in 20000-32000")


def _head_command(temp_dir: Path) -> tuple[list[str], int]:
    """`ray start --head` on ports of its own; returns (command, dashboard port)."""
    base = _free_port_block(10 + WORKER_PORTS)
    # the job server's too: `ray job submit --address http://127.0.0.1:<dashboard-port>`
    names = [*HEAD_PORT_OPTIONS, "dashboard-port"]
    ports = {name: base + i for i, name in enumerate(names)}
    command = [
        RAY, "start", "--head",
        # --node-ip-address=127.0.0.1 would change nothing: Ray rewrites loopback to the
        # machine's routable IP. Only the dashboard (the job API) can be kept on loopback.
        "--dashboard-host=127.0.0.1",
        *(f"--{name}={port}" for name, port in ports.items()),
        f"--min-worker-port={base + 10}",
        f"--max-worker-port={base + 10 + WORKER_PORTS - 1}",
        "--num-cpus=2",
        "--num-gpus=0",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]  # fmt: skip
    return command, ports["dashboard-port"]


def _ray_env(token_path: Path) -> dict[str, str]:
    """Environment for every ray command: this test's auth, no stray cluster address."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN"}
    }
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # The job's entrypoint says `python`: make that the venv's interpreter even when pytest
    # was started without `uv run` (the head passes its PATH down to the job).
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _session_members(sid: int) -> list[int] | None:
    """Live processes of session `sid` (None where there is no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, _pgrp, session = stat[stat.rindex(")") + 2 :].split()[:4]
        if int(session) == sid and state != "Z":
            members.append(int(entry.name))
    return members


def _signal_session(sid: int, sig: int) -> bool:
    """Send `sig` to session `sid`; False when nothing of it is left."""
    members = _session_members(sid)
    if members is None:  # no /proc (macOS): the process group is the best we have
        try:
            os.killpg(sid, sig)
        except ProcessLookupError:
            return False
        return True
    for pid in members:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return bool(members)


def _stop_head(sid: int) -> None:
    """Stop this head and everything it started, nothing else.

    Not `ray stop`: it finds Ray processes by name and kills every one on the machine,
    including other sessions' clusters and the embedded Ray of tests running alongside.
    Instead `ray start` ran as the leader of a new session (start_new_session=True). Its
    daemons (GCS, raylet, dashboard, agents) re-parent to init but stay in that session, and
    so do the workers the raylet forks (each in a process group of its own, hence not
    killpg), so the session id names exactly this cluster. The job driver runs in a session
    of its own, but the job has ended by now (and the supervisor's watcher kills it when
    the supervisor dies). SIGTERM first, SIGKILL what is left after a short grace.
    """
    for sig, grace_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        if not _signal_session(sid, sig):
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not _signal_session(sid, 0):
                return
            time.sleep(0.2)


def _run(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )


def _raylet_fatal(temp_dir: Path) -> str:
    """The raylet's fatal log lines, if any: why a `ray start` attempt failed."""
    lines = []
    for log in temp_dir.glob("session_*/logs/raylet.out"):
        lines += [
            line[:600]
            for line in log.read_text(errors="replace").splitlines()
            if "Check failed" in line or " C " in line[:40]
        ]
    return "raylet: " + "\n".join(lines[:3]) if lines else ""


class _Head:
    """`ray start --head` launched in the background; `ready()` waits for it (and retries)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        token_path = tmp / "auth_token"
        token_path.write_text(secrets.token_hex(32))
        token_path.chmod(0o600)
        self.env = _ray_env(token_path)
        self.attempt = 0
        self.sessions: list[int] = []
        self._launch()

    def _launch(self) -> None:
        self.attempt += 1
        command, dashboard_port = _head_command(self.tmp / f"ray{self.attempt}")
        self.address = f"http://127.0.0.1:{dashboard_port}"
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # see _stop_head
        )
        self.sessions.append(self.process.pid)

    def ready(self) -> str:
        """Wait for the head; its job server's address.

        On a loaded machine `ray start` can fail for want of CPU: the raylet gives the
        dashboard agent a fixed 15 s to write its port file (not configurable in 2.60:
        RAY_agent_register_timeout_ms is not applied to that wait) and aborts with "Timed
        out waiting for file .../dashboard_agent_listen_port_<node id>". Then stop what is
        left of that attempt and start again, on fresh ports.
        """
        failures = []
        while self.process.returncode != 0:  # once started, ready for every later caller
            try:
                output, _ = self.process.communicate(timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                output, _ = self.process.communicate()
                output += f"\n(timed out after {START_TIMEOUT_S} s)"
            if self.process.returncode == 0:
                break
            failures.append(
                f"attempt {self.attempt}: `ray start --head` exited "
                f"{self.process.returncode}:\n{output}"
            )
            _stop_head(self.sessions.pop())  # dropped: its id may be reused once it is gone
            failures.append(_raylet_fatal(self.tmp / f"ray{self.attempt}"))
            if self.attempt == START_ATTEMPTS:
                pytest.fail("\n\n".join(failures))
            self._launch()
        return self.address

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for sid in self.sessions:
            _stop_head(sid)


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of this module's own, starting; always stopped afterwards (its tests share
    it: a head takes 20-40 s to start)."""
    # Short path on purpose: Ray's unix sockets live under --temp-dir and a socket path
    # must stay under 108 bytes, which pytest's tmp_path plus Ray's session dir can exceed.
    tmp = Path(tempfile.mkdtemp(prefix="rayjob-"))
    head = None
    try:
        head = _Head(tmp)
        yield head
    finally:
        if head is not None:
            head.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _job_report(address: str, submission_id: str, env: dict[str, str]) -> str:
    parts = []
    for what in ("status", "logs"):
        try:
            done = _run([RAY, "job", what, "--address", address, submission_id], env, 60)
            parts.append(f"--- ray job {what} {submission_id} ---\n{ANSI.sub('', done.stdout)}")
        except subprocess.TimeoutExpired:
            parts.append(f"--- ray job {what} {submission_id}: timed out ---")
    return "\n".join(parts)


def test_quickstart_as_ray_job(ray_head):
    tmp, env = ray_head.tmp, ray_head.env
    tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    # While the head starts (20-40 s), create the MLflow DB here: a fresh DB spends 10+ s on
    # schema migrations, which would otherwise sit on the job's critical path. The job
    # still creates the experiment and the run itself.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    client.search_experiments()
    address = ray_head.ready()

    runtime_env = {
        "env_vars": {"MLFLOW_TRACKING_URI": tracking_uri, "DPFL_STORE_ROOT": str(tmp / "shards")}
    }
    submission_id = f"quickstart-{secrets.token_hex(4)}"
    submit = [
        RAY, "job", "submit",
        "--address", address,
        "--submission-id", submission_id,
        "--working-dir", ".",
        "--runtime-env-json", json.dumps(runtime_env),
        "--",
        "python", "-m", "cluster", "run", "configs/quickstart.yaml",
        "--set", f"rounds={ROUNDS}", "--set", "eval_every=1",
    ]  # fmt: skip
    # Blocking submit: it streams the job's logs and returns when the job ends.
    try:
        done = _run(submit, env, JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as timeout:
        report = _job_report(address, submission_id, env)
        _run([RAY, "job", "stop", "--address", address, submission_id], env, 60)
        partial = timeout.output or b""  # bytes even with text=True (CPython's TimeoutExpired)
        if isinstance(partial, bytes):
            partial = partial.decode(errors="replace")
        pytest.fail(f"job still running after {JOB_TIMEOUT_S} s\n{partial}\n{report}")
    output = ANSI.sub("", done.stdout)
    # It exits 0 for STOPPED and other non-FAILED ends too, so look for the final status.
    if done.returncode != 0 or f"Job '{submission_id}' succeeded" not in output:
        report = _job_report(address, submission_id, env)
        if "SUCCEEDED" not in report.split("--- ray job logs")[0]:
            pytest.fail(f"`ray job submit` exited {done.returncode}:\n{output}\n{report}")

    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, f"no experiment {EXPERIMENT!r} in {tracking_uri}\n{output}"
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"

    histories = {
        name: sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)
        for name in ("epsilon", "test_accuracy")
    }
    for name, history in histories.items():
        assert [m.step for m in history] == list(range(1, ROUNDS + 1)), name
    epsilons = [m.value for m in histories["epsilon"]]
    assert all(0 < a < b for a, b in pairwise(epsilons)), epsilons
    assert all(0.0 <= m.value <= 1.0 for m in histories["test_accuracy"])

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "curves.png", "model.pt"} <= artifacts, artifacts
    # Submitted with the checkout as its working_dir: the workers get the code from it.
    assert "the code the job's runtime environment" in output, output
    # The job's working directory is deleted with it: the checkpoint went under the store root.
    checkpoint = tmp / "shards" / "checkpoints" / f"{run.info.run_id}.pt"
    assert checkpoint.is_file() and f"checkpoint: {checkpoint}" in output
    assert run.data.tags["checkpoint"] == str(checkpoint)


def _job_api(address: str, env: dict[str, str], path: str, method: str = "GET") -> dict:
    """One call to the job server's REST API (what `ray job ...` calls, without its seconds
    of start-up), authenticated with the head's token."""
    import urllib.request

    headers = {}
    if "RAY_AUTH_TOKEN_PATH" in env:
        token = Path(env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{address}/api/jobs/{path}", method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"{}")


def _wait_for_job(address: str, env: dict[str, str], submission_id: str, until) -> dict:
    """Poll the job until ``until(info, logs)`` holds; its info and logs then."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        info = _job_api(address, env, submission_id)
        logs = ANSI.sub("", _job_api(address, env, f"{submission_id}/logs").get("logs", ""))
        if until(info, logs):
            return {**info, "logs": logs}
        if info["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
            pytest.fail(f"job {submission_id} ended {info['status']} early:\n{logs}")
        time.sleep(0.2)
    pytest.fail(f"job {submission_id}: condition not reached in {JOB_TIMEOUT_S} s\n{logs}")


# ≈ 66 s on 2 cores (two jobs and a 25-round reference run) on top of the head: slow. In CI,
# test_quickstart_as_ray_job submits a real job to this head; the stop and the resume are
# covered by tests/test_interrupts.py::test_a_killed_driver_resumes_bit_for_bit_on_ray (a
# driver on Ray killed mid-run, `resume` on Ray bit-identical, same MLflow run) and
# ::test_sigint_checkpoints_marks_killed_and_resumes_bit_for_bit (a signal: checkpoint, KILLED),
# with SIGTERM in each phase in tests/test_interrupt_phases.py.
@pytest.mark.slow
def test_ray_job_stop_keeps_the_last_round_and_a_new_job_resumes_bit_for_bit(ray_head):
    """`ray job stop` SIGTERMs the driver (and its children) and SIGKILLs them 3 s later: the
    run ends KILLED with the checkpoint of its last completed round, and `resume` submitted as
    a new job ends bit-identical, ε included, to the same run uninterrupted."""
    tmp = ray_head.tmp / "stop"
    tmp.mkdir()
    _stop_and_resume(tmp, ray_head.env, ray_head.ready)


@pytest.mark.slow  # ≈ 2 min: a three-node cluster with the job server, two jobs
@pytest.mark.timeout(600)
def test_a_job_stopped_on_three_nodes_resumes_bit_for_bit_as_a_new_job(tmp_path):
    """The driver lost (`ray job stop`) on the multi-node fixture, actors spread over both
    worker nodes: `resume` as a new job ends bit-identical to the same run uninterrupted.

    Without token auth: the fixture's nodes are started by this process, whose Ray read its
    auth mode (disabled) when imported, and a GCS with tokens would refuse it. The job server
    listens on 127.0.0.1 only, for the test's duration."""
    from tests.fixtures_ray_cluster import local_cluster

    env = _ray_env(tmp_path / "unused")
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
        del env[name]
    port = _free_port_block(1)
    with local_cluster(dashboard_port=port):
        logs = _stop_and_resume(tmp_path, env, lambda: f"http://127.0.0.1:{port}", spread=True)
    assert re.search(r"^actors on 2 nodes: ", logs, re.MULTILINE), logs


def _stop_and_resume(tmp: Path, env: dict[str, str], ready, spread: bool = False) -> str:
    """A run submitted as a job to the cluster ``ready()`` returns the job server of, stopped
    after round 3 and resumed as a new job; compared with the same run in process. Returns
    the first job's logs. ``spread``: its actors placed with ``executor.placement=spread``."""
    from mlflow.tracking import MlflowClient

    from cluster.config import load_config
    from cluster.runtime.checkpoint import load_checkpoint
    from cluster.runtime.experiment import run_experiment

    rounds = 25
    tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(tracking_uri)
    client.search_experiments()  # the schema, while the head starts
    # The same run uninterrupted, in process on as many host threads as the job's actors
    # (the two executors agree bit for bit), also while the head starts.
    sets = [f"rounds={rounds}", f"data.store_root={tmp / 'shards'}"]
    reference = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [*sets, "executor.kind=local", "tracking.enabled=false", f"checkpoint.dir={tmp / 'ref'}"],
    )
    straight = run_experiment(reference)
    address = ready()

    runtime_env = {
        "env_vars": {
            "MLFLOW_TRACKING_URI": tracking_uri,
            "DPFL_STORE_ROOT": str(tmp / "shards"),
            # The grace before SIGKILL (3 s by default), raised as docs/running.md says: on a loaded
            # machine (load 8) the dropped round, checkpoint and MLflow run's end took 3.6 s.
            "RAY_JOB_STOP_WAIT_TIME_S": "20",
        }
    }

    def submit(submission_id: str, *command: str) -> None:
        done = _run(
            [
                RAY, "job", "submit", "--no-wait",
                "--address", address,
                "--submission-id", submission_id,
                "--working-dir", ".",
                "--runtime-env-json", json.dumps(runtime_env),
                "--", "python", "-m", "cluster", *command,
            ],
            env,
            120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout

    first = f"stopped-{secrets.token_hex(4)}"
    placement = ["--set", "executor.placement=spread"] if spread else []
    submit(first, "run", "configs/quickstart.yaml", "--set", f"rounds={rounds}", *placement)
    _wait_for_job(address, env, first, lambda info, logs: re.search(r"round\s+3/", logs))
    _job_api(address, env, f"{first}/stop", method="POST")
    stopped = _wait_for_job(address, env, first, lambda info, logs: info["status"] == "STOPPED")
    logs = stopped["logs"]
    assert "Traceback" not in logs, logs
    (path,) = re.findall(r"^checkpoint: (\S+) ", logs, re.MULTILINE)  # printed at start
    assert re.search(rf"^interrupted by SIGTERM .*: checkpoint {path}; resume", logs, re.M), logs
    saved = load_checkpoint(path)
    done = saved["simulation"]["rounds_done"]
    printed = [int(m) for m in re.findall(r"^round\s+(\d+)/", logs, re.MULTILINE)]
    assert 3 <= done < rounds and done == max(printed), logs  # the last completed round
    run_id = saved["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"
    steps = sorted(m.step for m in client.get_metric_history(run_id, "seconds_per_round"))
    assert steps == list(range(1, done + 1))

    second = f"resumed-{secrets.token_hex(4)}"
    submit(second, "resume", path)
    _wait_for_job(address, env, second, lambda info, logs: info["status"] == "SUCCEEDED")
    final = load_checkpoint(path)
    assert final["simulation"]["rounds_done"] == rounds
    assert torch.equal(final["simulation"]["params"], straight.result.params)
    epsilons = sorted(client.get_metric_history(run_id, "epsilon"), key=lambda m: m.step)
    assert epsilons[-1].value == straight.epsilon
    assert client.get_run(run_id).info.status == "FINISHED"
    return logs
