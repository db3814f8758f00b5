"""``python -m cluster sweep SPEC``: a search space over config fields × seeds, trials run
concurrently on Ray, one configuration selected by a validation metric.

The spec's format: ``cluster.analysis.sweep_spec``. The whole spec, and every trial's config, is
checked before any trial starts (exit 2 naming the field, the value and the trial). Trials run on
``cluster.analysis.trials``' engine (Ray tasks in placement groups, ``--concurrent`` at once at
most); each is a normal MLflow run (``sweep-<spec>-<values>-c<index>-<digest>-seed<k>``: the
configuration's index in the draw or grid and a digest of its exact values make it unique)
nested under the sweep's parent run, tagged ``sweep`` (the spec's name) and ``sweep_trial``
(its configuration's hash and seed, and ``-repeat<n>`` for a random search's n-th repeated
draw of one configuration: each draw is a trial of its own, ``sweep_spec``). Rerunning the
same command resumes: trials whose runs finished (and were recorded: tag ``sweep_recorded``)
are not run again, and the unfinished parent run is continued. A trial that fails is recorded
(status FAILED, its error in the table) and the others go on.

The parent run holds ``sweep.md`` (one row per configuration: mean ± std over its seeds of the
selection metric and of the test accuracy), ``sweep.csv`` (those rows, then one per trial),
``sweep_params.png`` (the selection metric against each swept field), ``selected.yaml`` (the
selected configuration at the first seed: ``python -m cluster run selected.yaml`` reruns it)
and ``tuning_privacy.json``, the sweep's privacy statement (``privacy.tuning``), printed too.
Each trial's run holds ``trial_privacy.json`` (its ``TrialPrivacy``), from which a resumed
sweep rebuilds the statement. A trial that started but did not finish (FAILED, KILLED) trained
on the private data for rounds no accountant recorded: the sweep then states no ε, naming it;
so does a resumed sweep for its earlier attempts' unfinished trials (the parent's child runs
that no trial holds, ``earlier_attempts``), rerun since.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cluster.analysis.compare import write_csv
from cluster.analysis.run_configs import assignments, build_config, merged, run_setup
from cluster.analysis.sweep_report import (
    TrialRecord,
    configurations,
    markdown,
    mean_std_cell,
    plot_parameters,
    summarize,
    trial_rows,
)
from cluster.analysis.sweep_spec import (
    SweepSpec,
    SweepTrial,
    Values,
    label,
    trial_digest,
    values_digest,
)
from cluster.analysis.trials import Trial, TrialResult, calibrate, run_concurrently
from cluster.config import ConfigError, ExperimentConfig

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the spec's stem: it names runs and tags
RECORDED = "sweep_recorded"


@dataclass
class Planned:
    """The checked sweep: its spec, each trial's record and config (not calibrated)."""

    spec: SweepSpec
    records: list[TrialRecord]
    configs: dict[str, ExperimentConfig] = field(default_factory=dict)  # by trial name
    overrides: list[str] = field(default_factory=list)  # --set
    final: TrialRecord | None = None  # cross-validation: the selection retrained on all rows
    tracking: tuple[str, str] | None = None  # (tracking URI, experiment) where runs are found

    def all_records(self) -> list[TrialRecord]:
        return self.records + ([self.final] if self.final is not None else [])


# ------------------------------------------------------------------------------ planning


def plan(path: Path, overrides: list[str]) -> Planned:
    """The spec and every trial's config, checked; a ``ConfigError`` names the trial."""
    from cluster.analysis.sweep_spec import load

    spec = load(path)
    if not NAME.match(spec.name):
        raise ConfigError("SPEC", str(path), "name the spec file with letters, digits, . _ -")
    planned = Planned(spec, [], overrides=list(overrides))
    drawn: dict[str, int] = {}  # a configuration and seed: how often drawn so far
    for trial in spec.trials():
        config = trial_config(spec, overrides, trial)
        name, once = trial.name(spec.name), trial_digest(config)
        repeat = drawn[once] = drawn.get(once, -1) + 1
        if name in planned.configs:  # SweepTrial.key makes names unique: a bug otherwise
            raise AssertionError(f"two trials named {name}")
        planned.configs[name] = config
        planned.records.append(
            TrialRecord(trial, name, trial_digest(config, repeat), repeat=repeat)
        )
    if planned.records:
        check_selection(spec, planned.configs[planned.records[0].name])
    return planned


