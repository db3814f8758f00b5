"""MLflow artifacts on S3 through a tracking server (issue 31, item 3): a real `mlflow server`
on 127.0.0.1 whose artifact destination is a bucket of a real S3-compatible server (moto's, the
``s3`` fixture of tests/fixtures_s3.py), and a run of the command line tracked to it over HTTP.

The server proxies the artifacts (``mlflow-artifacts:/``), so the run's process holds no S3
credentials: here it has none, and its AWS endpoint points at a closed port, so any direct S3
call from it would fail the run. Everything the run logs (params, per-round metrics, the config
YAML, the plots, the model, the partition report) is queried back through the server and found
as objects in the bucket; no local ``mlruns``/``mlartifacts`` folder is written. With the bucket
gone, the next run stops before its first round (exit 2) naming the artifact the server did not
store. That test is slow (the server's start); the fast ones check the tracking process's
artifact timeout: uploads, which a server answers only once its own upload to S3 is done, get
longer per try than MLflow's other calls. (A server that is not there at all is refused before
any work: tests/test_bad_input.py, case "mlflow down".)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from helpers import http_server, tracking_process_environment
from mlflow.tracking import MlflowClient

from cluster.tracking.settings import ARTIFACT_TIMEOUT_S, ARTIFACT_TIMEOUT_VARIABLE
from cluster.tracking.tracker import MlflowTracker

REPO = Path(__file__).resolve().parents[1]
# `mlflow server` took 25-100 s to answer /health on the 2-core machine under other jobs (load
# 8-11); the run through the CLI 30-60 s more: the test is marked slow.
SERVER_START_S = 240
ARTIFACT_PREFIX = "mlartifacts"
# What cluster/tracking/tracker.py logs for a run of configs/quickstart.yaml (dp_fedavg):
# MlflowTracker's finish() and the partition report logged when the run opens.
RUN_ARTIFACTS = {
    "config.yaml",
    "update_norms.npz",
    "update_norms.png",
    "history.json",
    "summary.json",
    "privacy_report.json",
    "model.pt",
    "curves.png",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, log: Path, within: float) -> float:
    """Seconds until ``url``/health answers 200; fails with the server's log if it exits or
    takes longer than ``within``."""
    start = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() - start > within:
            pytest.fail(
                f"mlflow server did not start within {within} s:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.25)


@pytest.fixture
def mlflow_s3_server(s3, tmp_path):
    """`mlflow server` on 127.0.0.1: runs in SQLite, artifacts proxied to
    ``s3://<bucket>/mlartifacts`` on the moto server; yields (url, its working directory)."""
    home = tmp_path / "server"
    home.mkdir()
    port = _free_port()
    env = {
        **os.environ,
        **s3.env,
        # boto3 (MLflow's S3 artifact repository) reads the endpoint from here.
        "MLFLOW_S3_ENDPOINT_URL": s3.endpoint,
    }
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
        "--artifacts-destination", s3.uri(ARTIFACT_PREFIX),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = home / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            command, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        started = _wait_healthy(url, server, log, SERVER_START_S)
        print(f"mlflow server healthy after {started:.1f} s")
        yield url, home
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _client_env(tracking_uri: str, tmp_path: Path) -> dict[str, str]:
    """The run's environment: the tracking server, and no way to reach S3 on its own (no
    credentials, no AWS config files, the endpoint a closed local port, no metadata probe)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "MLFLOW_", "DPFL_", "RAY_ADDRESS"))
    }
    env.update(
        MLFLOW_TRACKING_URI=tracking_uri,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{_free_port()}",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
    )
    return env


def _local_folders(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("*") if p.name in ("mlruns", "mlartifacts")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_tracked_over_http_puts_every_artifact_in_the_bucket(
    s3, mlflow_s3_server, store_root, tmp_path
):
    url, server_home = mlflow_s3_server
    work = tmp_path / "work"
    work.mkdir()
    rounds = 3
    command = [
        sys.executable, "-m", "cluster", "run", str(REPO / "configs" / "quickstart.yaml"),
        "--set", f"data.store_root={store_root}",
        "--set", f"checkpoint.dir={tmp_path / 'checkpoints'}",
        "--set", "data.num_clients=20",
        "--set", "data.synthetic.samples_per_user=100",
        "--set", "cohort.size=5",
        "--set", f"rounds={rounds}",
        "--set", "eval_every=1",
        "--set", "algorithm.local.local_steps=2",
        "--set", "executor.kind=local",
        "--set", "tracking.experiment=s3-artifacts",
        "--set", "tracking.run_name=over-http",
    ]  # fmt: skip
    done = subprocess.run(
        command,
        cwd=work,
        env=_client_env(url, tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"run page: {url}/#/experiments/" in done.stdout, done.stdout
    assert "View run" not in done.stdout  # MLflow's own links (GenAI view) are suppressed

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("s3-artifacts")
    assert experiment.artifact_location.startswith("mlflow-artifacts:/"), experiment
    (run,) = client.search_runs([experiment.experiment_id])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.info.run_name.startswith("over-http · dp_fedavg · ")  # cluster.runtime.run_names
    assert run.info.run_name.endswith(f" · {run_id[:6]}")
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), run.info.artifact_uri
    assert run.data.params["algorithm.name"] == "dp_fedavg"
    assert run.data.params["rounds"] == str(rounds)
    assert run.data.tags["privacy.dp_valid"] == "true"
    epsilons = client.get_metric_history(run_id, "epsilon")
    assert [m.step for m in epsilons] == list(range(1, rounds + 1))
    assert all(b.value > a.value > 0 for a, b in zip(epsilons, epsilons[1:], strict=False))
    assert [m.step for m in client.get_metric_history(run_id, "test_accuracy")] == [1, 2, 3]

    listed = {a.path for a in client.list_artifacts(run_id)}
    assert RUN_ARTIFACTS | {"partition"} <= listed, listed
    partition = {a.path for a in client.list_artifacts(run_id, "partition")}
    assert partition, "the partition report logged nothing"

    # Every artifact is an object in the bucket, under the destination, keyed by the run.
    keys = s3.keys(f"{ARTIFACT_PREFIX}/")
    stored = {k.split(f"/{run_id}/artifacts/", 1)[1] for k in keys if f"/{run_id}/artifacts/" in k}
    assert RUN_ARTIFACTS | partition <= stored, (sorted(stored), keys)
    # The bytes the server serves are the bucket's.
    config_key = next(k for k in keys if k.endswith(f"/{run_id}/artifacts/config.yaml"))
    in_bucket = s3.client().get_object(Bucket=s3.bucket, Key=config_key)["Body"].read()
    downloaded = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path)))
    assert downloaded.read_bytes() == in_bucket
    assert b"dp_fedavg" in in_bucket and b"rounds: 3" in in_bucket
    model_key = next(k for k in keys if k.endswith(f"/{run_id}/artifacts/model.pt"))
    assert s3.client().head_object(Bucket=s3.bucket, Key=model_key)["ContentLength"] > 0

    # Nothing went to local artifact folders: not beside the run, not beside the server.
    assert not _local_folders(work, server_home), _local_folders(work, server_home)

    # The bucket gone: the server fails the run's first upload (the partition report, as the
    # run opens), MLflow retries its 500s, and the command stops before any round, exit 2,
    # saying which artifact the server did not store and where to look.
    bucket = s3.client()
    for key in keys:
        bucket.delete_object(Bucket=s3.bucket, Key=key)
    bucket.delete_bucket(Bucket=s3.bucket)
    start = time.monotonic()
    failed = subprocess.run(
        [*command, "--set", "tracking.run_name=no-bucket"],
        cwd=work,
        env=_client_env(url, tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = failed.stdout + failed.stderr
    assert failed.returncode == 2, output
    assert time.monotonic() - start < 120
    assert "MLFLOW_TRACKING_URI" in failed.stderr and "Traceback" not in output
    assert "the tracking server did not store the artifact partition/" in failed.stderr
    assert "too many 500 error responses" in failed.stderr and "the bucket" in failed.stderr
    assert "round " not in failed.stdout  # stopped before the first round


# ------------------------------------------------------------------ the artifact timeout


class _SlowArtifactServer(BaseHTTPRequestHandler):
    """A tracking server's two routes for an upload: the run (artifacts under
    ``mlflow-artifacts:/``) and the upload itself, answered ``server.delay`` seconds after the
    body arrived, as a server answers once its own upload to S3 is done. HTTP/1.0: each answer
    ends with its connection."""

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        info = {"run_id": "r1", "run_uuid": "r1", "experiment_id": "1", "status": "RUNNING"}
        info |= {"artifact_uri": "mlflow-artifacts:/1/r1/artifacts", "lifecycle_stage": "active"}
        self._json({"run": {"info": info, "data": {}}})

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.uploads.append(self.path)
        time.sleep(self.server.delay)
        self._json({})

    def _json(self, body: dict) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())


@pytest.fixture
def slow_server():
    with http_server(_SlowArtifactServer, delay=2.0, uploads=[]) as server:
        yield server


@pytest.mark.timeout(60)
def test_uploads_get_the_artifact_timeout_not_the_metadata_one(slow_server, tmp_path, monkeypatch):
    """An upload answered after 2 s, with MLflow's per-try timeout at 1 s and no retries: it
    fails under that timeout, and succeeds (one try) under the artifact timeout, which applies
    to the uploads only."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    tracker = MlflowTracker.__new__(MlflowTracker)
    tracker.client = MlflowClient(f"http://127.0.0.1:{slow_server.server_address[1]}")
    tracker.run_id = "r1"
    report = tmp_path / "report.json"
    report.write_text("{}")

    monkeypatch.delenv(ARTIFACT_TIMEOUT_VARIABLE, raising=False)
    with pytest.raises(Exception, match="timed out"):
        tracker.log_files([report], "partition")
    monkeypatch.setenv(ARTIFACT_TIMEOUT_VARIABLE, "5")
    slow_server.uploads.clear()
    tracker.log_files([report], "partition")
    assert slow_server.uploads == [
        "/api/2.0/mlflow-artifacts/artifacts/1/r1/artifacts/partition/report.json"
    ]
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "1"  # restored for the other calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("user_timeout", [None, "30"])
def test_the_tracking_process_gets_the_artifact_timeout_unless_the_user_set_one(
    user_timeout, monkeypatch
):
    monkeypatch.delenv(ARTIFACT_TIMEOUT_VARIABLE, raising=False)
    if user_timeout is None:
        monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", user_timeout)
    environ = tracking_process_environment()
    assert environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
    if user_timeout is None:  # metadata calls 4 s a try, uploads longer
        assert environ[ARTIFACT_TIMEOUT_VARIABLE] == ARTIFACT_TIMEOUT_S
        assert int(environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]) < int(ARTIFACT_TIMEOUT_S)
    else:  # the user's timeout is every call's
        assert ARTIFACT_TIMEOUT_VARIABLE not in environ
        assert environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == user_timeout
