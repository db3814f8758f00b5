"""Tracking that fails never hangs a command (issue 29, item 3).

A store refused by preflight, a run MLflow cannot open or resume, the tracking process killed
or signalled, a tracking server that goes away: each ends within a bound, asserted here, with
one paragraph on stderr (exit 2 where the fix is the user's input, 1 otherwise). Every test
runs under ``pytest.mark.timeout``: a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from helpers import http_server, run_local, small_config, tracking_process_environment
from mlflow.tracking import MlflowClient

import cluster.cli.run
import cluster.tracking.process as tracking_process
from cluster.cli.main import main
from cluster.config import ConfigError
from cluster.runtime.checkpoint import load_checkpoint, save_checkpoint
from cluster.runtime.preflight import check_tracking_uri
from cluster.runtime.records import RoundRecord
from cluster.tracking.process import (
    HTTP_RETRY_BUDGET,
    TrackingError,
    TrackingRun,
)

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN_RUN = "0123456789abcdef0123456789abcdef"
TINY = {
    "task": "synthetic_logreg",
    "rounds": 2,
    "data": {"source": "synthetic", "num_clients": 10, "synthetic": {"samples_per_user": 20}},
    "algorithm": {"name": "fedavg", "local": {"lr": 0.1, "batch_size": 8, "local_steps": 1}},
    "cohort": {"size": 5, "sampling": "fixed"},
    "executor": {"kind": "local", "num_actors": 1},
    "tracking": {"enabled": True, "experiment": "failures"},
}


def _record(step: int) -> RoundRecord:
    return RoundRecord(round=step, cohort_size=5, seconds=0.1, metrics={"m": float(step)})


def _config_file(workdir: Path, **changes) -> Path:
    raw = json.loads(json.dumps(TINY))
    raw.update(changes)
    raw["data"]["store_root"] = str(workdir / "shards")
    raw["checkpoint"] = {"dir": str(workdir / "checkpoints")}
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory) -> str:
    """One MLflow SQLite store for the tests that open real runs (created once: ≈ 2 s)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


# ------------------------------------------------------------------ refused before any work


def _directory(workdir: Path) -> str:
    (workdir / "runs").mkdir()
    return str(workdir / "runs")


def _sqlite_dir(workdir: Path) -> str:
    (workdir / "db").mkdir()
    return f"sqlite:///{workdir / 'db'}"


def _not_sqlite(workdir: Path) -> str:
    (workdir / "mlflow.db").write_bytes(b"this is no database, just text\n")
    return f"sqlite:///{workdir / 'mlflow.db'}"


# name: (workdir -> MLFLOW_TRACKING_URI, other environment, what stderr says)
PREFLIGHT_CASES = {
    "directory": (_directory, {}, ("file store", "MLFLOW_ALLOW_FILE_STORE=true", "sqlite:///")),
    "file URI": (lambda w: (w / "mlruns").as_uri(), {}, ("file store", "migrate-filestore")),
    "databricks": (lambda w: "databricks", {}, ("Databricks is not supported", "workspace")),
    "databricks profile": (
        lambda w: "databricks://team",
        {"DATABRICKS_HOST": "https://example.invalid", "DATABRICKS_TOKEN": "t"},
        ("Databricks is not supported", "tracking.experiment is one file name"),
    ),
    "sqlite /dev/null": (lambda w: "sqlite:////dev/null", {}, ("/dev/null is not a regular file",)),
    "sqlite directory": (_sqlite_dir, {}, ("is a directory",)),
    "not sqlite": (_not_sqlite, {}, ("is not an SQLite database", "'SQLite format 3'")),
    "bad IPv6": (lambda w: "http://[::1", {}, ("not a valid URI", "Invalid IPv6 URL")),
    "bad port": (lambda w: "http://127.0.0.1:abc", {}, ("not a valid URI", "could not be cast")),
}


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    """A clean working directory, without the machine's opt-in to MLflow's file store."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    return tmp_path


def _refused(argv: list[str], workdir: Path, capsys, expect: tuple[str, ...]) -> str:
    """Run the CLI in process; exit 2, a paragraph with ``expect``, nothing written, < 10 s."""
    before = _snapshot(workdir)
    capsys.readouterr()
    start = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err and len(err.strip().splitlines()) <= 12, err
    for text in ("MLFLOW_TRACKING_URI", *expect):
        assert text in err, (text, err)
    assert elapsed < 10, elapsed
    assert _snapshot(workdir) == before
    return err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", PREFLIGHT_CASES, ids=list(PREFLIGHT_CASES))
def test_a_store_tracking_cannot_use_is_refused_before_any_work(case, cli_env, monkeypatch, capsys):
    prepare, environment, expect = PREFLIGHT_CASES[case]
    monkeypatch.setattr(cluster.cli.run, "prestart_tracking", lambda: None)  # no MLflow import
    monkeypatch.setenv("MLFLOW_TRACKING_URI", prepare(cli_env))
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    _refused(["run", str(_config_file(cli_env))], cli_env, capsys, expect)


@contextmanager
def _unwritable(directory: Path):
    """``directory`` made unwritable: by mode for a user, by the immutable flag for root (whom
    modes do not stop); skipped where neither is possible."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("root without the immutable flag: no directory is unwritable to it")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.mark.timeout(60)
