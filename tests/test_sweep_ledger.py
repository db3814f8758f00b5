"""A sweep with tracking off resumes from its local ledger (``cluster.analysis.sweep_ledger``):
a finished trial is skipped with its recorded result, a KILLED one with its own matching
checkpoint continues (its seconds adding up), anything else reruns from round 0 and stays an
earlier attempt (no ε); (slow) a real sweep stopped and rerun ends as an uninterrupted one."""

import csv
import errno
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cluster.analysis.sweep import statement
from cluster.analysis.sweep_ledger import FOLDER, Ledger
from cluster.analysis.sweep_plan import plan
from cluster.analysis.trials import Trial, TrialResult, calibrate
from cluster.cli.main import main
from cluster.runtime.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from tests.helpers import run_local
from tests.test_sweep import _base, _local, _write, on_fake_ray, stop_sweep


def _untracked(store_root, tmp_path, **changes) -> dict:
    return _base(store_root, tmp_path) | {"tracking": {"enabled": False}} | changes


def _planned(spec):
    """The sweep as a rerun plans it: its records, and its trials as they run (calibrated)."""
    planned = plan(spec, [])
    trials = [Trial(r.name, calibrate(planned.configs[r.name], lambda line: None))
              for r in planned.records]  # fmt: skip
    return planned, trials


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_a_rerun_resumes_only_a_killed_trial_with_its_own_checkpoint_from_the_ledger(
    tmp_path, store_root
):
    """A FINISHED entry: skipped, with its recorded result. A KILLED one whose params, checkpoint
    and config are the trial's: continued, its seconds counted before. Unreadable, another
    trial's, SUBMITTED (the sweep died after submitting it), KILLED with other params, or naming
    a checkpoint that is not the trial's (never opened): each reruns from round 0 with a line
    saying why, and stays an earlier attempt, carried in the trial's next entries (no ε). A
    trial submitted again that never ran gets the entry it had back."""
    lrs = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    base = _untracked(store_root, tmp_path)
    spec = _write(tmp_path, "lg", {"base": base, "space": {"algorithm.local.lr": lrs}})
    planned, trials = _planned(spec)
    folder = tmp_path / "out" / FOLDER
    ledger = Ledger(folder, planned.spec.name, False)
    ledger.find_finished(planned.records)
    assert ledger.entries == {} and ledger.earlier_attempts() == []
    records = dict(zip(("finished", "resumed", "unreadable", "other_trial", "submitted",
                        "other_params", "elsewhere"), planned.records, strict=True))  # fmt: skip
    by_role = dict(zip(records, trials, strict=True))
    config = by_role["resumed"].config
    state = run_local(_local(replace(config, rounds=1))).state_dict()  # a round of the trial
    privacy = {"label": "f", "unit": "client", "dp_valid": True, "delta": 1e-5, "epsilon": 1.0}
    for role, trial in by_role.items():
        record = records[role]
        ledger.submitting(trial)
        if role == "submitted":
            continue  # the sweep died: it may have run
        record.status, record.seconds = "KILLED", 12.5
        if role == "finished":
            record.status, record.metric, record.test_accuracy = "FINISHED", 0.75, 0.7
            record.epsilon, record.privacy = "ε = 1", privacy
        else:
            path = checkpoint_path(trial.config, None)
            save_checkpoint(path, state, trial.config.to_dict(), None)
        ledger.record(record, TrialResult(trial), None)
    entry = {role: ledger.path(record) for role, record in records.items()}
    assert {p.parent for p in entry.values()} == {folder}
    entry["unreadable"].write_text('{"version": 1, "sweep"')
    shutil.copyfile(entry["resumed"], entry["other_trial"])
    params = json.loads(entry["other_params"].read_text())["params"]
    _edit(entry["other_params"], params=params | {"algorithm.clip_norm": "0.7"})
    foreign = tmp_path / "elsewhere.pt"  # a valid checkpoint of the trial, at another path
    shutil.copyfile(checkpoint_path(by_role["elsewhere"].config, None), foreign)
    _edit(entry["elsewhere"], checkpoint=str(foreign))

    planned, trials = _planned(spec)  # the rerun
    records = dict(zip(records, planned.records, strict=True))
    ledger = Ledger(folder, planned.spec.name, False)
    ledger.find_finished(planned.records)
    done = records["finished"]
    assert (done.status, done.resumed, done.metric, done.test_accuracy) == (
        "FINISHED",
        True,
        0.75,
        0.7,
    )
    assert (done.epsilon, done.seconds, done.privacy) == ("ε = 1", 12.5, privacy)
    assert [r.status for r in planned.records[1:]] == ["NOT RUN"] * 6
    said = []
    after = ledger.resume_killed(trials[1:], said.append)
    resumed_path = checkpoint_path(config, None)
    assert [t.resume for t in after] == [resumed_path, None, None, None, None, None]
    assert [t.seconds_before for t in after] == [12.5, 0, 0, 0, 0, 0]
    assert (
        f"{records['resumed'].name}: resuming its KILLED attempt (ledger entry "
        f"{entry['resumed']}) after round 1 from {resumed_path} (12 s before)" in said
    )
    why = {
        "unreadable": "the entry is unusable: unreadable: ",
        "other_trial": f"unusable: its name is '{records['resumed'].name}', this trial's",
        "submitted": "it is SUBMITTED: only a KILLED attempt continues",
        "other_params": "its param algorithm.clip_norm is '0.7', the trial's is '0.5'",
        "elsewhere": f"its checkpoint {foreign} is not the trial's, ",
    }
    for role, reason in why.items():
        name = records[role].name
        refused = [line for line in said if line.startswith(f"{name}: its ")]
        assert len(refused) == 1 and f"(ledger entry {entry[role]}) is not resumed (" in refused[0]
        assert reason in refused[0] and "no ε for the sweep" in refused[0], refused
        assert f"{name}: runs again from round 0" in said
    assert len(said) == 1 + 2 * len(why)
    earlier = ledger.earlier_attempts()
    assert len(earlier) == len(why)
    assert [any(records[role].name in line for line in earlier) for role in why] == [True] * 5
    for record in planned.records[1:]:
        record.status = "NOT RUN"
    tuning = statement(planned, planned.records, earlier)
    assert tuning.epsilon is None and "an earlier attempt" in tuning.reason

    before = entry["resumed"].read_text()
    ledger.submitting(after[0])  # it may run from now on
    assert json.loads(entry["resumed"].read_text())["status"] == "SUBMITTED"
    records["resumed"].status = "KILLED"  # stopped again, before it was placed: never ran
    ledger.record(records["resumed"], TrialResult(after[0], started=False), None)
    assert entry["resumed"].read_text() == before  # its checkpoint's entry is back
    rerun = next(t for t in after if t.name == records["submitted"].name)  # it finishes now
    ledger.submitting(rerun)
    records["submitted"].status = "FINISHED"
    ledger.record(records["submitted"], TrialResult(rerun), None)
    assert json.loads(entry["submitted"].read_text())["earlier"] == [
        line for line in earlier if records["submitted"].name in line
    ]
    third = Ledger(folder, planned.spec.name, False)
    third.find_finished(plan(spec, []).records)
    assert records["submitted"].name in " ".join(third.earlier_attempts())  # never forgotten


