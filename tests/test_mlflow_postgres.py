"""MLflow on a real PostgreSQL: a throwaway server, an `mlflow server` on it, a run logged through
the project's tracker and queried back with the client (and in the database itself)."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import small_config
from mlflow.tracking import MlflowClient

from cluster.runtime.experiment import run_experiment

psycopg = pytest.importorskip("psycopg", reason="psycopg is needed to reach PostgreSQL")
if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
    pytest.skip(
        "PostgreSQL server binaries (initdb, pg_ctl) are not installed: apt install postgresql",
        allow_module_level=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres() -> list[str]:
    """PostgreSQL refuses to run as root: run its binaries as the `postgres` user then."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: cannot start PostgreSQL unprivileged")
    return ["runuser", "-u", "postgres", "--"]


@pytest.fixture(scope="module")
def postgres_uri():
    home = Path(tempfile.mkdtemp(prefix="dpfl-pg-"))  # in /tmp: reachable by the postgres user
    if os.geteuid() == 0:
        shutil.chown(home, "postgres")
    run_as, port = _as_postgres(), _free_port()
    data, log = home / "data", home / "log"
    subprocess.run(
        [*run_as, "initdb", "-D", str(data), "-A", "trust", "-U", "mlflow", "--no-sync"],
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        [*run_as, "pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "start"],
        check=True,
        capture_output=True,
    )
    try:
        with psycopg.connect(
            host="127.0.0.1", port=port, user="mlflow", dbname="postgres", autocommit=True
        ) as connection:
            connection.execute("CREATE DATABASE mlflowdb")
        yield f"postgresql://mlflow@127.0.0.1:{port}/mlflowdb"
    finally:
        subprocess.run([*run_as, "pg_ctl", "-D", str(data), "-m", "fast", "stop"], check=False)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_server(postgres_uri, tmp_path_factory):
    artifacts, port = tmp_path_factory.mktemp("artifacts"), _free_port()
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        postgres_uri,
        "--artifacts-destination",
        str(artifacts),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = tmp_path_factory.mktemp("server") / "mlflow.log"
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        uri = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
            yield uri
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:  # its workers slow to stop on busy cores
                server.kill()
                server.wait()


def test_a_run_is_stored_in_postgres_and_queried_back(
    store_root, tmp_path, monkeypatch, mlflow_server, postgres_uri
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    config = small_config(
        store_root,
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=1.0",
        "algorithm.noise_multiplier=1.0",
        "rounds=3",
        "tracking.enabled=true",
        "tracking.experiment=postgres",
        f"checkpoint.dir={tmp_path}",
    )
    outcome = run_experiment(config)
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("postgres").experiment_id])
    assert run.info.run_id == outcome.run_id and run.info.status == "FINISHED"
    assert run.data.params["algorithm.name"] == "dp_fedavg"
    epsilons = client.get_metric_history(run.info.run_id, "epsilon")
    assert [m.step for m in epsilons] == [1, 2, 3]
    assert epsilons[-1].value == pytest.approx(outcome.epsilon)
    assert "privacy_report.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    with psycopg.connect(postgres_uri) as connection:
        query = "SELECT count(*) FROM metrics WHERE run_uuid = %s"
        (count,) = connection.execute(query, (run.info.run_id,)).fetchone()
    assert count >= 3 * 5  # every round's metrics are rows in PostgreSQL