def trial_config(
    spec: SweepSpec, overrides: list[str], trial: SweepTrial, changes: dict | None = None
) -> ExperimentConfig:
    """``trial``'s config (its values; or ``changes``, with its name and seed)."""
    name = trial.name(spec.name) if changes is None else final_name(spec, trial)
    extra = [f"seed={trial.seed}", f"tracking.run_name={json.dumps(name)}"]
    raw = merged(spec.base, overrides)
    if (raw.get("tracking") or {}).get("enabled", True) is False:  # an untracked checkpoint is
        directory = (raw.get("checkpoint") or {}).get("dir") or "checkpoints"  # named by seed
        extra.append(f"checkpoint.dir={json.dumps(f'{directory}/{name}')}")
    try:
        return build_config(spec.base, overrides, changes or dict(trial.values), extra)
    except ConfigError as error:
        raise ConfigError(
            error.field_path, error.value, f"{error.fix} (trial {trial.label()}, seed {trial.seed})"
        ) from None


def final_name(spec: SweepSpec, trial: SweepTrial) -> str:
    return f"sweep-{spec.name}-{trial.label()}-{values_digest(trial.values)}-final-seed{trial.seed}"


def selected_changes(spec: SweepSpec, values: Values) -> dict:
    """The selected configuration's overrides; after cross-validation, on all training rows."""
    return dict(values) | ({"data.validation": None} if spec.cross_validated else {})


def check_selection(spec: SweepSpec, config: ExperimentConfig) -> None:
    if not spec.select.on_test and config.data.validation is None:
        raise ConfigError(
            "select.metric",
            spec.select.metric,
            "the base config holds out no validation data: set data.validation (e.g. "
            "{fraction: 0.1}) or select on test_accuracy (a warning, the run tagged)",
        )


def validation_kind(spec: SweepSpec, config: ExperimentConfig) -> str:
    """What ``privacy.tuning.tuning_statement`` calls the selection's data."""
    if spec.select.on_test:
        return "none"
    return "public" if config.data.validation.kind == "clients" else "private"


# ------------------------------------------------------------------------------ MLflow


def find_finished(planned: Planned, records: list[TrialRecord]) -> None:
    """Mark the ``records`` whose runs finished and were recorded (a resumed sweep)."""
    from mlflow.tracking import MlflowClient

    uri, experiment = planned.tracking
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return
    query = f"tags.sweep = '{planned.spec.name}' and tags.{RECORDED} = 'true'"
    runs = client.search_runs([found.experiment_id], query + " and attributes.status = 'FINISHED'")
    by_digest = {run.data.tags.get("sweep_trial"): run for run in runs}
    metric = planned.spec.select.metric
    for record in records:
        run = by_digest.get(record.digest)
        if run is None:
            continue
        tags, metrics = run.data.tags, run.data.metrics
        record.status, record.run_id, record.resumed = "FINISHED", run.info.run_id, True
        record.metric, record.test_accuracy = metrics.get(metric), metrics.get("test_accuracy")
        record.epsilon, record.seconds = tags.get("sweep_epsilon", ""), float(tags["sweep_seconds"])
        record.privacy = _read_json(client, run.info.run_id, "trial_privacy.json")


def _read_json(client, run_id: str, artifact: str) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        return json.loads(Path(client.download_artifacts(run_id, artifact, tmp)).read_text())


def parent_run(planned: Planned, uri: str, experiment: str):
    """The sweep's parent run: the last one of this spec (its digest) if a sweep of it ran
    before (resumed), else a new one."""
    from mlflow.tracking import MlflowClient

    from cluster.tracking.process import TrackingRun

    spec = planned.spec
    found = MlflowClient(uri).get_experiment_by_name(experiment)
    if found is not None:
        query = f"tags.sweep_parent = '{spec.name}' and tags.sweep_digest = '{spec.digest()}'"
        runs = MlflowClient(uri).search_runs([found.experiment_id], query, max_results=1)
        if runs:
            return TrackingRun.resume(uri, runs[0].info.run_id)
    params = {"space": json.dumps(spec.space), "seeds": str(list(spec.seeds))}
    params |= {"search": spec.method, "select": f"{spec.select.mode} {spec.select.metric}"}
    tags = {"sweep_parent": spec.name, "sweep_digest": spec.digest()}
    return TrackingRun.open(uri, experiment, f"sweep-{spec.name}", params, tags)