def _untracked_spec(tmp_path, store_root, name: str, lrs: list[float]) -> Path:
    return _write(tmp_path, name, {"base": _untracked(store_root, tmp_path),
                                   "space": {"algorithm.local.lr": lrs}})  # fmt: skip


def _read_ledger(folder: Path, planned) -> Ledger:
    """The untracked ledger in ``folder`` as a run of ``planned`` reads it."""
    ledger = Ledger(folder, planned.spec.name, False)
    ledger.find_finished(planned.records)
    return ledger


def _one_trial(spec, overrides=()):
    """The spec's one record and its trial, as a run with ``overrides`` plans them."""
    planned = plan(spec, list(overrides))
    (record,) = planned.records
    config = calibrate(planned.configs[record.name], lambda line: None)
    return planned, record, Trial(record.name, config)


def test_a_trial_whose_own_checkpoint_no_entry_holds_is_an_earlier_attempt(tmp_path, store_root):
    """An attempt that a ledger under another ``--out`` holds (KILLED, its checkpoint written):
    a rerun under this one finds no entry but the trial's own checkpoint, so it does not continue
    it (the attempts before it are unknown), runs the trial from round 0 and states no ε."""
    spec = _untracked_spec(tmp_path, store_root, "gap", [0.1])
    planned, record, trial = _one_trial(spec)
    first = _read_ledger(tmp_path / "out1" / FOLDER, planned)
    first.submitting(trial)
    state = run_local(_local(replace(trial.config, rounds=1))).state_dict()
    path = checkpoint_path(trial.config, None)
    save_checkpoint(path, state, trial.config.to_dict(), None)
    record.status = "KILLED"
    first.record(record, TrialResult(trial), None)

    planned, record, trial = _one_trial(spec)  # the rerun, under --out out2
    second = _read_ledger(tmp_path / "out2" / FOLDER, planned)
    said = []
    (after,) = second.resume_killed([trial], said.append)
    assert after.resume is None
    assert said == [
        f"{trial.name}: its attempt with checkpoint {path} is not resumed (no entry in "
        f"{second.folder} holds it or the attempts before it (another --out, or code that "
        "computed its trials otherwise?)); it stays an earlier attempt, its rounds in no "
        "trial's accountant (no ε for the sweep)",
        f"{trial.name}: runs again from round 0",
    ]
    assert second.earlier_attempts() == [
        f"{trial.name} (an earlier attempt that left {path}, not in {second.folder})"
    ]
    second.submitting(after)  # its new entry carries it
    assert json.loads(second.path(record).read_text())["earlier"] == second.earlier_attempts()
    tuning = statement(planned, planned.records, second.earlier_attempts())
    assert tuning.epsilon is None and "an earlier attempt that left" in tuning.reason


