"""MLflow on a real PostgreSQL: a throwaway server, an `mlflow server` on it, a run logged through
the project's tracker and queried back with the client (and in the database itself).

The database requires a password (scram-sha-256) and is reached as in k8s/: the password in
``PGPASSWORD`` (libpq reads it), none in the URI; a run on it without the right one is refused
before any work, naming the fix."""

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from helpers import small_config
from mlflow.tracking import MlflowClient

import cluster.cli.run
from cluster.cli.main import main
from cluster.runtime.experiment import run_experiment
from cluster.runtime.preflight import check_tracking_uri

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


class Database(NamedTuple):
    uri: str  # as MLflow takes it, with the driver and without the password (as in k8s/)
    password: str

    def connect(self, **options) -> psycopg.Connection:
        """A connection for the test itself (libpq's URI: without the driver)."""
        conninfo = self.uri.replace("postgresql+psycopg://", "postgresql://")
        return psycopg.connect(conninfo, password=self.password, **options)


@pytest.fixture(scope="module")
def database():
    home = Path(tempfile.mkdtemp(prefix="dpfl-pg-"))  # in /tmp: reachable by the postgres user
    password = secrets.token_hex(16)
    password_file = home / "password"
    password_file.write_text(password)
    if os.geteuid() == 0:
        shutil.chown(home, "postgres")
        shutil.chown(password_file, "postgres")
    run_as, port = _as_postgres(), _free_port()
    data, log = home / "data", home / "log"
    subprocess.run(
        [*run_as, "initdb", "-D", str(data), "-U", "mlflow", "--no-sync"]
        + ["-A", "scram-sha-256", f"--pwfile={password_file}"],  # every login: its password
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
        database = Database(f"postgresql+psycopg://mlflow@127.0.0.1:{port}/mlflowdb", password)
        server = Database(database.uri.replace("/mlflowdb", "/postgres"), password)
        with server.connect(autocommit=True) as connection:
            connection.execute("CREATE DATABASE mlflowdb")
        yield database
    finally:
        subprocess.run([*run_as, "pg_ctl", "-D", str(data), "-m", "fast", "stop"], check=False)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_server(database, tmp_path_factory):
    artifacts, port = tmp_path_factory.mktemp("artifacts"), _free_port()
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        database.uri,
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
        environment = {**os.environ, "PGPASSWORD": database.password}  # as k8s/mlflow.yaml
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)
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
    store_root, tmp_path, monkeypatch, mlflow_server, database
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
    with database.connect() as connection:
        query = "SELECT count(*) FROM metrics WHERE run_uuid = %s"
        (count,) = connection.execute(query, (run.info.run_id,)).fetchone()
    assert count >= 3 * 5  # every round's metrics are rows in PostgreSQL


@pytest.mark.timeout(120)
@pytest.mark.parametrize("password", ["wrong", None], ids=["wrong password", "no password"])
def test_a_run_on_postgres_without_its_password_is_refused_before_any_work(
    password, store_root, tmp_path, monkeypatch, capsys, database
):
    """A run tracked straight into the database (``MLFLOW_TRACKING_URI`` its URI) with a wrong
    ``PGPASSWORD``, or none: exit 2 within 10 s, one paragraph naming PGPASSWORD and libpq's
    reason, no traceback, no round; with the right one, the same check passes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", database.uri)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "none"))  # no ~/.pgpass to fall back on
    monkeypatch.setattr(cluster.cli.run, "prestart_tracking", lambda: None)  # no MLflow import
    monkeypatch.setenv("PGPASSWORD", database.password)
    check_tracking_uri()
    if password is None:
        monkeypatch.delenv("PGPASSWORD")
    else:
        monkeypatch.setenv("PGPASSWORD", password)
    config = small_config(store_root, "rounds=1", "tracking.enabled=true")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.to_dict()))
    capsys.readouterr()
    start = time.monotonic()
    code = main(["run", str(config_file)])
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert elapsed < 10, elapsed
    assert "Traceback" not in out + err and not re.search(r"round +\d+/\d+", out), (out, err)
    reason = "password authentication failed" if password else "no password supplied"
    for text in (f"MLFLOW_TRACKING_URI = '{database.uri}'", reason, "set PGPASSWORD"):
        assert text in err, (text, err)
