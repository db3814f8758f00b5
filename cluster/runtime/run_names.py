"""What an MLflow run of an experiment is called, and the line that describes it in the UI.

A run's name says what ran: the preset, the task, the seed and the first six characters of the
MLflow run id (its checkpoint is ``<run id>.pt``), after ``tracking.run_name`` when one is
given (compare and sweep children give theirs: spec, label, seed), joined by `` · ``:
``dp_fedavg · synthetic_logreg · s0 · 3f2a1c``. The run opens under its title (the name less the
id) and is renamed once its id is known.

Its description (MLflow's ``mlflow.note.content`` tag, shown on the run's page) is set when the
run ends, stopped or complete: the rounds completed, the final test accuracy, and ε at δ with
whom it protects (the privacy unit and threat model), or why there is none. A run that a signal
stopped before its rounds could end, or that failed, says why and the rounds its last checkpoint
keeps (``stopped_description``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from cluster.config import ExperimentConfig
from cluster.runtime.records import RoundRecord

if TYPE_CHECKING:
    from cluster.claims.privacy_plan import PrivacyClaim
    from cluster.claims.sample_claim import SampleLevelClaim

SEPARATOR = " · "
SHORT_ID = 6  # characters of the run id in its name
NAME_TAG = "mlflow.runName"
DESCRIPTION_TAG = "mlflow.note.content"
# On a run whose last checkpoint lacks rounds it completed (a second stop signal abandoned the
# round after them): how many. A sweep never continues such a run (``sweep_resume``).
UNSAVED_TAG = "rounds_not_in_checkpoint"


def run_title(config: ExperimentConfig) -> str:
    """The name without the run id: [tracking.run_name ·] preset · task · s<seed>."""
    given = [config.tracking.run_name] if config.tracking.run_name else []
    return SEPARATOR.join([*given, config.algorithm.name, config.task, f"s{config.seed}"])


def run_name(config: ExperimentConfig, run_id: str) -> str:
    """The run's full name: its title and the first ``SHORT_ID`` characters of its id."""
    return f"{run_title(config)}{SEPARATOR}{run_id[:SHORT_ID]}"


def privacy_text(claim: PrivacyClaim | SampleLevelClaim, epsilon: float, rounds: int) -> str:
    """ε at δ after ``rounds`` released rounds and whom it protects (with ε against a server
    that sees each upload, where the noise is the clients'); or "no ε: dp_valid=false (why)";
    or "not private"."""
    if not claim.private:
        return "not private (no noise)"
    if not claim.dp_valid:
        return f"no ε: dp_valid=false ({claim.unaccounted_reason})"
    unit = claim.tags()["privacy.unit"]
    if rounds == 0:  # nothing was released (e.g. the budget refused round 1)
        spent = "ε = 0 (no round released)"
    else:
        value = f"{epsilon:.3f}" if math.isfinite(epsilon) else "∞"
        spent = f"ε = {value} at δ = {claim.delta:g} ({claim.accounting_text})"
        vs_server = claim.epsilon_vs_server(rounds)
        if vs_server is not None:
            spent += f", against a server that sees each upload ε = {vs_server:.4g}"
    return f"{spent}; privacy unit: {unit}; threat model: {claim.threat_model}"


def run_description(
    claim: PrivacyClaim | SampleLevelClaim,
    history: list[RoundRecord],
    planned_rounds: int,
    stop_reason: str,
    epsilon: float,
) -> str:
    """The run's final line: rounds completed of those planned (warm-up included) and why it
    stopped, final accuracy, privacy."""
    evaluated = [r for r in history if r.test_accuracy is not None]
    accuracy = (
        f"final test accuracy {evaluated[-1].test_accuracy:.4f} (round {evaluated[-1].round})"
        if evaluated
        else "no test accuracy"
    )
    rounds = f"{len(history)}/{planned_rounds} rounds ({stop_reason})"
    return SEPARATOR.join([rounds, accuracy, privacy_text(claim, epsilon, len(history))])


def stopped_description(
    error: BaseException,
    written: tuple[object, int] | None,
    planned_rounds: int,
    resumed_rounds: int | None = None,
) -> str:
    """The line of a run ``error`` ended early: the rounds its last checkpoint ``written``
    ((path, rounds); None: none this time) keeps for a resume, and why it stopped. A resumed
    run (``resumed_rounds``: the rounds of the checkpoint it resumed from) that wrote none
    still has that checkpoint, unchanged."""
    message = (str(error).splitlines() or [""])[0][:300]
    if isinstance(error, KeyboardInterrupt):  # a stop signal: the user's, not a failure
        why = f"stopped: {message or 'interrupted'}"
    else:
        why = f"failed: {type(error).__name__}: {message}"
    if written is None and resumed_rounds is not None:
        return (
            f"{resumed_rounds}/{planned_rounds} rounds kept in the checkpoint it resumed from, "
            f"unchanged ({why})"
        )
    if written is None:
        return f"0/{planned_rounds} rounds kept, no checkpoint ({why})"
    path, rounds = written
    return f"{rounds}/{planned_rounds} rounds kept in checkpoint {path} ({why})"
