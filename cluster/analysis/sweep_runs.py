"""A sweep's MLflow runs: its parent run, the tags and ``trial_privacy.json`` a finished trial
is recorded with, and what a resumed sweep finds by them (its finished trials, the unfinished
ones of earlier attempts)."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.analysis.sweep_plan import Planned
from cluster.analysis.sweep_report import TrialRecord
from cluster.analysis.sweep_resume import SECONDS, resume_killed

RECORDED = "sweep_recorded"
SEARCH_PAGE = 1000


def find_finished(planned: Planned, records: list[TrialRecord]) -> None:
    """Mark the ``records`` whose runs finished and were recorded (a resumed sweep)."""
    from mlflow.tracking import MlflowClient

    uri, experiment = planned.tracking
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return
    query = f"tags.sweep = '{planned.spec.name}' and tags.{RECORDED} = 'true'"
    query += " and attributes.status = 'FINISHED'"
    by_digest: dict = {}
    token = None
    while True:  # every page: a sweep may hold more trials than one page (MLflow: 1,000)
        page = client.search_runs(
            [found.experiment_id], query, max_results=SEARCH_PAGE, page_token=token
        )
        for run in page:  # newest first: the newest finished run of a trial is its result
            by_digest.setdefault(run.data.tags.get("sweep_trial"), run)
        token = page.token
        if not token:
            break
    metric = planned.spec.select.metric
    for record in records:
        run = by_digest.get(record.digest)
        if run is None:
            continue
        tags, metrics = run.data.tags, run.data.metrics
        record.status, record.run_id, record.resumed = "FINISHED", run.info.run_id, True
        record.metric, record.test_accuracy = metrics.get(metric), metrics.get("test_accuracy")
        record.epsilon, record.seconds = tags.get("sweep_epsilon", ""), float(tags[SECONDS])
        record.privacy = _read_json(client, run.info.run_id, "trial_privacy.json")


def _read_json(client, run_id: str, artifact: str) -> dict:
    import os
    import tempfile

    # MLflow draws a progress bar per download, even off a terminal: one per finished trial
    # on a resumed sweep's screen. The user's own setting stands.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        return json.loads(Path(client.download_artifacts(run_id, artifact, tmp)).read_text())


def parent_run(planned: Planned, uri: str, experiment: str):
    """The sweep's parent run: the last one of this sweep (``Planned.digest``: its spec and
    every trial's identity, so ``--set`` values that change results make another sweep) if it
    ran before (resumed), else a new one."""
    from mlflow.tracking import MlflowClient

    from cluster.tracking.process import TrackingRun

    spec = planned.spec
    found = MlflowClient(uri).get_experiment_by_name(experiment)
    if found is not None:
        query = f"tags.sweep_parent = '{spec.name}' and tags.sweep_digest = '{planned.digest()}'"
        runs = MlflowClient(uri).search_runs([found.experiment_id], query, max_results=1)
        if runs:
            return TrackingRun.resume(uri, runs[0].info.run_id)
    params = {"space": json.dumps(spec.space), "seeds": str(list(spec.seeds))}
    params |= {"search": spec.method, "select": f"{spec.select.mode} {spec.select.metric}"}
    tags = {"sweep_parent": spec.name, "sweep_digest": planned.digest()}
    return TrackingRun.open(uri, experiment, f"sweep-{spec.name}", params, tags)


def record_trial(record: TrialRecord, uri: str | None, spec_name: str) -> None:
    """Tag a trial's run (through ``uri``, the sweep's one writer) with its seconds so far (a
    KILLED run's: a resumed trial adds them up); a finished one's also with what a resumed
    sweep finds it by, and log its ``trial_privacy.json``."""
    if uri is None or record.run_id is None or record.status not in ("FINISHED", "KILLED"):
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.set_tag(record.run_id, SECONDS, f"{record.seconds:.3f}")
    if record.status == "KILLED":
        return
    client.log_dict(record.run_id, record.privacy, "trial_privacy.json")
    tags = {"sweep": spec_name, "sweep_trial": record.digest, "sweep_epsilon": record.epsilon}
    for key, value in (tags | {RECORDED: "true"}).items():
        client.set_tag(record.run_id, key, value)


def child_runs(planned: Planned, parent_run_id: str) -> list:
    """The parent run's child runs, every status."""
    from mlflow.tracking import MlflowClient

    uri, experiment = planned.tracking
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    query = f"tags.mlflow.parentRunId = '{parent_run_id}'"
    return client.search_runs([found.experiment_id], query, max_results=50_000)


def earlier_attempts(planned: Planned, parent_run_id: str) -> list[str]:
    """The parent run's children that no record holds: trials of an earlier attempt at the
    sweep (resumed) that did not finish, or were not recorded, and were run again from round 0
    (a KILLED run continued from its checkpoint is its trial's run: ``sweep_resume``). They
    trained on the private data too, and their rounds are in no trial's privacy."""
    held = {r.run_id for r in planned.all_records() if r.run_id}
    return [
        f"{run.info.run_name} {run.info.status} (an earlier attempt, run {run.info.run_id})"
        for run in child_runs(planned, parent_run_id)
        if run.info.run_id not in held
    ]


def unmatched_entries(planned: Planned, parent_run_id: str, local) -> list[str]:
    """The attempts that ``local`` (the sweep's ``sweep_ledger.Ledger``) held as this run of
    the sweep found it, of which the MLflow store holds no run under the parent: an entry
    whose run (the stem of its checkpoint, named by the run) is no child of the parent nor its
    record's run (found finished), or whose run is not known (SUBMITTED: the sweep did not see
    it end; a trial that failed, or was cancelled by force, without reporting its run). Such an
    attempt ran against another store (a relative ``MLFLOW_TRACKING_URI`` from another
    directory), under a parent run since replaced, or its run was deleted: its rounds are in no
    accountant this run reads. (An unusable entry is ``local``'s earlier attempt.)"""
    children = {run.info.run_id for run in child_runs(planned, parent_run_id)}
    lines = []
    for record in planned.all_records():
        entry = local.entries.get(record.name)
        if not isinstance(entry, dict):
            continue
        run_id = Path(entry["checkpoint"]).stem if entry["checkpoint"] else None
        if run_id is not None and (run_id in children or run_id == record.run_id):
            continue
        lines.append(
            f"{record.name} {entry['status']} (an earlier attempt in {local.path(record)}, "
            f"{'its run unknown' if run_id is None else f'run {run_id}'}: not under the "
            f"parent run {parent_run_id})"
        )
    return lines


class MlflowLedger:
    """The trials of a sweep with tracking on: its parent run's child runs (the functions
    above, ``sweep_resume``), and ``local``, the sweep's own ledger (``sweep_ledger.Ledger``),
    which records them too (so that a rerun with tracking off refuses to resume). The same
    methods as ``sweep_ledger.Ledger``."""

    def __init__(self, planned: Planned, parent_run_id: str, local):
        self.planned, self.parent_run_id, self.local = planned, parent_run_id, local

    def find_finished(self, records: list[TrialRecord]) -> None:
        self.local.read(records)  # refuses an attempt with tracking off
        find_finished(self.planned, records)

    def resume_killed(self, trials: list, say) -> list:
        return resume_killed(trials, self.planned.tracking, self.parent_run_id, say)

    def submitting(self, trial) -> None:
        self.local.submitting(trial)

    def record(self, record: TrialRecord, result, uri: str | None) -> None:
        record_trial(record, uri, self.planned.spec.name)
        self.local.record(record, result, uri)

    def earlier_attempts(self) -> list[str]:
        """The unheld child runs, the local ledger's attempts of which the parent holds no run
        (``unmatched_entries``), and what it holds as earlier attempts (those its entries
        carry, and its unusable entries: whether they were tracked is unknown)."""
        return [
            *earlier_attempts(self.planned, self.parent_run_id),
            *unmatched_entries(self.planned, self.parent_run_id, self.local),
            *self.local.earlier_attempts(),
        ]
