"""One writer for concurrent runs: an ``mlflow server`` on loopback in front of a SQLite store.

Each run writes through a tracking process of its own (``cluster.tracking.process``); trials that
run at once would be as many SQLite writers, each holding the database's one write lock in turn
(and waiting, then failing with "database is locked", when one holds it long). For the length
of a sweep (or ``compare --concurrent``) a SQLite store is served instead by one ``mlflow
server`` process, with one worker, listening on 127.0.0.1 only: the trials' runs talk to it
over HTTP, and it is the store's only writer. Any other store (a tracking server already,
PostgreSQL) takes concurrent writers itself and is used as it is.

Artifacts are not proxied (``--no-serve-artifacts``): a run logs them where its experiment
keeps them, as a run on the SQLite store would (``tracking._artifact_location``).

The port is a free one found first, so another process may take it before the server binds
it: the server then exits (found by ``poll``, before any health check; tried again, on a new
port, ``BIND_TRIES`` times where its log says the address was in use), and a server answering
there that is not ours is never taken for it: the socket listening on the port must be held
by a process of our server's process group (``/proc/net/tcp``; where ``/proc`` cannot be read,
not checked). The server runs in a session (process group) of its own, which is signalled
whole on stopping, so that its web server's worker never outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from cluster.tracking.settings import sqlite_path

START_WAIT_S = 300.0  # ≈ 10 s; 135 s measured on a 2-core machine at load 16
STOP_WAIT_S = 30.0
BIND_TRIES = 3


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
    artifacts = (database.resolve().parent / "mlruns").as_uri()
    with tempfile.TemporaryDirectory(prefix="mlflow-server-") as home:
        log_path = Path(home) / "server.log"
        for attempt in range(1, BIND_TRIES + 1):
            port = _free_port()
            command = [
                *(sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri),
                *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
                *("--no-serve-artifacts", "--default-artifact-root", artifacts),
            ]
            server = _start(command, log_path)
            url = f"http://127.0.0.1:{port}"
            try:
                ours = _wait_healthy(url, port, server, log_path, attempt < BIND_TRIES)
            except BaseException:
                stop(server)
                raise
            if ours:
                break
            stop(server)  # exited, its port taken: whatever of it is left, then another port
        try:
            yield url
        finally:
            stop(server)


def _start(command: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C is the sweep's to handle, not the server's; and
        )  # fmt: skip  # its process group (its id the server's pid) is stopped whole


def stop(server: subprocess.Popen, wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM to the server's process group (the server and its web server's workers), then
    SIGKILL to whatever of it is left after ``wait_s`` (or once the server has exited)."""
    _signal_group(server, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(wait_s)
    _signal_group(server, signal.SIGKILL)  # a worker the server left behind
    server.wait()


def _signal_group(server: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.pid, signum)  # start_new_session: the group's id is the server's pid


def _listening(port: int) -> set[str] | None:
    """The inodes of the sockets listening on 127.0.0.1:``port`` (None: no ``/proc``)."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    found = set()
    for line in lines:
        local, state, inode = (line.split()[i] for i in (1, 3, 9))
        if state == "0A" and local == f"0100007F:{port:04X}":  # LISTEN on 127.0.0.1
            found.add(inode)
    return found


def _ours(port: int, server: subprocess.Popen) -> bool:
    """The socket listening on ``port`` is held by a process of ``server``'s group (True
    where that cannot be read: no ``/proc``)."""
    inodes = _listening(port)
    if inodes is None:
        return True
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != server.pid:
                continue
            links = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
        except OSError:  # gone, or not ours to read
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            return True
    return False


def _wait_healthy(url: str, port: int, server: subprocess.Popen, log: Path, retry: bool) -> bool:
    """Wait for our server to answer at ``url`` (True). False: it exited on finding ``port``
    taken and ``retry`` allows another. Else an exit, another process answering on ``port``,
    or no answer in ``START_WAIT_S`` raises."""
    deadline = time.monotonic() + START_WAIT_S
    while True:
        code = server.poll()  # first: an answer on the port is not ours once ours has exited
        if code is not None:
            text = log.read_text()
            if retry and "address already in use" in text.lower():
                return False
            raise TrackingServerError(
                f"the MLflow server for concurrent runs exited (code {code}) before it "
                f"answered; its log:\n{text[-2000:]}"
            )
        if _healthy(url):
            if _ours(port, server):
                return True
            if server.poll() is None:  # ours is alive: the answer was another's
                raise TrackingServerError(
                    f"another process answers on port {port}, which the MLflow server for "
                    f"concurrent runs was to listen on; its log:\n{log.read_text()[-2000:]}"
                )
            continue  # ours exited meanwhile: said above
        if time.monotonic() > deadline:
            raise TrackingServerError(
                f"the MLflow server for concurrent runs did not start within {START_WAIT_S:g} s; "
                f"its log:\n{log.read_text()[-2000:]}"
            )
        time.sleep(0.25)
