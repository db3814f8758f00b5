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
are not run again, trials a stop signal killed continue their runs from their checkpoints,
and the unfinished parent run is continued. A trial that fails is recorded
(status FAILED, its error in the table) and the others go on.

The parent run holds ``sweep.md`` (one row per configuration: mean ± std over its seeds of the
selection metric and of the test accuracy), ``sweep.csv`` (those rows, then one per trial),
``sweep_params.png`` (the selection metric against each swept field), ``selected.yaml`` (the
selected configuration at the first seed: ``python -m cluster run`` of it reruns it)
and ``tuning_privacy.json``, the sweep's privacy statement (``privacy.tuning``), printed too.
Each trial's run holds ``trial_privacy.json`` (its ``TrialPrivacy``), from which a resumed
sweep rebuilds the statement. A trial that started but did not finish (FAILED, KILLED) trained
on the private data for rounds no accountant recorded: the sweep then states no ε, naming it.
A resumed sweep continues a KILLED trial's run from its checkpoint where the run and the
checkpoint match the trial (``sweep_resume``): all its rounds are then in that run's accountant.
Any other unfinished run of an earlier attempt (the parent's child runs that no trial holds,
``sweep_runs.earlier_attempts``: FAILED, or KILLED without a matching checkpoint), rerun from
round 0 since, leaves the sweep without an ε too. With tracking off the same rules hold, the
trials' ledger being a folder of the sweep's own (``sweep_ledger``: ``ledger/`` under
``--out``, so a rerun resumes with the same ``--out``). That folder records the trials with
tracking on too, so that a rerun that switched ``tracking.enabled`` exits 2 before any trial
runs (each mode's ledger misses the other's attempts; the entries of every configuration's
retraining after cross-validation are read with the others). A resumed trial's seconds are
the sum over its attempts. Where a trial's start cannot be recorded (its SUBMITTED entry,
written before its task is submitted: that trial is then not submitted), or handling its end
raises, no trial starts after it, the running ones end recorded, and the sweep exits 1 naming
the trial and the error (``trials.RecordingFailed``); a rerun resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import yaml

from cluster.analysis.compare import write_csv
from cluster.analysis.run_configs import assignments, merged, run_setup
from cluster.analysis.sweep_ledger import FOLDER, Ledger, LedgerInUse
from cluster.analysis.sweep_plan import Planned, plan, selected_changes, validation_kind
from cluster.analysis.sweep_report import (
    TrialRecord,
    configuration_values,
    configurations,
    draw_values,
    markdown,
    mean_std_cell,
    plot_parameters,
    summarize,
    trial_rows,
)
from cluster.analysis.sweep_runs import MlflowLedger, parent_run
from cluster.analysis.sweep_spec import SweepSpec, Values, label, mechanism_may_vary
from cluster.analysis.trials import (
    RecordingFailed,
    Trial,
    TrialResult,
    calibrate,
    run_concurrently,
)
from cluster.config import ConfigError, ExperimentConfig

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

    record.status, record.error = result.status, result.error or ""
    record.seconds = result.trial.seconds_before + result.seconds  # over its attempts
    outcome = result.outcome
    record.run_id = result.run_id if outcome is None else outcome.run_id
    if outcome is None:
        return
    record.metric, record.test_accuracy = final_metric(outcome, metric), outcome.final_accuracy
    record.epsilon = outcome.claim.epsilon_text(outcome.epsilon, outcome.epsilon_vs_server)
    if record.status == "FINISHED":
        privacy = replace(trial_privacy(outcome), role=role)
        if record.repeat:  # another draw of Q (Papernot–Steinke): not one more seed of the first
            privacy = replace(privacy, configuration=f"{privacy.configuration}-{record.repeat}")
        record.privacy = privacy.to_dict()


