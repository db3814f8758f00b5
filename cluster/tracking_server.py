"""One writer for concurrent runs: an ``mlflow server`` on loopback in front of a SQLite store.

Each run writes through a tracking process of its own (``tracking_process``); trials that run
at once would be as many SQLite writers, each holding the database's one write lock in turn
(and waiting, then failing with "database is locked", when one holds it long). For the length
of a sweep (or ``compare --concurrent``) a SQLite store is served instead by one ``mlflow
server`` process, with one worker, listening on 127.0.0.1 only: the trials' runs talk to it
over HTTP, and it is the store's only writer. Any other store (a tracking server already,
PostgreSQL) takes concurrent writers itself and is used as it is.

Artifacts are not proxied (``--no-serve-artifacts``): a run logs them where its experiment
keeps them, as a run on the SQLite store would (``tracking._artifact_location``).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from cluster.tracking_process import sqlite_path

START_WAIT_S = 300.0  # ≈ 10 s; 135 s measured on a 2-core machine at load 16
STOP_WAIT_S = 30.0


class TrackingServerError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:  # noqa: S310
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def single_writer(uri: str) -> Iterator[str]:
    """The URI concurrent runs write to: ``uri`` itself, unless it is a SQLite store, which
    gets a server of its own for the block (stopped after it)."""
    database = sqlite_path(uri)
    if database is None:
        yield uri
        return
    port = _free_port()
    artifacts = (database.resolve().parent / "mlruns").as_uri()
    command = [
        *(sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri),
        *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
        *("--no-serve-artifacts", "--default-artifact-root", artifacts),
    ]
    with tempfile.TemporaryDirectory(prefix="mlflow-server-") as home:
        log_path = Path(home) / "server.log"
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C is the sweep's to handle, not the server's
            )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, server, log_path)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_WAIT_S
    while not _healthy(url):
        if server.poll() is not None or time.monotonic() > deadline:
            raise TrackingServerError(
                f"the MLflow server for concurrent runs did not start within {START_WAIT_S:g} s "
                f"(exit code {server.poll()}); its log:\n{log.read_text()[-2000:]}"
            )
        time.sleep(0.25)