def record_trial(record: TrialRecord, uri: str | None, spec_name: str) -> None:
    """Tag a finished trial's run and log its ``trial_privacy.json`` (through ``uri``, the
    sweep's one writer): what a resumed sweep finds it by."""
    if uri is None or record.run_id is None or record.status != "FINISHED":
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.log_dict(record.run_id, record.privacy, "trial_privacy.json")
    tags = {"sweep": spec_name, "sweep_trial": record.digest, "sweep_epsilon": record.epsilon}
    for key, value in (tags | {"sweep_seconds": f"{record.seconds:.3f}", RECORDED: "true"}).items():
        client.set_tag(record.run_id, key, value)


# ------------------------------------------------------------------------------ results


def final_metric(outcome, name: str) -> float | None:
    """``name``'s last evaluation in the run's history (None: never evaluated)."""
    for record in reversed(outcome.result.history):
        value = getattr(record, name, None) if name in ("test_accuracy", "test_loss") else None
        value = record.metrics.get(name) if value is None else value
        if value is not None:
            return float(value)
    return None


def fill(record: TrialRecord, result: TrialResult, metric: str, role: str) -> None:
    """``record`` from its run's ``result``; its privacy as ``role`` ("trial" or "final")."""
    from dataclasses import replace

    from privacy.tuning import trial_privacy

    record.status, record.error, record.seconds = result.status, result.error or "", result.seconds
    outcome = result.outcome
    if outcome is None:
        return
    record.run_id = outcome.run_id
    record.metric, record.test_accuracy = final_metric(outcome, metric), outcome.final_accuracy
    record.epsilon = outcome.claim.epsilon_text(outcome.epsilon, outcome.epsilon_vs_server)
    if record.status == "FINISHED":
        privacy = replace(trial_privacy(outcome), role=role)
        if record.repeat:  # another draw of Q (Papernot–Steinke): not one more seed of the first
            privacy = replace(privacy, configuration=f"{privacy.configuration}-{record.repeat}")
        record.privacy = privacy.to_dict()


def selected_yaml(planned: Planned, values: Values) -> str:
    """The selected configuration at the spec's first seed, as ``cluster run`` reads it."""
    spec = planned.spec
    changes = selected_changes(spec, values)
    run_base, run_overrides = run_setup(spec.base, planned.overrides, changes)
    raw = merged(run_base, [*run_overrides, *assignments(changes), f"seed={spec.seeds[0]}"])
    seeds = ", ".join(map(str, spec.seeds))
    head = (
        f"# sweep {spec.name}: selected by the mean {spec.select.metric} ({spec.select.mode}) over "
        f"seeds {seeds}{' and folds' * spec.cross_validated}: {label(values, exact=True)}\n"
        "# uv run python -m cluster run selected.yaml "
        "[--set seed=K]\n"
    )
    return head + yaml.safe_dump(raw, sort_keys=False)


def statement(planned: Planned, records: list[TrialRecord], earlier: list[str] = ()):
    """The sweep's ``TuningStatement``; none (no ε) where a trial started without finishing,
    among ``records`` or ``earlier`` (``earlier_attempts``)."""
    from privacy.tuning import TrialPrivacy, TuningStatement, tuning_statement

    spec, first = planned.spec, planned.configs[planned.records[0].name]
    trials = [TrialPrivacy.from_dict(r.privacy) for r in records if r.privacy is not None]
    # started (or finished) without a TrialPrivacy: rounds on the private data unaccounted
    unaccounted = [
        *(f"{r.name} {r.status}" for r in records if r.status != "NOT RUN" and r.privacy is None),
        *earlier,
    ]
    if unaccounted:
        named = ", ".join(unaccounted[:3])
        more = f" and {len(unaccounted) - 3} more" if len(unaccounted) > 3 else ""
        one = len(unaccounted) == 1
        return TuningStatement(
            None,
            min((t.delta for t in trials if t.delta is not None), default=None),
            "none",
            f"{len(trials) + len(unaccounted)} trials started on the same private data",
            f"trial{'' if one else 's'} {named}{more}: {'its' if one else 'their'} rounds are "
            "not accounted (a trial that started trained on the private data)",
        )
    return tuning_statement(
        trials,
        search=spec.method,
        num_trials_distribution=spec.num_trials,
        validation=validation_kind(spec, first),
        delta=None,
    )


def earlier_attempts(planned: Planned, parent_run_id: str) -> list[str]:
    """The parent run's children that no record holds: trials of an earlier attempt at the
    sweep (resumed) that did not finish, or were not recorded, and were run again. They trained
    on the private data too, and their rounds are in no trial's privacy."""
    from mlflow.tracking import MlflowClient

    uri, experiment = planned.tracking
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    held = {r.run_id for r in planned.all_records() if r.run_id}
    query = f"tags.mlflow.parentRunId = '{parent_run_id}'"
    runs = client.search_runs([found.experiment_id], query, max_results=50_000)
    return [
        f"{run.info.run_name} {run.info.status} (an earlier attempt, run {run.info.run_id})"
        for run in runs
        if run.info.run_id not in held
    ]