def test_a_rerun_that_switches_tracking_exits_2_naming_how_it_ran(
    tmp_path, store_root, monkeypatch, capsys
):
    """A tracked attempt (``MlflowLedger`` writes the local ledger too) and an untracked one:
    a rerun with tracking switched would not see the other's attempts (MLflow runs, or the
    ledger), so it refuses before any trial or MLflow run starts, naming the setting to use."""
    from cluster.analysis.sweep_runs import MlflowLedger

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec = _write(tmp_path, "sw", {"base": _base(store_root, tmp_path),
                                   "space": {"algorithm.local.lr": [0.1]}})  # fmt: skip
    untracked = ["tracking.enabled=false"]
    for ran, rerun in (([], untracked), (untracked, [])):
        out = tmp_path / f"out-{len(ran)}"
        planned, record, trial = _one_trial(spec, ran)
        local = Ledger(out / FOLDER, planned.spec.name, not ran)
        local.read(planned.records)  # as the sweep reads it before its parent run opens
        ledger = local if ran else MlflowLedger(planned, "a-parent-run", local)
        ledger.submitting(trial)
        record.status = "KILLED"
        ledger.record(record, TrialResult(trial), None)
        assert json.loads(local.path(record).read_text())["status"] == "KILLED"
        overrides = [arg for setting in rerun for arg in ("--set", setting)]
        assert main(["sweep", str(spec), "--out", str(out), *overrides]) == 2
        error = capsys.readouterr().err
        how = "false" if ran else "true"
        assert f"trial {record.name} ran with tracking.enabled: {how} (ledger entry " in error
        assert error.rstrip().endswith(f"rerun the sweep with tracking.enabled: {how}")
    assert not (tmp_path / "mlflow.db").exists()  # refused before any MLflow run opened


