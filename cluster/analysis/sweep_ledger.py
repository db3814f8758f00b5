"""A sweep's local ledger of trials: how a sweep with tracking off resumes, and how any sweep
refuses a rerun that switched tracking.

It is a folder of the sweep's own, ``ledger/`` under its ``--out`` folder (so ``--out`` is part
of an untracked sweep's identity: a rerun resumes only from the ledger under the same one),
written with tracking on or off: one JSON file per trial, ``<its digest>.json`` (the trial's
``sweep_trial`` digest: hex and integers, never a config value, so the file stays in that
folder), written atomically (``locations.write_atomic``) before the trial's task is submitted
(status SUBMITTED: from then on it may run, ``trials.RayTrials``) and when it ends (FINISHED,
KILLED, ABANDONED or FAILED). A trial stopped before its placement group was created never ran:
the entry its SUBMITTED one replaced is put back (none: the file is removed). A failed write
raises the ``OSError`` of the class and errno the OS gave, naming the entry (``[Errno 28]
ledger entry <file>: No space left on device``): before the task it ends the sweep, the trial
not submitted (no trial starts after it: ``trials.RecordingFailed``); at the end it is said
(``sweep._record``), and the entry stays SUBMITTED, an earlier attempt to a rerun::

    version      1
    sweep        the spec's name
    name         the trial's name (its run name where tracked)
    digest       its digest (configuration, seed, repeat)
    params       its config's params as a run records them (``sweep_resume.attempt_params``);
                 ``tracking.enabled`` among them says whether the attempt was tracked
    status       SUBMITTED, KILLED, ABANDONED (``TrialResult.abandoned``: rounds it ran are
                 in no checkpoint, never continued), FAILED or FINISHED (RUNNING: written by
                 earlier versions once the trial's placement group was created)
    checkpoint   where its checkpoint is (``checkpoint_path`` of its config and its MLflow
                 run; "" for a tracked attempt whose run is not known yet)
    seconds      what its attempts ran, summed (a resumed trial's killed part included)
    metric, test_accuracy, epsilon, error, privacy   its ``TrialRecord``'s (FINISHED: all,
                 ``privacy`` a ``TrialPrivacy``)
    earlier      its earlier attempts that no accountant holds, carried from entry to entry

With tracking on, the sweep's trials are resumed from the MLflow store
(``sweep_runs.MlflowLedger``); this ledger then only records them, so that a rerun with
tracking off finds they ran: a sweep reruns with tracking as its attempts ran, or exits 2
(``Ledger.read``: the MLflow runs never see an untracked attempt), and so that a tracked rerun
counts those of its entries whose runs the MLflow store does not hold under the parent run
(``sweep_runs.unmatched_entries``: another store, a deleted run). An unusable entry is an
earlier attempt either way.

With tracking off a rerun resumes by the same rules as the MLflow path: a FINISHED entry is not
run again (its recorded result is the trial's); a KILLED one whose params, checkpoint and
config match the trial (``sweep_resume.continuation``) is continued from its checkpoint, so its
ε is stated; any other entry (SUBMITTED or RUNNING: the sweep did not see the trial end, and it
may have run; ABANDONED; FAILED; KILLED without a matching checkpoint, as one stopped before
its first round leaves, which is counted though it may have trained on nothing; an entry that
cannot be read, or of another trial, or FINISHED without a ``privacy`` that parses) runs again
from round 0, a line saying why, and stays an earlier attempt: the sweep states no ε. So does a
trial with no entry whose own checkpoint exists: an attempt of it ran without this ledger
(under another ``--out``), and which attempts ran before that one is unknown. (One under
another ``--out`` that left no checkpoint here, having stopped before its first or having been
tracked, is not found: hence the same ``--out``.) Nothing is unpickled here: entries are JSON,
and a checkpoint is read by the weights-only loader (``open_checkpoint``), only at the path the
trial's own config gives (the entry's ``checkpoint`` must be that one).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from cluster.analysis.sweep_report import TrialRecord
from cluster.analysis.sweep_resume import (
    Resumption,
    attempt_params,
    continuation,
    refused_line,
    rerun_line,
    resumed,
    resumed_line,
)
from cluster.analysis.trials import Trial, TrialResult
from cluster.config import ConfigError

FOLDER = "ledger"  # under the sweep's --out folder
LOCK = ".lock"  # in it: held by the sweep using the ledger (``Ledger.hold``), its pid inside
VERSION = 1
ENDED = ("KILLED", "ABANDONED", "FAILED", "FINISHED")
# SUBMITTED: written before the trial's task is submitted; RUNNING: by earlier versions, once
# its placement group was created. Either is an attempt the sweep did not see end.
STATUSES = ("SUBMITTED", "RUNNING", *ENDED)
DIGEST = re.compile(r"^[0-9a-f]{16}-seed-?[0-9]+(-repeat[0-9]+)?$")  # sweep_spec.trial_digest
NUMBER = (int, float, type(None))
FIELDS = {
    "version": int, "sweep": str, "name": str, "digest": str, "params": dict, "status": str,
    "checkpoint": str, "seconds": (int, float), "metric": NUMBER, "test_accuracy": NUMBER,
    "epsilon": str, "error": str, "privacy": (dict, type(None)), "earlier": list,
}  # fmt: skip
TRACKED = "tracking.enabled"  # the param that says whether an attempt was tracked


class LedgerInUse(RuntimeError):
    """Another process holds the ledger ``folder`` (``Ledger.hold``); ``pid``: its process id
    as it wrote it ("" where it is not known)."""

    def __init__(self, folder: Path, pid: str):
        who = f"process {pid}" if pid else "another process"
        super().__init__(
            f"the ledger {folder} is in use by {who} (a sweep on the same --out, running or "
            "ending its trials); wait for it to end, or give another --out"
        )


class Ledger:
    """The trials of one sweep, kept in ``folder`` (see the module doc); ``tracked``: whether
    this run of the sweep tracks them in MLflow. With tracking off, the sweep's ledger (the same
    methods as ``sweep_runs.MlflowLedger``); with it on, that one's record of attempts."""

    def __init__(self, folder: Path, sweep: str, tracked: bool):
        self.folder, self.sweep, self.tracked = folder, sweep, tracked
        self.records: dict[str, TrialRecord] = {}  # by trial name
        self.entries: dict[str, dict | str] = {}  # by trial name: its entry, or why unusable
        self.earlier: dict[str, list[str]] = {}  # by trial name: its earlier attempts
        # by trial name: the bytes of the entry its SUBMITTED one replaced (None: there was none)
        self.replaced: dict[str, bytes | None] = {}
        self.submitted: dict[str, bytes] = {}  # by trial name: its SUBMITTED entry's bytes

    def hold(self) -> IO[str]:
        """The ledger, this process's alone until the file returned is closed (or the process
        ends, however): an exclusive ``flock`` on its ``LOCK`` file, taken at once, else
        ``LedgerInUse`` (a sweep still running, or ending its trials after Ctrl-C, on the same
        ``--out``, whose entries would change under it); ``OSError`` naming the file where it
        cannot be opened."""
        import fcntl

        lock = self.folder / LOCK
        with _naming(lock):
            self.folder.mkdir(parents=True, exist_ok=True)
            file = open(lock, "a+")  # noqa: SIM115  (held open for the sweep's lifetime)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip()
            file.close()
            raise LedgerInUse(self.folder, holder) from None
        file.truncate(0)
        file.write(f"{os.getpid()}\n")
        file.flush()
        return file

    def path(self, record: TrialRecord) -> Path:
        if not DIGEST.match(record.digest):  # sweep_spec.trial_digest makes them so
            raise AssertionError(f"trial digest {record.digest!r} is no file name")
        return self.folder / f"{record.digest}.json"

    def read(self, records: list[TrialRecord]) -> None:
        """Read the entries of the ``records`` not read before. ``ConfigError`` where one was
        written by an attempt tracked otherwise than this run of the sweep."""
        for record in records:
            if record.name in self.records:
                continue
            self.records[record.name] = record
            if not self.path(record).exists():
                continue
            entry = self._read(record)
            self.entries[record.name] = entry
            if isinstance(entry, str):  # it may have started: conservatively an attempt
                self.earlier[record.name] = [
                    f"{record.name} (an unusable ledger entry, {self.path(record)}: {entry})"
                ]
                continue
            self._check_tracking(record, entry)
            self.earlier[record.name] = list(entry["earlier"])

    def _check_tracking(self, record: TrialRecord, entry: dict) -> None:
        tracked = entry["params"].get(TRACKED) == str(True)
        if tracked == self.tracked:
            return
        held = "its MLflow runs" if tracked else "this ledger"
        ran = str(tracked).lower()
        raise ConfigError(
            TRACKED,
            self.tracked,
            f"trial {record.name} ran with {TRACKED}: {ran} (ledger entry {self.path(record)}); "
            f"its attempts are in {held}, which this rerun would not resume from: rerun the "
            f"sweep with {TRACKED}: {ran}",
        )

    def find_finished(self, records: list[TrialRecord]) -> None:
        """Read the ``records``' entries; mark those that finished (``resumed``)."""
        self.read(records)
        for record in records:
            entry = self.entries.get(record.name)
            if isinstance(entry, dict) and entry["status"] == "FINISHED":
                record.status, record.resumed = "FINISHED", True
                record.metric, record.test_accuracy = entry["metric"], entry["test_accuracy"]
                record.epsilon, record.seconds = entry["epsilon"], float(entry["seconds"])
                record.privacy = entry["privacy"]

    def _read(self, record: TrialRecord) -> dict | str:
        """The record's entry, or why it cannot be used."""
        from privacy.tuning import TrialPrivacy

        try:
            entry = json.loads(self.path(record).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            return f"unreadable: {error}"
        if not isinstance(entry, dict):
            return "not a JSON object"
        for key, kind in FIELDS.items():
            if not isinstance(entry.get(key), kind):
                return f"its {key} is {entry.get(key)!r}"
        expected = {"version": VERSION, "sweep": self.sweep, "name": record.name,
                    "digest": record.digest}  # fmt: skip
        for key, value in expected.items():
            if entry[key] != value:
                return f"its {key} is {entry[key]!r}, this trial's {value!r}"
        if entry["status"] not in STATUSES:
            return f"its status is {entry['status']!r}"
        if not all(isinstance(line, str) for line in entry["earlier"]):
            return f"its earlier is {entry['earlier']!r}"
        if entry["status"] == "FINISHED":  # its privacy makes the sweep's statement
            try:
                TrialPrivacy.from_dict(entry["privacy"] or {})
            except (TypeError, ValueError) as error:
                return f"its privacy is {entry['privacy']!r} ({error})"
        return entry

    def resume_killed(self, trials: list[Trial], say: Callable[[str], None]) -> list[Trial]:
        """``trials``, each whose KILLED entry matches it set to resume from its checkpoint;
        ``say`` gets a line per trial continued and per attempt that is not, with the reason."""
        continued = []
        for trial in trials:
            entry = self.entries.get(trial.name)
            if entry is None:
                self._unrecorded_attempt(trial, say)
                continued.append(trial)
                continue
            found = self._continuation(entry, trial)
            if isinstance(found, Resumption):
                say(resumed_line(trial, f"attempt (ledger entry {self._file(trial)})", found))
                continued.append(resumed(trial, found))
                continue
            status = "" if isinstance(entry, str) else f"{entry['status']} "
            say(refused_line(trial, f"{status}attempt (ledger entry {self._file(trial)})", found))
            if not isinstance(entry, str):  # an unusable one is an earlier attempt already
                self.earlier[trial.name].append(
                    f"{trial.name} {entry['status']} (an earlier attempt, {self._file(trial)})"
                )
            say(rerun_line(trial))
            continued.append(trial)
        return continued

    def _unrecorded_attempt(self, trial: Trial, say: Callable[[str], None]) -> None:
        """A trial without an entry whose own checkpoint exists: an attempt that this ledger
        never held (the sweep ran under another ``--out``). Not continued: which attempts ran
        before it is unknown. It is an earlier attempt, and the trial runs from round 0."""
        from cluster.runtime.checkpoint import checkpoint_path
        from datasets import locations

        path = checkpoint_path(trial.config, None)
        if not locations.exists(path):
            return
        reason = (
            f"no entry in {self.folder} holds it or the attempts before it (another --out, or "
            "code that computed its trials otherwise?)"
        )
        say(refused_line(trial, f"attempt with checkpoint {path}", reason))
        self.earlier[trial.name] = [
            f"{trial.name} (an earlier attempt that left {path}, not in {self.folder})"
        ]
        say(rerun_line(trial))

    def _continuation(self, entry: dict | str, trial: Trial) -> Resumption | str:
        """``entry``'s attempt continued as ``trial``, or why it cannot be."""
        from cluster.runtime.checkpoint import checkpoint_path

        if isinstance(entry, str):
            return f"the entry is unusable: {entry}"
        if entry["status"] != "KILLED":
            return f"it is {entry['status']}: only a KILLED attempt continues"
        path = str(checkpoint_path(trial.config, None))
        if entry["checkpoint"] != path:
            return f"its checkpoint {entry['checkpoint']} is not the trial's, {path}"
        return continuation(entry["params"], None, float(entry["seconds"]), trial.config)

    def submitting(self, trial: Trial) -> None:
        """Write ``trial``'s entry SUBMITTED, before its task is submitted (it may run from
        then on), keeping the entry it replaces for ``record`` to put back should the trial
        never run. ``OSError`` naming the entry where it cannot be read or written: the trial
        is then not submitted."""
        path = self.path(self._record(trial))
        with _naming(path):
            self.replaced[trial.name] = path.read_bytes() if path.exists() else None
        self.submitted[trial.name] = self._write(self._record(trial), trial, "SUBMITTED")

    def record(self, record: TrialRecord, result: TrialResult, uri: str | None) -> None:
        """Write the entry of ``result``'s trial as ``record`` ended it (``uri``: unused, the
        MLflow runs are ``MlflowLedger``'s). One that never ran (stopped before its placement
        group was created) gets back the entry its SUBMITTED one replaced (none: removed), where
        the file still holds the SUBMITTED entry this process wrote (else another process wrote
        it since: left as it is); where that fails, the SUBMITTED entry stays, an earlier
        attempt to a rerun."""
        if result.started:
            self._write(record, result.trial, record.status)
            return
        path, replaced = self.path(record), self.replaced[record.name]
        with _naming(path):
            if path.read_bytes() != self.submitted[record.name]:
                return
            if replaced is None:
                path.unlink()
            else:
                _write_bytes(path, replaced)

    def earlier_attempts(self) -> list[str]:
        """The attempts of the trials that no trial's accountant holds."""
        return [line for lines in self.earlier.values() for line in lines]

    def _record(self, trial: Trial) -> TrialRecord:
        return self.records[trial.name]

    def _file(self, trial: Trial) -> str:
        return str(self.path(self._record(trial)))

    def _write(self, record: TrialRecord, trial: Trial, status: str) -> bytes:
        """Write the entry; its bytes."""
        from cluster.runtime.checkpoint import checkpoint_path

        ended = status in ENDED
        run_id = record.run_id if ended else None  # a tracked attempt's, once it ended
        unknown = trial.config.tracking.enabled and run_id is None
        entry = {
            "version": VERSION, "sweep": self.sweep, "name": record.name,
            "digest": record.digest, "params": attempt_params(trial.config), "status": status,
            "checkpoint": "" if unknown else str(checkpoint_path(trial.config, run_id)),
            "seconds": record.seconds if ended else trial.seconds_before,
            "metric": record.metric if ended else None,
            "test_accuracy": record.test_accuracy if ended else None,
            "epsilon": record.epsilon if ended else "", "error": record.error if ended else "",
            "privacy": record.privacy if ended else None,
            "earlier": self.earlier.get(record.name, []),
        }  # fmt: skip
        path, content = self.path(record), json.dumps(entry, indent=1).encode()
        with _naming(path):
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_bytes(path, content)
        return content


def _write_bytes(path: Path, content: bytes) -> None:
    from datasets.locations import write_atomic

    write_atomic(path, lambda file: file.write(content))


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An ``OSError`` inside raised again naming the entry ``path`` (whichever file the OS
    error names: ``write_atomic`` writes a temporary sibling), of its class and errno:
    ``[Errno 28] ledger entry <path>: No space left on device``."""
    try:
        yield
    except OSError as error:
        if error.errno is None:
            raise OSError(f"ledger entry {path}: {error}") from error
        what = error.strerror or os.strerror(error.errno)  # str(error) would repeat the errno
        raise OSError(error.errno, f"ledger entry {path}: {what}") from error
