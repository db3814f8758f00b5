"""A rerun sweep's killed trials, continued from their checkpoints.

A trial that a stop signal ended (Ctrl-C, SIGTERM: ``cluster.analysis.trials``) left a KILLED
attempt and its checkpoint: where tracking is on, its MLflow run, a child of the sweep's parent
run; where it is off, its entry in the sweep's local ledger (``sweep_ledger``). When the sweep
is rerun, such a trial continues that attempt from its checkpoint, as ``python -m cluster
resume`` would, instead of starting again from round 0: its rounds are then all in that one
attempt's accountant, and it is no earlier attempt (``sweep_runs.earlier_attempts``,
``sweep_ledger``). A KILLED attempt continues a trial only where all of these hold
(``continuation``, the same rules for both):

- the params it recorded (``attempt_params``) are the trial's config's (as it runs:
  calibrated), every one; ``tracking.run_name`` among them is the trial's name (unique in the
  sweep: the configuration's index, a digest of its values, the seed);
- its checkpoint (``checkpoint_path`` of the trial's config and the attempt's MLflow run, or
  none where untracked) exists, reads, and matches its own config (``open_checkpoint``: the
  check ``cluster resume`` makes);
- that config is the trial's config, field for field, and the checkpoint continues that attempt
  (its ``run_id``: the MLflow run's, None where untracked).

A KILLED run tagged ``rounds_not_in_checkpoint`` (``run_names.UNSAVED_TAG``: a second stop
signal abandoned its round before the rounds it completed were checkpointed) is never
continued; nor is an ABANDONED ledger entry (the same, or a forced cancel, untracked). Any
other KILLED attempt is not continued: the trial runs from round 0, and the killed attempt
stays an earlier one (the sweep then states no ε), with the reason. FAILED attempts are never
continued. A continued trial's seconds are the sum over its attempts (``Resumption.seconds``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from cluster.analysis.trials import Trial
from cluster.config import ConfigError, ExperimentConfig
from cluster.runtime.run_names import UNSAVED_TAG
from datasets.locations import Location, LocationError

SECONDS = "sweep_seconds"  # a trial's seconds, summed over its attempts (a resumed trial's)


@dataclass(frozen=True)
class Resumption:
    """The KILLED attempt a trial continues (its MLflow run; None where untracked), from its
    checkpoint after ``rounds_done`` rounds; ``seconds``: what its attempts took so far."""

    run_id: str | None
    checkpoint: Location
    rounds_done: int
    seconds: float


@dataclass(frozen=True)
class Refusal:
    """A KILLED run of the trial that cannot be continued, and why."""

    run_id: str
    reason: str


def attempt_params(config: ExperimentConfig) -> dict[str, str]:
    """``config``'s params as a run of it records them (MLflow's, and the local ledger's)."""
    from cluster.tracking.process import flatten
    from cluster.tracking.tracker import logged_param

    return {key: logged_param(value) for key, value in flatten(config.to_dict()).items()}


def continuation(
    params: dict, run_id: str | None, seconds: float, config: ExperimentConfig
) -> Resumption | str:
    """A KILLED attempt (the ``params`` it recorded, its MLflow run or None where untracked,
    the ``seconds`` it ran) continued as a run of ``config`` from its checkpoint, or why it
    cannot be."""
    from cluster.runtime.checkpoint import checkpoint_path, open_checkpoint
    from datasets import locations

    moved = _data_locations(config)
    for key, value in attempt_params(config).items():
        if params.get(key) != value and key not in moved:
            return f"its param {key} is {params.get(key)!r}, the trial's is {value!r}"
    path = checkpoint_path(config, run_id)
    try:
        if not locations.exists(path):
            return f"no checkpoint at {path}"
        checkpoint, _ = open_checkpoint(path)
    except (ConfigError, LocationError, OSError) as error:
        return f"its checkpoint {path} is unusable: {error}"
    if checkpoint["run_id"] != run_id:
        attempt = "this one" if run_id is not None else "an untracked attempt"
        return f"its checkpoint {path} continues run {checkpoint['run_id']}, not {attempt}"
    field = _first_difference(checkpoint["config"], config.to_dict(), moved)
    if field is not None:
        return f"its checkpoint {path} was written for another config ({field} differs)"
    return Resumption(run_id, path, checkpoint["simulation"]["rounds_done"], seconds)