def selected_yaml(planned: Planned, values: Values) -> str:
    """The selected configuration at the spec's first seed, as ``cluster run`` reads it: its
    trial there (the retraining, after cross-validation) again, with that trial's streams."""
    spec = planned.spec
    changes = selected_changes(spec, values)
    run_base, run_overrides = run_setup(spec.base, planned.overrides, changes)
    streams = _streams_of(planned, values)
    seed = [f"seed={spec.seeds[0]}", f"stream_seed={'null' if streams is None else streams}"]
    raw = merged(run_base, [*run_overrides, *assignments(changes), *seed])
    seeds = ", ".join(map(str, spec.seeds))
    again = (
        "the configuration again, with a fresh secret key (privacy.secret_streams)"
        if streams is None
        else "the trial again;\n# fresh noise and cohorts: --set stream_seed=null (another "
        "seed: also --set seed=K)"
    )
    head = (
        f"# sweep {spec.name}: selected by the mean {spec.select.metric} ({spec.select.mode}) over "
        f"seeds {seeds}{' and folds' * spec.cross_validated}: "
        f"{label(configuration_values(values), exact=True)}\n"
        f"# from the repository root: uv run python -m cluster run <this file>: {again}\n"
    )
    return head + yaml.safe_dump(raw, sort_keys=False)


def _streams_of(planned: Planned, values: Values) -> int | None:
    """The ``stream_seed`` of the trial ``selected_yaml`` repeats: the retraining on all rows
    after cross-validation, else the selected draw's (``draw_values``) at the first seed; None
    where its key was a secret (``privacy.secret_streams``), which no rerun repeats."""
    if planned.spec.cross_validated:
        record = planned.finals[values]
    else:
        first = planned.spec.seeds[0]
        record = next(
            r for r in planned.records if draw_values(r) == values and r.trial.seed == first
        )
    config = planned.configs[record.name]
    return None if config.privacy.secret_streams else config.streams_seed


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
        space_refusal=mechanism_may_vary(spec, [r.trial for r in records if r.privacy]),
        secret_streams=first.privacy.secret_streams,
    )


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
        preflight_trials(planned)
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
    first, out = planned.configs[records[0].name], Path(args.out or f"sweeps/{spec.name}")
    ledger = Ledger(out / FOLDER, spec.name, first.tracking.enabled)  # under --out: both modes
    try:  # one sweep at a time on an --out: none changes another's entries
        held = ledger.hold()
    except (LedgerInUse, OSError) as error:
        print(f"sweep: {error}", file=sys.stderr)
        return 2
    with held:
        return _run_held(planned, ledger, first, out, args.concurrent)


def preflight_trials(planned: Planned) -> None:
    """The checks ``cluster run`` makes before any work (the store, the tracking store, Ray,
    the checkpoint directory, a sketch's memory), for every trial before any starts, where the
    trials run on this machine (an embedded Ray; on a cluster their drivers run on its nodes,
    whose paths and memory these checks cannot see): a trial refused there would otherwise
    fail once started, and count as one that trained on the private data (≈ 1 ms a trial)."""
    from cluster.config.runtime import ray_connection
    from cluster.runtime.preflight import preflight

    for config in planned.configs.values():  # the sweep's Ray: the first trial's address
        if ray_connection(config.executor.address) == "embedded":  # else on a cluster's nodes
            preflight(config)