@pytest.mark.parametrize(
    "privacy, why",
    [
        ({"epsilon": 0.1}, "missing 4 required positional arguments"),
        (None, "its privacy is None"),
        ({"label": "f", "unit": "client", "dp_valid": True, "delta": 1e-5, "epsilon": 1.0,
          "sigma": 2.0}, "unknown keys ['sigma']"),
    ],
)  # fmt: skip
def test_a_finished_entry_whose_privacy_does_not_parse_is_an_earlier_attempt(
    tmp_path, store_root, privacy, why
):
    """Its privacy makes the sweep's statement: a FINISHED entry without one that parses
    (``TrialPrivacy.from_dict``) is unusable, so the trial runs again from round 0 with a line
    naming the field and its value, and the entry stays an earlier attempt (no ε)."""
    spec = _untracked_spec(tmp_path, store_root, "pv", [0.1])
    planned, record, trial = _one_trial(spec)
    ledger = _read_ledger(tmp_path / "out" / FOLDER, planned)
    ledger.submitting(trial)
    record.status, record.metric, record.test_accuracy, record.epsilon = "FINISHED", 0.5, 0.5, "ε 1"
    record.privacy = privacy
    ledger.record(record, TrialResult(trial), None)

    planned, record, trial = _one_trial(spec)  # the rerun
    ledger = _read_ledger(tmp_path / "out" / FOLDER, planned)
    assert (record.status, record.resumed, record.privacy) == ("NOT RUN", False, None)
    said = []
    (after,) = ledger.resume_killed([trial], said.append)
    assert after.resume is None and said[-1] == f"{trial.name}: runs again from round 0"
    assert f"the entry is unusable: its privacy is {privacy!r} (" in said[0] and why in said[0]
    (earlier,) = ledger.earlier_attempts()
    assert f"{trial.name} (an unusable ledger entry, " in earlier
    assert statement(planned, planned.records, [earlier]).epsilon is None


def test_a_failure_to_record_a_trial_stops_no_other_one(tmp_path, store_root, monkeypatch, capsys):
    """``on_done`` runs as each trial ends, also while a stop signal ends the others: a trial
    whose ledger entry cannot be written is said and the next trial's end is still recorded
    (an exception there would leave the stop path, and the other trials would be killed before
    their stop checkpoint)."""
    import cluster.analysis.sweep as sweep

    spec = _untracked_spec(tmp_path, store_root, "rf", [0.1, 0.2])
    planned = plan(spec, [])
    ledger = _read_ledger(tmp_path / "out" / FOLDER, planned)
    broken, kept = planned.records
    ledger.path(broken).mkdir(parents=True)  # its entry cannot be written

    def stopped(trials, concurrent, parent_run_id, on_done, on_submit):  # Ctrl-C: both KILLED
        for trial in trials:
            if trial.name == kept.name:
                on_submit(trial)
            on_done(TrialResult(trial), None)

    monkeypatch.setattr(sweep, "run_concurrently", stopped)
    sweep._run_records(planned, ledger, None, 0, planned.records, "trial")
    printed = capsys.readouterr().out
    assert (
        f"sweep rf: {broken.name}: recording it KILLED failed (IsADirectoryError: [Errno 21] "
        f"ledger entry {ledger.path(broken)}: Is a directory); a rerun finds its attempt as the "
        "ledger last held it"
    ) in printed
    assert json.loads(ledger.path(kept).read_text())["status"] == "KILLED"
    assert [r.status for r in planned.records] == ["KILLED", "KILLED"]