def test_an_unwritable_database_directory_is_refused_before_any_work(cli_env, monkeypatch, capsys):
    monkeypatch.setattr(cluster.cli.run, "prestart_tracking", lambda: None)
    locked = cli_env / "locked"
    locked.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{locked / 'mlflow.db'}")
    config = _config_file(cli_env)
    with _unwritable(locked):
        _refused(["run", str(config)], cli_env, capsys, (f"its directory {locked}", "writable"))


@pytest.mark.timeout(30)
def test_a_directory_store_is_taken_where_mlflow_is_told_to_allow_it(tmp_path, monkeypatch):
    """MLflow 3 writes its file store only with ``MLFLOW_ALLOW_FILE_STORE=true`` (then a run
    tracks, resumes and ends there as in SQLite); the directory must still be one."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "new" / "mlruns"))
    check_tracking_uri()
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "afile" / "mlruns").as_uri())
    with pytest.raises(ConfigError, match="is a file, not a directory") as refused:
        check_tracking_uri()
    assert refused.value.field_path == "MLFLOW_TRACKING_URI"


# ------------------------------------------------------------------ refused as the run opens


@pytest.mark.timeout(120)
def test_a_refused_opening_is_kept_and_nothing_waits_for_it_again(tmp_path):
    """A store MLflow cannot open (here an SQLite header over garbage, which preflight's cheap
    check lets through): the first wait raises a ConfigError naming MLFLOW_TRACKING_URI with
    MLflow's reason; every later call that waits raises it again at once, calls that return at
    once stay silent, and abandoning the run returns at once with the process gone."""
    database = tmp_path / "mlflow.db"
    database.write_bytes(b"SQLite format 3\x00" + os.urandom(4096))
    uri = f"sqlite:///{database}"
    run = TrackingRun.open(uri, "x", "r", {}, {})
    with pytest.raises(ConfigError) as refused:
        run.wait_open()
    assert refused.value.field_path == "MLFLOW_TRACKING_URI" and refused.value.value == uri
    assert "MLflow could not open a new run there" in str(refused.value)
    start = time.monotonic()
    run.log_round(_record(1))
    for call in (run.flush, run.is_open, lambda: run.run_id):
        with pytest.raises(ConfigError) as again:
            call()
        assert again.value is refused.value
    run.abandon()
    assert time.monotonic() - start < 2
    assert run._process.returncode == 0


@pytest.mark.timeout(60)
def test_an_opening_that_never_answers_is_given_up(tmp_path, monkeypatch):
    """The run's opening is awaited ``OPEN_WAIT_S`` at most (here 0.5 s, before MLflow has even
    been imported): then the process is stopped and the failure kept."""
    monkeypatch.setattr(tracking_process, "OPEN_WAIT_S", 0.5)
    run = TrackingRun.open(f"sqlite:///{tmp_path / 'mlflow.db'}", "x", "r", {}, {})
    start = time.monotonic()
    with pytest.raises(TrackingError, match="did not answer within 0.5 s"):
        run.wait_open()
    with pytest.raises(TrackingError, match="did not answer"):
        run.flush()
    run.abandon()
    assert time.monotonic() - start < 3
    assert run._process.returncode == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_resuming_a_run_the_store_lacks_fails_before_training(
    tmp_path, monkeypatch, capsys, shared_store
):
    """`resume` of a checkpoint whose MLflow run is not in the store: exit 2 with the run id,
    the URI and the fix, before any round, within 10 s; the checkpoint stays as it was."""
    monkeypatch.chdir(tmp_path)
    uri = shared_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    config = small_config(tmp_path / "shards", "rounds=1", "tracking.enabled=true")
    checkpoint = tmp_path / "checkpoints" / f"{UNKNOWN_RUN}.pt"
    save_checkpoint(checkpoint, run_local(config).state_dict(), config.to_dict(), UNKNOWN_RUN)
    kept = checkpoint.read_bytes()
    capsys.readouterr()
    start = time.monotonic()
    code = main(["resume", str(checkpoint), "--set", "rounds=3"])
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err and not re.search(r"round +\d+/\d+", out)
    for text in (f"MLFLOW_TRACKING_URI = '{uri}'", UNKNOWN_RUN, "is not in this store"):
        assert text in err, (text, err)
    assert "set MLFLOW_TRACKING_URI to the store the run was tracked in" in err
    assert elapsed < 10, elapsed
    assert checkpoint.read_bytes() == kept


# ------------------------------------------------------------------ the tracking process


@pytest.mark.timeout(120)
def test_a_stop_signal_to_the_tracking_process_does_not_lose_the_run(shared_store):
    """``ray job stop`` SIGTERMs the job's whole process tree: the tracking process keeps
    serving the driver, which still logs its rounds, flushes and ends the run FINISHED."""
    run = TrackingRun.open(shared_store, "signalled", "r", {}, {})
    run.log_round(_record(1))
    run.flush()
    run._process.send_signal(signal.SIGTERM)
    run.log_round(_record(2))
    run.flush()
    run._process.send_signal(signal.SIGINT)
    run.log_round(_record(3))
    run.end()
    assert run._process.returncode == 0
    client = MlflowClient(shared_store)
    assert client.get_run(run.run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.run_id, "m")] == [1, 2, 3]


@pytest.mark.timeout(60)
def test_after_a_stop_signal_the_tracking_process_waits_for_the_driver_a_bounded_time():
    """A driver that never closes its end: the signalled process exits on its own after its
    grace (``SIGNAL_GRACE_S``, 600 s; 1 s here), with code 143."""
    ours, theirs = socket.socketpair()
    script = (
        "import sys, cluster.tracking.service as t; t.SIGNAL_GRACE_S = 1.0; t.main(sys.argv[1:])"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    driver = Connection(ours.detach())
    try:
        driver.send(("flush", (), True))  # answered once it serves: its handlers are set
        assert driver.recv() == ("ok", None)
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 143
        assert 0.9 < time.monotonic() - start < 10
        assert "no end from the driver 1 s after a stop signal" in process.stderr.read()
    finally:
        process.kill()
        driver.close()


@pytest.mark.timeout(30)
def test_the_tracking_process_gets_the_http_retry_budget_unless_the_user_set_one(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")
    environ = tracking_process_environment()
    assert environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"
    for key, value in HTTP_RETRY_BUDGET.items():
        if key != "MLFLOW_HTTP_REQUEST_TIMEOUT":
            assert environ[key] == value, key


# ------------------------------------------------------------------ a server that goes away


class _FakeMlflowServer(BaseHTTPRequestHandler):
    """The few REST calls that open a run and log to it, answered as an MLflow server would;
    once ``server.dropping``, every connection is accepted and closed unanswered; once
    ``server.throttling`` is a status (429, 503), every request is answered with it and
    ``Retry-After: 3600``, as a rate-limiting proxy might."""

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()

    def _answer(self) -> None:
        if self.server.dropping:
            self.close_connection = True
            return
        if self.server.throttling is not None:
            self.send_response(self.server.throttling)
            self.send_header("Retry-After", "3600")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        route = urlsplit(self.path).path.rsplit("/mlflow/", 1)[-1]
        status, body = 200, {}
        if route == "experiments/get-by-name":
            status, body = 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "none"}
        elif route == "experiments/create":
            body = {"experiment_id": "1"}
        elif route == "runs/create":
            info = {"run_id": "r1", "run_uuid": "r1", "experiment_id": "1", "status": "RUNNING"}
            body = {"run": {"info": {**info, "lifecycle_stage": "active"}, "data": {}}}
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:  # quiet
        pass


def _fake_mlflow_server(
    throttling: int | None = None,
) -> AbstractContextManager[ThreadingHTTPServer]:
    """A ``_FakeMlflowServer`` on 127.0.0.1 for the block, answering normally until told."""
    return http_server(_FakeMlflowServer, dropping=False, throttling=throttling)


def _fake_uri(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_port}"


def _given_up_within_the_budget(run: TrackingRun, failing_call: Callable[[], Any]) -> Exception:
    """``failing_call`` raises within the retry budget, after MLflow's retries (2 s + 4 s of
    backoff), and ending the run after it tries once, not for another budget; the error."""
    start = time.monotonic()
    with pytest.raises((TrackingError, ConfigError)) as failed:
        failing_call()
    given_up = time.monotonic() - start
    assert 5 < given_up < 30, given_up
    start = time.monotonic()
    run.abandon()
    assert time.monotonic() - start < 5
    assert run._process.returncode == 0
    return failed.value


@pytest.mark.timeout(120)
def test_a_server_that_goes_away_mid_run_is_given_up_within_the_retry_budget():
    """After the run opened, the server accepts connections and closes them unanswered: the
    next flush raises MLflow's error within the project's retry budget (≤ 30 s; ≈ 7 s for a
    server that refuses), and ending the run after it tries once, not for another budget."""
    with _fake_mlflow_server() as server:
        run = TrackingRun.open(_fake_uri(server), "x", "r", {}, {})
        run.log_round(_record(1))
        run.flush()
        assert run.run_id == "r1"
        server.dropping = True
        run.log_round(_record(2))
        failure = _given_up_within_the_budget(run, run.flush)
    assert isinstance(failure, TrackingError) and "Max retries exceeded" in str(failure)
    assert "\n" not in str(failure) and "Traceback" in failure.details


@pytest.mark.timeout(120)
def test_a_server_asking_for_an_hour_before_a_retry_is_given_up_mid_run_within_the_budget():
    """Once the run is open, the server answers every request 503 with ``Retry-After: 3600``:
    the flush (a wait with no limit of its own) raises within the retry budget, not an hour per
    retry, because the tracking process ignores the header (``HTTP_RETRY_BUDGET``)."""
    with _fake_mlflow_server() as server:
        run = TrackingRun.open(_fake_uri(server), "x", "r", {}, {})
        run.flush()
        server.throttling = 503
        run.log_round(_record(1))
        failure = _given_up_within_the_budget(run, run.flush)
    assert isinstance(failure, TrackingError)
    assert "too many 503 error responses" in str(failure)


@pytest.mark.timeout(120)
@pytest.mark.slow  # the mid-run case covers the same setting in CI (9 s each)
def test_a_server_asking_for_an_hour_before_a_retry_refuses_the_opening_within_the_budget():
    """A server that answers every request 429 with ``Retry-After: 3600`` from the start: the
    run's opening is refused within the retry budget, as the input to fix, not after
    ``OPEN_WAIT_S`` as a process that did not answer."""
    with _fake_mlflow_server(throttling=429) as server:
        run = TrackingRun.open(_fake_uri(server), "x", "r", {}, {})
        failure = _given_up_within_the_budget(run, run.wait_open)
    assert isinstance(failure, ConfigError) and failure.field_path == "MLFLOW_TRACKING_URI"
    assert "MLflow could not open a new run there" in str(failure)
    assert "too many 429 error responses" in str(failure)


# ------------------------------------------------------------------ the command


@pytest.mark.timeout(120)
def test_the_command_ends_within_10_s_of_its_tracking_process_being_killed(
    tmp_path, monkeypatch, capsys, shared_store
):
    """`run`, tracked, checkpointing every round: its tracking process SIGKILLed once the run is
    open (as the second round is handed on, which raises nothing); the next wait (the round's
    checkpoint) raises, and the command exits 1 within 10 s of the kill, with one paragraph
    and no traceback. The failure is kept (raised again at once) and the run id stays known."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared_store)
    killed: list[tuple[TrackingRun, float]] = []
    log_round = TrackingRun.log_round

    def log_round_then_kill(run: TrackingRun, record: RoundRecord) -> None:
        log_round(run, record)
        if not killed and record.round >= 2 and run.is_open():
            run._process.kill()
            killed.append((run, time.monotonic()))

    monkeypatch.setattr(TrackingRun, "log_round", log_round_then_kill)
    config = _config_file(tmp_path, rounds=100_000)
    capsys.readouterr()
    code = main(["run", str(config), "--set", "checkpoint.every=1"])
    elapsed = time.monotonic() - killed[0][1]
    run = killed[0][0]
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    assert elapsed < 10, elapsed
    assert "Traceback" not in out + err and len(err.strip().splitlines()) <= 3, err
    assert "tracking error: the MLflow tracking process was killed by SIGKILL" in err
    assert f"the run on {shared_store} stays RUNNING" in err
    start = time.monotonic()
    with pytest.raises(TrackingError, match="killed by SIGKILL"):
        run.flush()
    assert time.monotonic() - start < 0.1
    assert MlflowClient(shared_store).get_run(run.run_id).info.status == "RUNNING"
    # The rounds are kept all the same: the checkpoint of the round whose flush failed.
    saved = load_checkpoint(tmp_path / "checkpoints" / f"{run.run_id}.pt")
    assert saved["run_id"] == run.run_id
    assert f"checkpoint of round {saved['simulation']['rounds_done']} kept" in out