def _first_difference(saved: dict, wanted: dict, moved: set[str]) -> str | None:
    """The first dotted field whose value differs between two config dicts (None: equal), the
    ``moved`` fields (where the data files are) aside."""
    from cluster.tracking.process import flatten

    a, b = flatten(saved), flatten(wanted)
    keys = sorted(a.keys() | b.keys())
    return next((k for k in keys if a.get(k) != b.get(k) and k not in moved), None)


def _data_locations(config: ExperimentConfig) -> set[str]:
    """Where the trial's data files are (``privacy.tuning.data_locations``), as dotted fields:
    an attempt with its store elsewhere is the same trial, as its identity says."""
    from privacy.tuning import data_locations

    return {f"data.{name}" for name in data_locations(config.to_dict()["data"])}


def resumed(trial: Trial, found: Resumption) -> Trial:
    """``trial`` continuing ``found``: from its checkpoint, its seconds counted before."""
    return replace(trial, resume=found.checkpoint, seconds_before=found.seconds)


def resumed_line(trial: Trial, attempt: str, found: Resumption) -> str:
    return (
        f"{trial.name}: resuming its KILLED {attempt} after round {found.rounds_done} from "
        f"{found.checkpoint} ({found.seconds:.0f} s before)"
    )


def refused_line(trial: Trial, attempt: str, reason: str) -> str:
    return (
        f"{trial.name}: its {attempt} is not resumed ({reason}); it stays an earlier attempt, "
        "its rounds in no trial's accountant (no ε for the sweep)"
    )


def rerun_line(trial: Trial) -> str:
    return f"{trial.name}: runs again from round 0"


# ---------------------------------------------------------------------------- MLflow runs


def killed_runs(uri: str, experiment: str, parent_run_id: str) -> dict[str, list]:
    """The parent run's KILLED child runs by their ``tracking.run_name`` param, newest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    query = f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'KILLED'"
    runs = client.search_runs(
        [found.experiment_id], query, max_results=50_000, order_by=["attributes.start_time DESC"]
    )
    by_name: dict[str, list] = {}
    for run in runs:
        by_name.setdefault(run.data.params.get("tracking.run_name"), []).append(run)
    return by_name


def resumption(runs: list, config: ExperimentConfig) -> tuple[Resumption | None, list[Refusal]]:
    """The first of ``runs`` (a trial's KILLED runs, newest first) that can continue as a run
    of ``config`` (the trial's, calibrated), and every other one with why it is not."""
    found, refused = None, []
    for run in runs:
        run_id = run.info.run_id
        if found is not None:
            refused.append(Refusal(run_id, f"the trial resumes its newer run {found.run_id}"))
            continue
        seconds = float(run.data.tags.get(SECONDS, 0.0))  # what it ran before it was killed
        unsaved = run.data.tags.get(UNSAVED_TAG)
        continued = (
            continuation(run.data.params, run_id, seconds, config)
            if unsaved is None
            else f"{unsaved} round(s) it completed are in no checkpoint (a second stop signal "
            "abandoned its round)"
        )
        if isinstance(continued, Resumption):
            found = continued
        else:
            refused.append(Refusal(run_id, continued))
    return found, refused


def resume_killed(
    trials: list[Trial],
    tracking: tuple[str, str],
    parent_run_id: str,
    say: Callable[[str], None],
) -> list[Trial]:
    """``trials``, each that a KILLED run under ``parent_run_id`` can continue set to resume
    from its checkpoint (``Trial.resume``); ``say`` gets a line per trial continued and per
    KILLED run that cannot be, with the reason."""
    killed = killed_runs(*tracking, parent_run_id)
    continued = []
    for trial in trials:
        found, refused = resumption(killed.get(trial.name, []), trial.config)
        for refusal in refused:
            say(refused_line(trial, f"KILLED run {refusal.run_id}", refusal.reason))
        if found is not None:
            say(resumed_line(trial, f"run {found.run_id}", found))
            trial = resumed(trial, found)
        elif refused:
            say(rerun_line(trial))
        continued.append(trial)
    return continued
