"""The driver's side of the experiment's MLflow run, written by a process of its own (DESIGN §8).

Importing MLflow and opening its store is ≈ 2.5 s of Python (MLflow's own imports, SQLAlchemy's
mappers; matplotlib for the partition report). On a thread of the driver that code held the
GIL the training hosts need between their kernels: workload A's first round took 1.8 s instead
of 0.2 s, and its 30 rounds 8.2 s instead of 5.8 s. Here it runs in ``python -m
cluster.tracking.service`` (the process side: ``serve``): the driver never imports MLflow.
``TrackingRun`` sends the process its calls over a socket pair, in order, and waits only where
it needs an answer: the run id (which names the checkpoint), ``flush`` before a checkpoint, and
the end of the run. The first call that fails in the process is raised in the driver at the
next call that waits (a run that failed otherwise still ends, with its own status). The process
runs in its own session, so a Ctrl-C reaches only the driver (which ends the run as KILLED),
and exits when the driver closes its end or dies.

No wait of the driver's can last for good: each notices the process's death within
``POLL_S``, the run's opening is awaited at most ``OPEN_WAIT_S``, and a failure that leaves no
run to write to (the opening refused, the process gone or silent) is kept: every later call
that waits raises it at once. MLflow's HTTP retries are bounded (``HTTP_RETRY_BUDGET``, set in
the process's environment): a tracking server that goes away, or answers 429/503 with any
``Retry-After``, is given up within ≈ 25 s, not MLflow's default minutes (or the header's hours).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.redaction import redact_credentials
from cluster.tracking.settings import (
    ARTIFACT_TIMEOUT_S,
    ARTIFACT_TIMEOUT_VARIABLE,
)

if TYPE_CHECKING:
    import numpy as np

    from cluster.runtime.records import RoundRecord

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.5  # how often a wait checks that the process is still alive
OPEN_WAIT_S = 60.0  # the longest wait for the run's opening (a healthy store takes ≈ 1 s)
EXIT_WAIT_S = 10.0  # the longest wait for the process to exit once the driver closed its end
# MLflow's HTTP retries, unless the user set them: 3 retries 2 s and 4 s apart (+ ≤ 0.5 s of
# jitter each), each try bounded by 4 s. A server that refuses connections is given up in
# ≈ 7 s, one that accepts and never answers in ≈ 23 s (MLflow's defaults: 7 retries up to
# 120 s apart, 120 s a try). A 429 or 503 is retried on the same backoff whatever its
# Retry-After says: MLflow (urllib3) would otherwise sleep as long as the header asks, an hour
# per retry for "Retry-After: 3600". Read by MLflow at each request, in the tracking process
# only.
HTTP_RETRY_BUDGET = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "4",
    "MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER": "false",
}


class TrackingError(RuntimeError):
    """The run's tracking failed: an MLflow call in the tracking process, or the process itself.
    ``str`` is one paragraph for the terminal; ``details``, the tracking process's traceback
    (empty when there is none); ``code``, MLflow's error code (e.g. ``RESOURCE_DOES_NOT_EXIST``)
    when MLflow gave one."""

    def __init__(self, message: str, details: str = "", code: str | None = None):
        super().__init__(redact_credentials(message))
        self.details, self.code = redact_credentials(details), code

    @classmethod
    def from_reply(cls, uri: str, failure: dict) -> TrackingError:
        """The tracking process's account of a failed MLflow call
        (``cluster.tracking.service``)."""
        message = f"MLflow failed on {uri}: {failure['summary']}"
        return cls(message, failure["details"], failure["code"])


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: ``{"a.b": "value"}``."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = str(value)
    return out


class TrackingRun:
    """The driver's handle on one MLflow run in the tracking process.

    ``open`` starts a new run (params, tags; with ``class_counts``, the partition report among
    its artifacts); ``resume`` continues one. Both return at once: the run opens while the
    caller goes on, and ``run_id`` waits for it (``OPEN_WAIT_S`` at most). A store that refuses
    to open the run raises a ``ConfigError`` naming ``MLFLOW_TRACKING_URI`` (the user's input
    to fix); every other failure, a ``TrackingError``. Calls that return at once (``log_round``,
    ``set_tags``) never raise: what they meet is raised by the next call that waits."""

    def __init__(self, uri: str, first_call: tuple[str, tuple]):
        self._process, self._conn = _take_prestarted() or _spawn(preload=False)
        self.uri = uri
        self._first_call = first_call
        self._opened: tuple[str, str] | None = None  # (run id, experiment id)
        self._awaited = 1  # answers due and not yet read (the opening's, first)
        # A failure that leaves nothing to write to: raised again by every call that waits.
        self._failure: Exception | None = None
        self._send(*first_call, reply=True)

    @classmethod
    def open(
        cls,
        uri: str,
        experiment: str,
        run_name: str | None,
        params: dict[str, str],
        tags: dict[str, str],
        class_counts: np.ndarray | None = None,
    ) -> TrackingRun:
        return cls(uri, ("open", (uri, experiment, run_name, params, tags, class_counts)))

    @classmethod
    def resume(cls, uri: str, run_id: str) -> TrackingRun:
        return cls(uri, ("resume", (uri, run_id)))

    # ------------------------------------------------------------------ what the driver calls

    def is_open(self) -> bool:
        """Whether the run exists already (never waits; raises if opening it failed)."""
        if self._opened is None and self._failure is None and not self._conn.poll():
            return False
        return self._open_reply() is not None

    def wait_open(self) -> None:
        """Wait until the run is open (``OPEN_WAIT_S`` at most); raise why it is not."""
        self._open_reply()

    @property
    def run_id(self) -> str:
        """The run's id: waits for the opening; once the run opened, never raises."""
        return self._open_reply()[0]

    @property
    def experiment_id(self) -> str:
        return self._open_reply()[1]

    def run_page(self) -> str:
        """The run's page, in the machine-learning (not GenAI) workflow: on the tracking server,
        or under ``mlflow ui`` at its default address for a local store."""
        server = self.uri if self.uri.startswith("http") else "http://127.0.0.1:5000"
        return (
            f"{server.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
            "?workflowType=machine_learning"
        )

    def log_round(self, record: RoundRecord) -> None:
        """Hand the round's metrics on, stamped now; returns at once."""
        self._send("log_round", (record, int(time.time() * 1000)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._send("set_tags", (tags,))

    def log_files(self, paths: list[Path], artifact_path: str) -> None:
        """Log ``paths`` under ``artifact_path``; returns once they are logged."""
        self._call("log_files", ([str(p) for p in paths], artifact_path))

    def flush(self) -> None:
        """Wait until every call so far is written (before a checkpoint); raise its error."""
        self._call("flush", ())

    def finish(
        self,
        config: dict,
        history: list[RoundRecord],
        model_state: dict,
        summary: dict,
        privacy_report: dict,
        status: str = "FINISHED",
    ) -> None:
        """The run's artifacts (config, history, summary, privacy report, curves, the model's
        ``model_state``), then its end with ``status``; the process exits."""
        import torch  # the driver has it; the tracking process never imports it

        with tempfile.TemporaryDirectory() as tmp:
            model_file = Path(tmp) / "model.pt"
            torch.save(model_state, model_file)
            artifacts = (config, history, str(model_file), summary, privacy_report, status)
            self._call("finish", artifacts)
        self._close()

    def end(self, status: str = "FINISHED") -> None:
        """End the run with ``status``; the process exits."""
        try:
            self._call("end", (status,))
        finally:
            self._close()

    def abandon(self, status: str = "FAILED") -> None:
        """End a run that failed (or was stopped) with ``status``, raising nothing: the run's
        own error is the one to report. Returns at once when there is no run to end (its
        opening failed, or the process is gone)."""
        from cluster.config import ConfigError  # the driver has it; the process never needs it

        with contextlib.suppress(TrackingError, ConfigError):
            self.end(status)

    # ------------------------------------------------------------------ plumbing

    def _send(self, op: str, args: tuple, reply: bool = False) -> None:
        """Send a call; a process found gone is kept as the failure the next wait raises."""
        if self._failure is not None:
            return
        try:
            self._conn.send((op, args, reply))
        except OSError:
            self._failure = self._exited()

    def _call(self, op: str, args: tuple) -> Any:
        self._open_reply()  # the first answer is the opening's
        self._send(op, args, reply=True)
        self._awaited += 1
        # Answers come in order: any before ours belong to calls whose wait a signal cut short.
        status, value = self._receive(within=None)
        while self._awaited:
            status, value = self._receive(within=None)
        if status == "error":
            raise TrackingError.from_reply(self.uri, value)
        return value

    def _open_reply(self) -> tuple[str, str]:
        if self._opened is None:
            status, value = self._receive(within=OPEN_WAIT_S)
            if status == "error":
                self._failure = self._open_refused(value)
                raise self._failure
            self._opened = value
        return self._opened

    def _receive(self, within: float | None) -> tuple[str, Any]:
        """The process's next answer, waiting ``within`` seconds at most (None: as long as the
        process lives). A failure kept from before is raised at once; the process's death, or
        its silence past ``within`` (it is then killed), is kept and raised."""
        if self._failure is not None:
            raise self._failure
        deadline = math.inf if within is None else time.monotonic() + within
        try:
            while not self._conn.poll(POLL_S):
                if self._process.poll() is not None:
                    raise self._exited()
                if time.monotonic() > deadline:
                    self._process.kill()
                    raise TrackingError(
                        f"the MLflow tracking process did not answer within {within:g} s (its "
                        f"store at {self.uri} may be locked or hanging); it was stopped"
                    )
            try:
                answer = self._conn.recv()
            except (EOFError, OSError):
                raise self._exited() from None
            self._awaited -= 1
            return answer
        except TrackingError as failure:
            self._failure = failure
            raise

    def _exited(self) -> TrackingError:
        try:
            code = self._process.wait(POLL_S)  # its end of the socket closes as it exits
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = "closed its connection" if code is None else f"exited with code {code}"
        return TrackingError(
            f"the MLflow tracking process {how} before the run ended: the run on {self.uri} "
            "stays RUNNING and may lack the rounds after the last checkpoint"
        )

    def _open_refused(self, failure: dict) -> Exception:
        """The store's refusal to open the run, as the input to fix (``MLFLOW_TRACKING_URI``)."""
        from cluster.config import ConfigError

        op, args = self._first_call
        summary = failure["summary"]
        if op == "resume" and failure["code"] == "RESOURCE_DOES_NOT_EXIST":
            fix = (
                f"the checkpoint's MLflow run {args[1]} is not in this store ({summary}); set "
                "MLFLOW_TRACKING_URI to the store the run was tracked in"
            )
        else:
            what = "open a new run" if op == "open" else f"resume the run {args[1]}"
            fix = (
                f"MLflow could not {what} there ({summary}); point MLFLOW_TRACKING_URI at a "
                "working store (unset, it is sqlite:///mlflow.db in the working directory)"
            )
        error = ConfigError("MLFLOW_TRACKING_URI", self.uri, fix)
        error.__cause__ = TrackingError.from_reply(self.uri, failure)
        return error

    def _close(self) -> None:
        """Close our end: the process finishes what it was sent and exits (``EXIT_WAIT_S`` at
        most, then it is killed). Later calls that wait raise."""
        if self._failure is None:
            self._failure = TrackingError("the MLflow run has ended: nothing more is written")
        self._conn.close()
        try:
            self._process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


_prestarted: list[tuple[subprocess.Popen, Connection]] = []  # oldest first


def prestart(count: int = 1) -> None:
    """Have ``count`` tracking processes started ahead of their runs, starting those missing
    now: their imports (MLflow, matplotlib for the partition report: ≈ 1.4 s of CPU) then run
    on a core left idle instead of beside the first rounds' training. The ``run`` command starts
    one before the driver imports torch (single-threaded, so the other core is free); runs one
    after another (``compare``) keep one more, for the next run, loading while the current one
    trains. Each ``TrackingRun`` takes the oldest; unused (tracking off), they exit with the
    driver."""
    _prestarted[:] = [taken for taken in _prestarted if _alive(taken)]
    while len(_prestarted) < count:
        _prestarted.append(_spawn(preload=True))


def _take_prestarted() -> tuple[subprocess.Popen, Connection] | None:
    while _prestarted:
        taken = _prestarted.pop(0)
        if _alive(taken):
            return taken
    return None


def _alive(prestarted: tuple[subprocess.Popen, Connection]) -> bool:
    """Whether a prestarted process still runs; the connection of one that ended is closed."""
    process, conn = prestarted
    if process.poll() is None:
        return True
    conn.close()
    return False


_ARTIFACT_TIMEOUT = {ARTIFACT_TIMEOUT_VARIABLE: ARTIFACT_TIMEOUT_S}


def _spawn(preload: bool) -> tuple[subprocess.Popen, Connection]:
    ours, theirs = socket.socketpair()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.tracking.service", str(theirs.fileno())]
        + (["--preload"] if preload else []),
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        # MLflow's INFO lines ("Creating initial MLflow database tables...") would interleave
        # with the run's progress; a level the user (or the CLI's --verbose) set wins, and so
        # do HTTP retry settings the user gave. On a tracking server MLflow would also print
        # "View run … at" links when a run ends (one more request to the server, and links to
        # its GenAI view): the driver prints the run's page itself (``run_page``).
        env={
            "MLFLOW_LOGGING_LEVEL": "WARNING",
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
            **HTTP_RETRY_BUDGET,
            **({} if "MLFLOW_HTTP_REQUEST_TIMEOUT" in os.environ else _ARTIFACT_TIMEOUT),
            **os.environ,
            "PYTHONPATH": path,
        },
        start_new_session=True,  # a Ctrl-C reaches the driver, which ends the run as KILLED
    )
    theirs.close()
    return process, Connection(ours.detach())