@pytest.mark.timeout(120)
def test_a_failure_to_record_a_trials_start_ends_the_sweep_resumably(
    tmp_path, store_root, monkeypatch, capsys
):
    """A trial's start must be in the ledger before its task is submitted (its rounds count in
    the sweep's ε): where its entry cannot be written, neither it nor any trial after it is
    submitted, the running one ends recorded, and the sweep exits 1 naming the entry and the OS
    error. Once the entry can be written, the same command resumes."""
    import cluster.analysis.sweep as sweep

    spec = _untracked_spec(tmp_path, store_root, "rs", [0.1, 0.2, 0.3])
    planned = plan(spec, [])
    out = tmp_path / "out"
    ledger = Ledger(out / FOLDER, planned.spec.name, False)
    running, broken, waiting = planned.records
    ledger.path(broken).mkdir(parents=True)  # its entry cannot be written
    monkeypatch.setattr(sweep, "run_concurrently", on_fake_ray(placed=[0], ends=[0]))
    assert main(["sweep", str(spec), "--out", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"sweep rs: {broken.name}: recording its start failed (IsADirectoryError: [Errno 21] "
        f"ledger entry {ledger.path(broken)}: Is a directory): not started; no trial started "
        "after that (2 not started), the others running then ran to their end; fix the cause "
        f"(the trials' ledger is {out / FOLDER}) and rerun the same command to resume\n"
    )
    assert json.loads(ledger.path(running).read_text())["status"] == "KILLED"
    assert not ledger.path(waiting).exists()  # never submitted

    ledger.path(broken).rmdir()
    monkeypatch.setattr(sweep, "run_concurrently", on_fake_ray(placed=[0, 1, 2], ends=[0, 1, 2]))
    assert main(["sweep", str(spec), "--out", str(out)]) == 1  # resumed: every trial KILLED
    assert "3 trial run(s), 0 finished before (resumed), 3 to run" in capsys.readouterr().out
    statuses = [json.loads(ledger.path(r).read_text())["status"] for r in planned.records]
    assert statuses == ["KILLED"] * 3


def _on_a_disk(monkeypatch) -> list:
    """``write_atomic`` (the ledger's writes) failing with ENOSPC, naming its temporary file as
    the OS does, while the list returned is not empty."""
    from datasets import locations

    full, write_atomic = [], locations.write_atomic

    def write(location, content) -> None:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device", f"{location}.tmp")
        write_atomic(location, content)

    monkeypatch.setattr(locations, "write_atomic", write)
    return full


@pytest.mark.timeout(120)
def test_a_trial_that_may_have_run_is_an_earlier_attempt_even_after_the_disk_filled(
    tmp_path, store_root, monkeypatch, capsys
):
    """The disk fills as the first trial's task is submitted: its end cannot be written, and it
    left no checkpoint. Its SUBMITTED entry, written before its task was, makes it an earlier
    attempt to the rerun, which states no ε. The second trial's start cannot be written: it is
    never submitted, and the sweep exits 1 (a rerun runs it: it never ran)."""
    import cluster.analysis.sweep as sweep

    spec = _untracked_spec(tmp_path, store_root, "fd", [0.1, 0.2])
    planned = plan(spec, [])
    out = tmp_path / "out"
    first, second = planned.records
    launched, full = [], _on_a_disk(monkeypatch)

    def disk_fills(trial) -> None:
        launched.append(trial.name)
        full.append(True)

    monkeypatch.setattr(
        sweep, "run_concurrently", on_fake_ray(placed=[0], ends=[0], on_launch=disk_fills)
    )
    assert main(["sweep", str(spec), "--out", str(out)]) == 1
    printed = capsys.readouterr()
    assert launched == [first.name]
    ledger = Ledger(out / FOLDER, planned.spec.name, False)
    no_space = "(OSError: [Errno 28] ledger entry {}: No space left on device)"
    assert f"{first.name}: recording it KILLED failed {no_space.format(ledger.path(first))}" in (
        printed.out
    )
    assert printed.err.startswith(
        f"sweep fd: {second.name}: recording its start failed "
        f"{no_space.format(ledger.path(second))}: not started; "
    )

    full.clear()
    planned, trials = _planned(spec)  # the rerun
    rerun = _read_ledger(out / FOLDER, planned)
    said = []
    rerun.resume_killed(trials, said.append)
    assert rerun.earlier_attempts() == [
        f"{first.name} SUBMITTED (an earlier attempt, {ledger.path(first)})"
    ]
    assert f"{second.name}: runs again from round 0" not in said  # nothing of it ran
    assert statement(planned, planned.records, rerun.earlier_attempts()).epsilon is None


def test_a_trial_that_never_ran_leaves_the_ledger_as_it_was(tmp_path, store_root, monkeypatch):
    """A trial submitted and then stopped before its placement group was created never ran:
    the entry its SUBMITTED one replaced comes back (an earlier attempt's KILLED one), or none
    where there was none. Where that cannot be written, the SUBMITTED entry stays (the error
    raised names it, of the class and errno the OS gave), and the rerun counts an attempt that
    never ran: the safe side."""
    spec = _untracked_spec(tmp_path, store_root, "nr", [0.1])
    planned, record, trial = _one_trial(spec)
    ledger = _read_ledger(tmp_path / "out" / FOLDER, planned)
    path = ledger.path(record)
    ledger.submitting(trial)
    record.status = "KILLED"
    ledger.record(record, TrialResult(trial, started=False), None)
    assert not path.exists()

    path.mkdir(parents=True)
    with pytest.raises(IsADirectoryError) as raised:
        ledger.submitting(trial)
    assert str(raised.value) == f"[Errno 21] ledger entry {path}: Is a directory"
    path.rmdir()

    ledger.submitting(trial)  # an attempt that ran, KILLED
    ledger.record(record, TrialResult(trial), None)
    killed = path.read_text()
    ledger.submitting(trial)  # the next one never runs
    ledger.record(record, TrialResult(trial, started=False), None)
    assert path.read_text() == killed

    ledger.submitting(trial)
    _on_a_disk(monkeypatch).append(True)
    with pytest.raises(OSError) as raised:
        ledger.record(record, TrialResult(trial, started=False), None)
    assert raised.value.errno == errno.ENOSPC
    assert str(raised.value) == f"[Errno 28] ledger entry {path}: No space left on device"
    assert json.loads(path.read_text())["status"] == "SUBMITTED"
    planned, record, trial = _one_trial(spec)  # the rerun
    rerun = _read_ledger(tmp_path / "out" / FOLDER, planned)
    rerun.resume_killed([trial], lambda line: None)
    assert rerun.earlier_attempts() == [f"{trial.name} SUBMITTED (an earlier attempt, {path})"]


def test_a_trial_that_never_ran_leaves_another_sweeps_entry_alone(tmp_path, store_root):
    """Sweep A submits T, then a rerun B (on the same --out) writes T's SUBMITTED entry and
    runs T; A's T, stopped before its group was created, never ran: A puts nothing back over
    B's entry (only its own SUBMITTED bytes are replaced)."""
    spec = _untracked_spec(tmp_path, store_root, "cs", [0.1])
    planned, record, trial = _one_trial(spec)
    first = _read_ledger(tmp_path / "out" / FOLDER, planned)
    first.submitting(trial)
    planned, record_b, trial_b = _one_trial(spec)
    second = _read_ledger(tmp_path / "out" / FOLDER, planned)
    second.resume_killed([trial_b], lambda line: None)  # A's SUBMITTED T: an earlier attempt
    second.submitting(trial_b)
    written = first.path(record).read_bytes()
    record.status = "NOT RUN"
    first.record(record, TrialResult(trial, started=False), None)
    assert first.path(record).read_bytes() == written


def test_a_second_sweep_on_the_same_out_exits_2_naming_the_ledger_and_its_holder(
    tmp_path, store_root, monkeypatch, capsys
):
    """The ledger is held (an exclusive flock) for a sweep's lifetime: a second sweep on the
    same --out, while the first runs or ends its trials, exits 2 at once, naming the folder and
    the process holding it, and runs no trial; once the holder lets go, it runs."""
    import cluster.analysis.sweep as sweep_module

    spec = _untracked_spec(tmp_path, store_root, "lk", [0.1])
    planned = plan(spec, [])
    folder = tmp_path / "out" / FOLDER
    held = Ledger(folder, planned.spec.name, False).hold()

    def no_trial_runs(*args, **kwargs):
        raise AssertionError("a trial ran while another sweep held the ledger")

    monkeypatch.setattr(sweep_module, "run_concurrently", no_trial_runs)
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"sweep: the ledger {folder} is in use by process {os.getpid()} (a sweep on the same "
        "--out, running or ending its trials); wait for it to end, or give another --out\n"
    )
    held.close()
    with pytest.raises(AssertionError, match="a trial ran"):
        main(["sweep", str(spec), "--out", str(tmp_path / "out")])


