"""The experiment's MLflow run, written by a process of its own (DESIGN §8).

Importing MLflow and opening its store is ≈ 2.5 s of Python (MLflow's own imports, SQLAlchemy's
mappers; matplotlib for the partition report). On a thread of the driver that code held the
GIL the training hosts need between their kernels: workload A's first round took 1.8 s instead
of 0.2 s, and its 30 rounds 8.2 s instead of 5.8 s. Here it runs in ``python -m
cluster.tracking_process``: the driver never imports MLflow. ``TrackingRun`` (driver side)
sends the process its calls over a socket pair, in order, and waits only where it needs an
answer: the run id (which names the checkpoint), ``flush`` before a checkpoint, and the end of
the run. The process handles the calls one by one (``MlflowTracker``), the rounds' metrics
together at most every ``ROUNDS_EVERY_S`` seconds (``serve``); the first call that fails is
kept, later writes are skipped, and its error is raised in the driver at the next call that
waits (a run that failed otherwise still ends, with its own status). The process runs in its
own session, so a Ctrl-C reaches only the driver (which ends the run as KILLED), and exits when
the driver closes its end or dies.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from cluster.records import RoundRecord

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
EXIT_TIMEOUT_S = 60.0
ROUNDS_EVERY_S = 2.0  # rounds' metrics are written together at most this often


def tracking_uri() -> str:
    """Where runs are tracked: ``$MLFLOW_TRACKING_URI``, else the local SQLite file. Here, in a
    module that imports neither MLflow nor torch: the driver checks it before Ray starts, the
    tracking process before the driver's run is configured."""
    return os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` URI."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix) :]) if uri.startswith(prefix) else None


class TrackingError(RuntimeError):
    """A call to MLflow failed in the tracking process (its error and traceback inside)."""


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
    caller goes on, and ``run_id`` waits for it."""

    def __init__(self, uri: str, first_call: tuple[str, tuple]):
        self._process, self._conn = _take_prestarted() or _spawn(preload=False)
        self.uri = uri
        self._opened: tuple[str, str] | None = None  # (run id, experiment id)
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
        return self._opened is not None or (self._conn.poll() and self._open_reply() is not None)

    @property
    def run_id(self) -> str:
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
        own error is the one to report."""
        with contextlib.suppress(TrackingError, OSError):
            self.end(status)

    # ------------------------------------------------------------------ plumbing

    def _send(self, op: str, args: tuple, reply: bool = False) -> None:
        try:
            self._conn.send((op, args, reply))
        except OSError as error:
            raise self._exited() from error

    def _call(self, op: str, args: tuple) -> Any:
        self._open_reply()  # the first answer is the opening's
        self._send(op, args, reply=True)
        return self._answer()

    def _open_reply(self) -> tuple[str, str]:
        if self._opened is None:
            self._opened = self._answer()
        return self._opened

    def _answer(self) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as error:
            raise self._exited() from error
        if status == "error":
            raise TrackingError(value)
        return value

    def _exited(self) -> TrackingError:
        code = self._process.poll()
        return TrackingError(
            f"the MLflow tracking process exited (code {code}) before the run ended; "
            "its error is printed above"
        )

    def _close(self) -> None:
        """Close our end: the process finishes what it was sent and exits."""
        self._conn.close()
        try:
            self._process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


_prestarted: tuple[subprocess.Popen, Connection] | None = None


def prestart() -> None:
    """Start the next run's tracking process now, before the driver imports torch: its own
    imports (MLflow, matplotlib for the partition report: ≈ 1.4 s of CPU) then run on the core
    the single-threaded imports leave idle instead of beside the first rounds' training. The
    next ``TrackingRun`` takes it; unused (tracking off), it exits with the driver."""
    global _prestarted
    if _prestarted is None:
        _prestarted = _spawn(preload=True)


def _take_prestarted() -> tuple[subprocess.Popen, Connection] | None:
    global _prestarted
    taken, _prestarted = _prestarted, None
    return taken if taken is not None and taken[0].poll() is None else None


def _spawn(preload: bool) -> tuple[subprocess.Popen, Connection]:
    ours, theirs = socket.socketpair()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.tracking_process", str(theirs.fileno())]
        + (["--preload"] if preload else []),
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        # MLflow's INFO lines ("Creating initial MLflow database tables...") would interleave
        # with the run's progress; a level the user (or the CLI's --verbose) set wins.
        env={"MLFLOW_LOGGING_LEVEL": "WARNING", **os.environ, "PYTHONPATH": path},
        start_new_session=True,  # a Ctrl-C reaches the driver, which ends the run as KILLED
    )
    theirs.close()
    return process, Connection(ours.detach())


# ---------------------------------------------------------------------- the tracking process


def _open(uri, experiment, run_name, params, tags, class_counts):
    from cluster.tracking import MlflowTracker

    tracker = MlflowTracker(uri, experiment, run_name, params, tags)
    if class_counts is not None:
        from datasets.partition_report import write_partition_report

        with tempfile.TemporaryDirectory() as tmp:
            tracker.log_files(write_partition_report(class_counts, tmp), "partition")
    return tracker


def _resume(uri, run_id):
    from cluster.tracking import MlflowTracker

    return MlflowTracker.resume(uri, run_id)


def serve(conn: Connection) -> None:
    """Handle the driver's calls in order until it closes its end (or dies).

    Rounds' metrics are written together, at most every ``ROUNDS_EVERY_S`` seconds (one SQLite
    transaction is ≈ 5 ms of CPU, taken from the training on a machine whose cores it fills),
    and before any other call is handled, so every call still sees the rounds sent before it.
    """
    tracker, error = None, None
    rounds: list[tuple[RoundRecord, int]] = []  # received, not yet written
    due = math.inf  # when they are to be written

    def handle(op: str, args: tuple) -> Any:
        nonlocal tracker, error
        # After a failure only ``end`` still runs: a failed run is still ended, with its status.
        if error is not None and not (op == "end" and tracker is not None):
            return None
        try:
            if op in ("open", "resume"):
                tracker = (_open if op == "open" else _resume)(*args)
                return tracker.run_id, tracker.experiment_id
            if op != "flush":
                return getattr(tracker, op)(*args)
        except Exception as failure:  # raised in the driver at its next call that waits
            error = error or "".join(traceback.format_exception(failure)).rstrip()
        return None

    def write_rounds() -> None:
        nonlocal rounds, due
        if rounds:
            handle("log_rounds", (rounds,))
        rounds, due = [], math.inf

    while True:
        if not conn.poll(max(due - time.monotonic(), 0.0) if rounds else None):
            write_rounds()
            continue
        try:
            op, args, reply = conn.recv()
        except (EOFError, OSError):  # the driver closed its end, or died (ECONNRESET when it
            write_rounds()  # left a reply unread): what it sent is still written
            return
        if op == "log_round":
            rounds.append(args)
            due = min(due, time.monotonic() + ROUNDS_EVERY_S)
            continue
        write_rounds()
        answer = handle(op, args)
        if reply:
            conn.send(("error", error) if error is not None else ("ok", answer))


def _preload() -> None:
    """Started ahead of its run (``prestart``), while the driver imports torch on one core: do
    now, on the other, what opening the run will need — MLflow's and the partition report's
    imports, and the tracking store's engine (MLflow keeps one per URI; ≈ 0.5 s of CPU for an
    existing SQLite store, which would otherwise run beside Ray's start-up). A SQLite store that
    does not exist yet is left alone: the run may have tracking off, and must not create it."""
    import cluster.tracking  # noqa: F401
    import datasets.partition_report  # noqa: F401

    uri = tracking_uri()
    database = sqlite_path(uri)
    if database is not None and database.is_file():
        from mlflow.tracking import MlflowClient

        with contextlib.suppress(Exception):  # the run's own opening reports any problem
            MlflowClient(uri).search_experiments(max_results=1)


def main(argv: list[str]) -> None:
    if "--preload" in argv[1:]:
        _preload()
    with Connection(int(argv[0])) as conn:
        serve(conn)
    # Every call was answered or written before the driver closed its end: skip the
    # interpreter's teardown (MLflow's and SQLAlchemy's exit hooks, ≈ 0.7 s of CPU).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
