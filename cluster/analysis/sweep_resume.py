"""A rerun sweep's killed trials, continued from their checkpoints.

A trial that a stop signal ended (Ctrl-C, SIGTERM: ``cluster.analysis.trials``) left its MLflow
run KILLED, a child of the sweep's parent run, and its checkpoint. When the sweep is rerun
(under the same parent run: ``sweep_runs.parent_run``), such a trial continues that run from
its checkpoint, as ``python -m cluster resume`` would, instead of starting again from round 0:
its rounds are then all in that one run's accountant, and the trial is no earlier attempt
(``sweep_runs.earlier_attempts``). A KILLED run continues a trial only where all of these hold:

- its ``tracking.run_name`` param is the trial's run name (unique in the sweep: the
  configuration's index, a digest of its values, the seed), and every param of the trial's
  config (as it runs: calibrated) is the run's param of that name;
- its checkpoint (``checkpoint_path`` of the trial's config and the run's id) exists, reads,
  and matches its own config (``open_checkpoint``: the check ``cluster resume`` makes);
- that config is the trial's config, field for field, and the checkpoint continues that run
  (its ``run_id``).

Any other KILLED run of the trial is not continued: the trial runs from round 0 in a new run,
and the killed one stays an earlier attempt (the sweep then states no ε), with the reason.
FAILED runs are never continued.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from cluster.analysis.trials import Trial
from cluster.config import ConfigError, ExperimentConfig
from datasets.locations import Location, LocationError


@dataclass(frozen=True)
class Resumption:
    """The KILLED run a trial continues, from its checkpoint after ``rounds_done`` rounds."""

    run_id: str
    checkpoint: Location
    rounds_done: int


@dataclass(frozen=True)
class Refusal:
    """A KILLED run of the trial that cannot be continued, and why."""

    run_id: str
    reason: str


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
        continued = _continuation(run, config)
        if isinstance(continued, Resumption):
            found = continued
        else:
            refused.append(Refusal(run_id, continued))
    return found, refused


def _continuation(run, config: ExperimentConfig) -> Resumption | str:
    """``run`` continued as a run of ``config`` from its checkpoint, or why it cannot be."""
    from cluster.runtime.checkpoint import checkpoint_path, open_checkpoint
    from cluster.tracking.process import flatten
    from cluster.tracking.tracker import logged_param
    from datasets import locations

    run_id = run.info.run_id
    logged = run.data.params
    for key, value in flatten(config.to_dict()).items():
        if logged.get(key) != logged_param(value):
            return f"its param {key} is {logged.get(key)!r}, the trial's is {value!r}"
    path = checkpoint_path(config, run_id)
    try:
        if not locations.exists(path):
            return f"no checkpoint at {path}"
        checkpoint, _ = open_checkpoint(path)
    except (ConfigError, LocationError, OSError) as error:
        return f"its checkpoint {path} is unusable: {error}"
    if checkpoint["run_id"] != run_id:
        return f"its checkpoint {path} continues run {checkpoint['run_id']}, not this one"
    field = _first_difference(checkpoint["config"], config.to_dict())
    if field is not None:
        return f"its checkpoint {path} was written for another config ({field} differs)"
    return Resumption(run_id, path, checkpoint["simulation"]["rounds_done"])


def _first_difference(saved: dict, wanted: dict) -> str | None:
    """The first dotted field whose value differs between two config dicts (None: equal)."""
    from cluster.tracking.process import flatten

    a, b = flatten(saved), flatten(wanted)
    return next((key for key in sorted(a.keys() | b.keys()) if a.get(key) != b.get(key)), None)


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
    resumed = []
    for trial in trials:
        found, refused = resumption(killed.get(trial.name, []), trial.config)
        for refusal in refused:
            say(
                f"{trial.name}: its KILLED run {refusal.run_id} is not resumed ({refusal.reason}); "
                "it stays an earlier attempt, its rounds in no trial's accountant (no ε for the "
                "sweep)"
            )
        if found is not None:
            say(
                f"{trial.name}: resuming its KILLED run {found.run_id} after round "
                f"{found.rounds_done} from {found.checkpoint}"
            )
            trial = replace(trial, resume=found.checkpoint)
        elif refused:
            say(f"{trial.name}: runs again from round 0")
        resumed.append(trial)
    return resumed