def test_an_os_error_without_its_message_names_its_errno_once(tmp_path):
    """An ``OSError`` with an errno and no message (``OSError(28, None)``) is named by the OS's
    message for that errno, the errno said once."""
    from cluster.analysis.sweep_ledger import _naming

    path = tmp_path / "entry.json"
    with pytest.raises(OSError) as raised, _naming(path):
        raise OSError(errno.ENOSPC, None)
    assert str(raised.value) == f"[Errno 28] ledger entry {path}: No space left on device"


def test_a_cross_validated_rerun_refuses_a_tracking_switch_before_any_trial(
    tmp_path, store_root, monkeypatch, capsys
):
    """The retraining after cross-validation is a trial of its own, picked once the folds
    have run: its ledger entry is read with the folds' at the start, so a rerun whose
    retraining of any configuration ran tracked otherwise exits 2 before any trial runs (the
    folds' entries may well be absent: a ``--set`` of ``data.validation`` makes other folds,
    while the retraining, without validation, is the same trial)."""
    import cluster.analysis.sweep as sweep

    base = _base(store_root, tmp_path)
    base["data"]["validation"] = {"folds": 2, "fold": 0}
    space = {"algorithm.local.lr": [0.1, 0.2], "data.validation.fold": [0, 1]}
    spec = _write(tmp_path, "cv", {"base": base, "space": space})
    planned = plan(spec, [])
    final = list(planned.finals.values())[1]  # it ran tracked; no fold has an entry
    out = tmp_path / "out"
    ledger = Ledger(out / FOLDER, planned.spec.name, True)
    ledger.read([final])
    ledger.submitting(Trial(final.name, planned.configs[final.name]))
    ran = []
    monkeypatch.setattr(sweep, "run_concurrently", lambda trials, *args: ran.append(trials))
    untracked = ["--set", "tracking.enabled=false"]
    assert main(["sweep", str(spec), "--out", str(out), *untracked]) == 2
    error = capsys.readouterr().err
    assert error == (
        f"sweep: config error: tracking.enabled = False: trial {final.name} ran with "
        f"tracking.enabled: true (ledger entry {ledger.path(final)}); its attempts are in its "
        "MLflow runs, which this rerun would not resume from: rerun the sweep with "
        "tracking.enabled: true\n"
    )
    assert ran == []


