"""``cluster.tracking.server`` without an MLflow server (fast): another process answering on
the port is never taken for ours, an exit is seen before any health check (a taken port is
retried), and stopping ends the server's whole process group."""

import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.tracking.server import TrackingServerError, _wait_healthy, stop


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _session(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_another_server_on_the_port_is_not_taken_for_ours(tmp_path):
    other = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    ours = _session("import time; time.sleep(60)")  # alive, not listening
    log = tmp_path / "server.log"
    log.write_text("")
    try:
        with pytest.raises(TrackingServerError, match=f"another process answers on port {port}"):
            _wait_healthy(f"http://127.0.0.1:{port}", port, ours, log, retry=True)
    finally:
        stop(ours, wait_s=5)
        other.shutdown()
    assert ours.returncode is not None


def test_an_exit_is_seen_first_and_a_taken_port_retried(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("ERROR: [Errno 98] error while attempting to bind: address already in use\n")
    exited = _session("raise SystemExit(1)")
    exited.wait()
    url = "http://127.0.0.1:9"  # nothing answers: only poll() can end the wait
    assert _wait_healthy(url, 9, exited, log, retry=True) is False
    with pytest.raises(TrackingServerError, match="exited \\(code 1\\)"):
        _wait_healthy(url, 9, exited, log, retry=False)


def test_stop_ends_the_whole_process_group(tmp_path):
    """The server's child (uvicorn's worker) outlives a signal to the server alone."""
    pid_file = tmp_path / "child"
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit())"
        f"; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])"
        f"; open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)"
    )
    server = _session(code)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    stop(server, wait_s=5)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie awaiting its (new) parent's wait is gone