def write_outputs(planned: Planned, rows: list[dict], out: Path, tuning) -> list[Path]:
    spec, records = planned.spec, planned.records
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / n for n in ("sweep.md", "sweep.csv", "sweep_params.png", "tuning_privacy.json")]
    paths[0].write_text(markdown(spec, rows, planned.all_records()) + "\n")
    write_csv([*rows, *trial_rows(planned.all_records(), spec.select.metric)], paths[1])
    plot_parameters(spec, records, paths[2])
    paths[3].write_text(json.dumps(tuning.__dict__, indent=1) + "\n")
    values = _chosen_values(planned)
    if values is not None:
        paths.append(out / "selected.yaml")
        paths[-1].write_text(selected_yaml(planned, values))
    return paths


# ------------------------------------------------------------------------------ progress


class Progress:
    """One line per finished trial; on a terminal also a bar over the trials, redrawn below."""

    def __init__(self, total: int, done: int):
        self.total, self.done, self.start = total, done, time.perf_counter()
        self.bar = sys.stdout.isatty()

    def finished(self, record: TrialRecord, metric: str) -> None:
        self.done += 1
        value = "—" if record.metric is None else f"{record.metric:.4f}"
        line = f"[{self.done}/{self.total}] {record.name}: {record.status}"
        if record.status == "FINISHED":
            acc = "—" if record.test_accuracy is None else f"{record.test_accuracy:.4f}"
            line += f", {metric} {value}, test acc {acc}, {record.epsilon}"
        elif record.error:
            line += f": {record.error}"
        self.say(f"{line}, {record.seconds:.0f} s")

    def say(self, line: str) -> None:
        if self.bar:
            sys.stdout.write("\r\033[K")
        print(line, flush=True)
        if self.bar:
            filled = 30 * self.done // max(self.total, 1)
            sys.stdout.write(
                f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} trials, "
                f"{time.perf_counter() - self.start:.0f} s"
            )
            sys.stdout.flush()


# ------------------------------------------------------------------------------ the command