# ------------------------------------------------------------------------- slow: on Ray

LEDGER_ROUNDS = 300  # both trials mid-run once each has written a checkpoint


def _trials(out: Path) -> dict[str, dict]:
    with open(out / "sweep.csv") as f:
        return {r["trial"]: r for r in csv.DictReader(f) if r["trial"]}


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_an_untracked_sweep_stopped_and_rerun_ends_as_an_uninterrupted_one(tmp_path, store_root):
    """Tracking off, SIGINT mid-run: both trials stop, their ledger entries KILLED beside their
    checkpoints. Rerun, both continue from their checkpoints, their seconds adding up, and the
    sweep ends with an uninterrupted sweep's selection, per-trial results and ε."""
    base = _untracked(store_root, tmp_path, rounds=LEDGER_ROUNDS)
    base["checkpoint"] = {"dir": str(tmp_path / "ck"), "every": 1}  # polled: a round is done
    base["data"]["validation"] = {"clients": 0.2}  # public validation: the sweep has an ε
    space = {"algorithm.local.lr": [0.05, 0.2]}
    spec = _write(tmp_path, "local", {"base": base, "space": space})
    whole = tmp_path / "whole"
    assert main(["sweep", str(spec), "--out", str(whole)]) == 0  # uninterrupted
    shutil.rmtree(tmp_path / "ck")

    planned = plan(spec, [])
    checkpoints = {r.name: checkpoint_path(planned.configs[r.name], None) for r in planned.records}
    out = tmp_path / "o"
    command = [sys.executable, "-m", "cluster", "sweep", str(spec), "--out", str(out)]

    def both_started() -> bool:
        return all(path.exists() for path in checkpoints.values())

    printed = stop_sweep(command, dict(os.environ), both_started, every_s=0.5)
    entries = {r.name: out / FOLDER / f"{r.digest}.json" for r in planned.records}
    killed = {name: json.loads(path.read_text()) for name, path in entries.items()}
    assert {e["status"] for e in killed.values()} == {"KILLED"}, printed
    done = {n: load_checkpoint(p)["simulation"]["rounds_done"] for n, p in checkpoints.items()}
    assert all(0 < rounds < LEDGER_ROUNDS for rounds in done.values()), done

    rerun = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    printed = rerun.stdout.decode()
    assert rerun.returncode == 0, printed
    assert "2 trial run(s), 0 finished before (resumed), 2 to run" in printed
    for name, rounds in done.items():
        assert (
            f"{name}: resuming its KILLED attempt (ledger entry {entries[name]}) after round "
            f"{rounds} from {checkpoints[name]} ({killed[name]['seconds']:.0f} s before)"
        ) in printed, printed
    assert "tuning privacy: ε = " in printed, printed
    assert (out / "tuning_privacy.json").read_text() == (whole / "tuning_privacy.json").read_text()
    assert (out / "selected.yaml").read_text() == (whole / "selected.yaml").read_text()
    results = ["status", "validation_accuracy", "test_accuracy", "epsilon", "error"]
    resumed, uninterrupted = _trials(out), _trials(whole)
    for name, row in resumed.items():
        assert {k: row[k] for k in results} == {k: uninterrupted[name][k] for k in results}
        assert float(row["seconds"]) > killed[name]["seconds"]  # its killed part and the rest
        assert json.loads(entries[name].read_text())["seconds"] == pytest.approx(
            float(row["seconds"]), abs=0.01
        )
    for name, path in checkpoints.items():
        alone = run_local(_local(calibrate(planned.configs[name], lambda line: None)))
        assert torch.equal(load_checkpoint(path)["simulation"]["params"], alone.state.params)
    assert main(["sweep", str(spec), "--out", str(out)]) == 0  # all finished: nothing to run


def test_a_killed_attempt_with_its_store_elsewhere_is_the_same_trial(tmp_path, store_root):
    """A rerun with the store moved (another data.store_root: the same rows) keeps the trials'
    identities, so their KILLED attempts are continued, not refused over the path (review K2);
    a pretrained folder under another data.root is another trial."""
    from cluster.analysis.sweep_resume import attempt_params, continuation

    spec = {"base": _base(store_root, tmp_path), "space": {"algorithm.local.lr": [0.1]}}
    planned = plan(_write(tmp_path, "moved", spec), [])
    config = planned.configs[planned.records[0].name]
    recorded = {**attempt_params(config), "data.store_root": "/elsewhere/shards"}
    why = continuation(recorded, None, 1.0, config)
    assert isinstance(why, str) and why.startswith("no checkpoint at"), why
    other = {**attempt_params(config), "data.num_clients": "7"}
    assert continuation(other, None, 1.0, config).startswith("its param data.num_clients")