def _run_held(planned: Planned, ledger: Ledger, first: ExperimentConfig, out: Path, concurrent):
    """The sweep, its ledger held (``Ledger.hold``)."""
    spec, records = planned.spec, planned.records
    try:  # before a parent run opens: refuses a switch of tracking, the retrainings' included
        ledger.read([*records, *planned.finals.values()])
    except ConfigError as error:
        print(f"sweep: {error}", file=sys.stderr)
        return 2
    parent = _open_parent(planned, first) if first.tracking.enabled else None
    if parent is not None:  # tracking on: the MLflow runs resume it
        ledger = MlflowLedger(planned, parent.run_id, ledger)
    ledger.find_finished(records)
    try:
        _run_records(planned, ledger, parent, concurrent, records, "trial")
        if spec.cross_validated:
            _retrain(planned, ledger, parent, concurrent)
    except BaseException as error:
        if parent is not None:
            parent.abandon("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        if isinstance(error, RecordingFailed):
            print(
                f"sweep {spec.name}: {error}; fix the cause (the trials' ledger is "
                f"{out / FOLDER}) and rerun the same command to resume",
                file=sys.stderr,
            )
            return 1
        raise
    return _finish(planned, ledger, parent, out)


def _open_parent(planned: Planned, first: ExperimentConfig):
    import os

    from cluster.tracking.settings import tracking_uri

    # MLflow's INFO lines (a new store's tables) would interleave with the progress; read at
    # its import, here, as the tracking processes have it (``cluster.tracking.process._spawn``)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

    planned.tracking = (tracking_uri(), first.tracking.experiment)
    parent = parent_run(planned, *planned.tracking)
    parent.wait_open()
    return parent


def _run_records(
    planned: Planned, ledger, parent, concurrent: int, records: list[TrialRecord], role: str
) -> None:
    """Run the ``records`` not finished before (``ledger``: ``Ledger`` or ``MlflowLedger``), as
    ``role`` ("trial", or "final")."""
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
    say = _say(spec.name)
    trials = ledger.resume_killed(trials, say)  # KILLED: from their checkpoints
    progress = Progress(len(records), skipped)

    def on_done(result: TrialResult, uri: str | None) -> None:
        record = by_name[result.trial.name]
        fill(record, result, spec.select.metric, role)
        _record(ledger, record, result, uri, say)
        progress.finished(record, spec.select.metric)

    try:
        run_concurrently(trials, concurrent, parent and parent.run_id, on_done, ledger.submitting)
    finally:  # the bar's line ended before any message that follows
        if progress.bar:
            print()


def _record(ledger, record: TrialRecord, result: TrialResult, uri: str | None, say) -> None:
    """``ledger.record``; a failure of it (its store, its file) is said, not raised: it runs
    as each trial ends, also while a stop signal ends the others, which must go on to their
    checkpoints. No accounting is lost: the trial's attempt stays as the ledger last held it
    (its SUBMITTED entry; tracked, its MLflow run not tagged recorded), so a rerun runs it
    again from round 0 and counts this attempt as an earlier one (no ε)."""
    try:
        ledger.record(record, result, uri)
    except Exception as error:
        say(
            f"{record.name}: recording it {record.status} failed ({type(error).__name__}: "
            f"{error}); a rerun finds its attempt as the ledger last held it"
        )


def _say(sweep: str):
    """A line of the sweep's, printed at once."""
    return lambda line: print(f"sweep {sweep}: {line}", flush=True)


def _retrain(planned: Planned, ledger, parent, concurrent: int) -> None:
    """After cross-validation: the selected configuration once more, on all training rows
    (``data.validation: null``) at the first seed; its test accuracy is the one reported."""
    chosen = _chosen_values(planned)
    if chosen is None:
        return
    planned.final = planned.finals[chosen]
    ledger.find_finished([planned.final])
    _run_records(planned, ledger, parent, concurrent, [planned.final], "final")


def _chosen_values(planned: Planned) -> Values | None:
    """The selected configuration's exact values (None: nothing could be selected): its row
    of ``summarize``, in the order of ``configurations``, never looked up by its label."""
    rows = summarize(planned.spec, planned.records)
    grouped = configurations(planned.records)
    return next((v for v, r in zip(grouped, rows, strict=True) if r["selected"]), None)


def _finish(planned: Planned, ledger, parent, out: Path) -> int:
    spec, records = planned.spec, planned.records
    rows = summarize(spec, records)
    print(markdown(spec, rows, planned.all_records()))
    tuning = statement(planned, planned.all_records(), ledger.earlier_attempts())
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
    # Always written: a resumed parent's earlier value must not outlive a statement without ε.
    # tuning_epsilon bounds the selected model (Papernot–Steinke where it is smaller); every
    # trial's model and metrics logged here are covered by the composition only.
    composed = tuning.epsilon if tuning.composition_epsilon is None else tuning.composition_epsilon
    for tag, value in (("tuning_epsilon", tuning.epsilon), ("tuning_epsilon_all_trials", composed)):
        finite = value is not None and math.isfinite(value)
        tags[tag] = f"{value:.6g}" if finite else "none"
    return tags