def run(args: argparse.Namespace) -> int:
    try:
        planned = plan(Path(args.spec), args.set)
        if args.concurrent < 0:
            raise ConfigError("--concurrent", args.concurrent, "0 (as many as fit) or more")
    except (ConfigError, OSError, yaml.YAMLError) as error:
        print(f"sweep: {error}", file=sys.stderr)
        return 2
    spec, records = planned.spec, planned.records
    if not records:  # a Poisson draw of 0 configurations
        print(f"sweep {spec.name}: the draw of the number of trials gave 0: nothing to run")
        return 0
    if spec.select.on_test:
        print(
            f"sweep: warning: selecting on {spec.select.metric}: the test set then tunes the "
            "model and no longer measures it (the parent run is tagged selected_on_test=true)",
            file=sys.stderr,
        )
    first = planned.configs[records[0].name]
    parent = _open_parent(planned, first) if first.tracking.enabled else None
    try:
        _run_records(planned, parent, args.concurrent, records, "trial")
        if spec.cross_validated:
            _retrain(planned, parent, args.concurrent)
    except BaseException as error:
        if parent is not None:
            parent.abandon("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        raise
    return _finish(planned, parent, Path(args.out or f"sweeps/{spec.name}"))


def _open_parent(planned: Planned, first: ExperimentConfig):
    import os

    from cluster.tracking.settings import tracking_uri

    # MLflow's INFO lines (a new store's tables) would interleave with the progress; read at
    # its import, here, as the tracking processes have it (``tracking_process._spawn``)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

    planned.tracking = (tracking_uri(), first.tracking.experiment)
    find_finished(planned, planned.records)
    parent = parent_run(planned, *planned.tracking)
    parent.wait_open()
    return parent


def _run_records(
    planned: Planned, parent, concurrent: int, records: list[TrialRecord], role: str
) -> None:
    """Run the ``records`` not finished before, as ``role`` ("trial", or "final")."""
    spec = planned.spec
    todo = [r for r in records if r.status != "FINISHED"]
    skipped = len(records) - len(todo)
    print(
        f"sweep {spec.name}: {len(records)} {role} run(s), {skipped} finished before (resumed), "
        f"{len(todo)} to run" + (f", {concurrent} at once at most" if concurrent else ""),
        flush=True,
    )
    said: set[str] = set()

    def say_once(line: str) -> None:  # a calibration line once, not once per trial
        key = re.sub(r", [0-9.]+ s\)$", ")", line)  # without its time
        if key not in said:
            said.add(key)
            print(line, flush=True)

    by_name = {r.name: r for r in todo}
    trials = [Trial(r.name, calibrate(planned.configs[r.name], say_once)) for r in todo]
    progress = Progress(len(records), skipped)

    def on_done(result: TrialResult, uri: str | None) -> None:
        record = by_name[result.trial.name]
        fill(record, result, spec.select.metric, role)
        record_trial(record, uri, spec.name)
        progress.finished(record, spec.select.metric)

    run_concurrently(trials, concurrent, parent and parent.run_id, on_done)
    if progress.bar:
        print()


def _retrain(planned: Planned, parent, concurrent: int) -> None:
    """After cross-validation: the selected configuration once more, on all training rows
    (``data.validation: null``) at the first seed; its test accuracy is the one reported."""
    spec = planned.spec
    chosen = _chosen_values(planned)
    if chosen is None:
        return
    trial = SweepTrial(chosen, spec.seeds[0])
    config = trial_config(spec, planned.overrides, trial, selected_changes(spec, chosen))
    planned.final = TrialRecord(trial, final_name(spec, trial), trial_digest(config))
    planned.configs[planned.final.name] = config
    if planned.tracking is not None:
        find_finished(planned, [planned.final])
    _run_records(planned, parent, concurrent, [planned.final], "final")


def _chosen_values(planned: Planned) -> Values | None:
    """The selected configuration's exact values (None: nothing could be selected): its row
    of ``summarize``, in the order of ``configurations``, never looked up by its label."""
    rows = summarize(planned.spec, planned.records)
    grouped = configurations(planned.records)
    return next((v for v, r in zip(grouped, rows, strict=True) if r["selected"]), None)


def _finish(planned: Planned, parent, out: Path) -> int:
    spec, records = planned.spec, planned.records
    rows = summarize(spec, records)
    print(markdown(spec, rows, planned.all_records()))
    earlier = earlier_attempts(planned, parent.run_id) if parent is not None else []
    tuning = statement(planned, planned.all_records(), earlier)
    chosen = next((r for r in rows if r["selected"]), None)
    reported = _reported_test(planned, chosen)
    if chosen is None:
        print("sweep: no configuration finished every trial: nothing selected", file=sys.stderr)
    else:  # the test metric of the selected configuration, reported once
        metric = spec.select.metric
        print(
            f"selected: {chosen['configuration']} ({metric} "
            f"{mean_std_cell(chosen[f'{metric}_mean'], chosen[f'{metric}_std'])} over "
            f"{chosen['trials']} trials); its test accuracy: {reported}"
        )
    print(tuning.line())
    paths = write_outputs(planned, rows, out, tuning)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    if parent is not None:
        children = {r.name: r.run_id for r in planned.all_records() if r.run_id}
        (out / "children.json").write_text(json.dumps(children, indent=1) + "\n")
        parent.set_tags(_parent_tags(spec, chosen, reported, tuning))
        parent.log_files([*paths, out / "children.json"], "sweep")
        parent.end()
    failed = [r for r in planned.all_records() if r.status != "FINISHED"]
    return 1 if failed else 0


def _reported_test(planned: Planned, chosen: dict | None) -> str:
    """The selected configuration's test accuracy: the retrained run's after
    cross-validation, else the mean ± std over its trials."""
    final = planned.final
    if final is not None:
        value = "—" if final.test_accuracy is None else f"{final.test_accuracy:.4f}"
        return f"{value} (retrained on all training rows: {final.name}, {final.status})"
    if chosen is None:
        return "—"
    return mean_std_cell(chosen["test_accuracy_mean"], chosen["test_accuracy_std"])


def _parent_tags(spec: SweepSpec, chosen: dict | None, reported: str, tuning) -> dict[str, str]:
    tags = {"selected_on_test": str(spec.select.on_test).lower(), "tuning_privacy": tuning.line()}
    if chosen is not None:
        tags["selected"] = chosen["configuration"]
        tags["selected_test_accuracy"] = reported
    if tuning.epsilon is not None and math.isfinite(tuning.epsilon):
        tags["tuning_epsilon"] = f"{tuning.epsilon:.6g}"
    return tags
