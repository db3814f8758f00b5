"""The tracking process: ``python -m cluster.tracking.service FD`` serves one MLflow run for the
driver at the other end of the socket FD (the driver's side, and why the run is written in a
process of its own: ``cluster.tracking.process``).

The calls are handled one by one (``MlflowTracker``), in order, the rounds' metrics together at
most every ``ROUNDS_EVERY_S`` seconds (``serve``). The first call that fails is kept and
described to the driver (``_describe``), which raises it at its next call that waits; later
writes are skipped, the run's end is still tried. A SIGTERM or SIGINT to the process itself
(``ray job stop`` signals the job's whole process tree) does not end it: the driver decides how
the run ends, so the process serves it until it closes its end, or for ``SIGNAL_GRACE_S`` at
most.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from cluster.tracking.settings import ARTIFACT_TIMEOUT_VARIABLE, sqlite_path, tracking_uri

if TYPE_CHECKING:
    from cluster.runtime.records import RoundRecord

ROUNDS_EVERY_S = 2.0  # rounds' metrics are written together at most this often
# After a SIGTERM/SIGINT, how long the process waits for the driver to end the run: longer than
# any stop grace a scheduler gives the driver (``ray job stop``'s RAY_JOB_STOP_WAIT_TIME_S may be
# raised for long rounds); a driver that dies closes its end, which ends the process at once.
SIGNAL_GRACE_S = 600.0
_SUMMARY_CHARS = 400  # of MLflow's message, in the driver's one-paragraph error


def _open(uri, experiment, run_name, params, tags, class_counts):
    from cluster.tracking.tracker import MlflowTracker

    tracker = MlflowTracker(uri, experiment, run_name, params, tags)
    if class_counts is not None:
        from datasets.partition_report import write_partition_report

        with tempfile.TemporaryDirectory() as tmp:
            tracker.log_files(write_partition_report(class_counts, tmp), "partition")
    return tracker


def _resume(uri, run_id):
    from cluster.tracking.tracker import MlflowTracker

    return MlflowTracker.resume(uri, run_id)


def _describe(failure: Exception) -> dict:
    """A failed call, as sent to the driver: MLflow's message on one line, the traceback, and
    MLflow's error code where it has one."""
    summary = " ".join(f"{type(failure).__name__}: {failure}".split())
    upload = re.search(r"/mlflow-artifacts/artifacts/\S*?/artifacts/(\S+?)[ ,]", summary)
    if upload:  # MLflow's message names the URL twice before its cause: the cause first
        cause = re.search(r"Caused by (\w+)\(?'?(.*?)'?\)*$", summary)
        summary = (
            f"the tracking server did not store the artifact {upload[1]}"
            + (f" ({cause[1]}: {cause[2]})" if cause else "")
            + ": its log says why (for an S3 --artifacts-destination: the bucket, the server's "
            f"AWS credentials, MLFLOW_S3_ENDPOINT_URL; a slow server: {ARTIFACT_TIMEOUT_VARIABLE}"
            f" or MLFLOW_HTTP_REQUEST_TIMEOUT, seconds per try). {summary}"
        )
    if len(summary) > _SUMMARY_CHARS:
        summary = summary[: _SUMMARY_CHARS - 1] + "…"
    details = "".join(traceback.format_exception(failure)).rstrip()
    return {"summary": summary, "details": details, "code": getattr(failure, "error_code", None)}


def serve(conn: Connection) -> None:
    """Handle the driver's calls in order until it closes its end (or dies).

    Rounds' metrics are written together, at most every ``ROUNDS_EVERY_S`` seconds (one SQLite
    transaction is ≈ 5 ms of CPU, taken from the training on a machine whose cores it fills),
    and before any other call is handled, so every call still sees the rounds sent before it.
    After a failure only the run's end is still tried, once: the store has failed already, so
    MLflow's HTTP retries are not spent on it again.
    """
    tracker, error = None, None
    rounds: list[tuple[RoundRecord, int]] = []  # received, not yet written
    due = math.inf  # when they are to be written

    def handle(op: str, args: tuple) -> Any:
        nonlocal tracker, error
        if error is not None:
            if not (op == "end" and tracker is not None):
                return None
            os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        try:
            if op in ("open", "resume"):
                tracker = (_open if op == "open" else _resume)(*args)
                return tracker.run_id, tracker.experiment_id
            if op != "flush":
                return getattr(tracker, op)(*args)
        except Exception as failure:  # raised in the driver at its next call that waits
            error = error or _describe(failure)
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
            try:
                conn.send(("error", error) if error is not None else ("ok", answer))
            except OSError:  # the driver closed its end without waiting for this answer
                return


def _outlive_stop_signals(grace_s: float) -> None:
    """SIGTERM and SIGINT do not end this process: ``ray job stop`` signals the job's whole
    process tree, and the driver, stopping, still writes its checkpoint and ends the run
    (KILLED) through this process. The first such signal starts a ``grace_s`` alarm: a driver
    that has not closed its end by then is not coming, and the process exits (code 143)."""

    def on_signal(signum, frame) -> None:
        if signal.getitimer(signal.ITIMER_REAL)[0] == 0:
            signal.setitimer(signal.ITIMER_REAL, grace_s)

    def on_alarm(signum, frame) -> None:
        os.write(
            2,
            f"MLflow tracking process: no end from the driver {grace_s:g} s after a "
            "stop signal; exiting\n".encode(),
        )
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGALRM, on_alarm)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)


def _preload() -> None:
    """Started ahead of its run (``prestart``), while the driver imports torch on one core: do
    now, on the other, what opening the run will need — MLflow's and the partition report's
    imports, and the tracking store's engine (MLflow keeps one per URI; ≈ 0.5 s of CPU for an
    existing SQLite store, which would otherwise run beside Ray's start-up). A SQLite store that
    does not exist yet is left alone: the run may have tracking off, and must not create it."""
    import cluster.tracking.tracker  # noqa: F401
    import datasets.partition_report  # noqa: F401

    uri = tracking_uri()
    database = sqlite_path(uri)
    if database is not None and database.is_file():
        from mlflow.tracking import MlflowClient

        with contextlib.suppress(Exception):  # the run's own opening reports any problem
            MlflowClient(uri).search_experiments(max_results=1)


def main(argv: list[str]) -> None:
    _outlive_stop_signals(SIGNAL_GRACE_S)
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
