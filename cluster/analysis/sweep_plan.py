"""A sweep planned before any trial starts: its spec, and every trial's config built and
checked (``plan``); a ``ConfigError`` names the trial."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from cluster.analysis.run_configs import build_config, merged
from cluster.analysis.sweep_report import TrialRecord, configuration_values, configurations
from cluster.analysis.sweep_spec import (
    SEED_FIELDS,
    SEEDS_FIX,
    SweepSpec,
    SweepTrial,
    Values,
    trial_digest,
    trial_name,
    values_digest,
)
from cluster.config import ConfigError, ExperimentConfig

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the spec's stem: it names runs and tags


@dataclass
class Planned:
    """The checked sweep: its spec, each trial's record and config (not calibrated)."""

    spec: SweepSpec
    records: list[TrialRecord]
    configs: dict[str, ExperimentConfig] = field(default_factory=dict)  # by trial name
    overrides: list[str] = field(default_factory=list)  # --set
    # cross-validation: each configuration retrained on all rows (``final_record``), by its
    # values; ``final``: the selected one's, once it is known
    finals: dict[Values, TrialRecord] = field(default_factory=dict)
    final: TrialRecord | None = None
    tracking: tuple[str, str] | None = None  # (tracking URI, experiment) where runs are found

    def digest(self) -> str:
        """What the trials depend on: the spec's ``digest`` and every trial's identity (its
        configuration after ``--set``, seed and draw); ``--set`` of a runtime section (the
        executor, tracking, checkpoints) leaves it unchanged."""
        identities = [self.spec.digest(), *(r.digest for r in self.records)]
        return hashlib.sha256("/".join(identities).encode()).hexdigest()[:16]

    def all_records(self) -> list[TrialRecord]:
        return self.records + ([self.final] if self.final is not None else [])


def plan(path: Path, overrides: list[str]) -> Planned:
    """The spec and every trial's config, checked, the retraining of each configuration after
    cross-validation's included (``Planned.finals``); a ``ConfigError`` names the trial."""
    from cluster.analysis.sweep_spec import load

    spec = load(path)
    if not NAME.match(spec.name):
        raise ConfigError("SPEC", str(path), "name the spec file with letters, digits, . _ -")
    for given in overrides:
        if given.partition("=")[0].strip() in SEED_FIELDS:
            raise ConfigError("--set", given, SEEDS_FIX)
    planned = Planned(spec, [], overrides=list(overrides))
    drawn: dict[str, int] = {}  # a configuration and seed: how often drawn so far
    for trial in spec.trials():
        config = trial_config(spec, overrides, trial)
        name, once = trial.name(spec.name), trial_digest(config)
        repeat = drawn[once] = drawn.get(once, -1) + 1
        if name in planned.configs:  # SweepTrial.key makes names unique: a bug otherwise
            raise AssertionError(f"two trials named {name}")
        digest = trial_digest(config, repeat)
        planned.configs[name] = with_own_streams(config, digest)
        planned.records.append(TrialRecord(trial, name, digest, repeat=repeat))
    if planned.records:
        check_selection(spec, planned.configs[planned.records[0].name])
    if spec.cross_validated:
        planned.finals = {v: final_record(planned, v) for v in configurations(planned.records)}
    return planned


def final_record(planned: Planned, values: Values) -> TrialRecord:
    """After cross-validation: the configuration of ``values`` retrained on all training rows
    (``data.validation: null``) at the first seed; its config goes in ``planned.configs``."""
    spec = planned.spec
    trial = SweepTrial(values, spec.seeds[0])
    config = trial_config(spec, planned.overrides, trial, selected_changes(spec, values))
    record = TrialRecord(trial, final_name(spec, trial), trial_digest(config))
    planned.configs[record.name] = with_own_streams(config, record.digest)
    return record


def with_own_streams(config: ExperimentConfig, digest: str) -> ExperimentConfig:
    """``config`` with the ``stream_seed`` of the trial whose identity is ``digest``
    (``trial_digest``: its configuration, seed and draw). Each trial's noise, cohorts and
    batches are then independent of every other trial's, as the composition of their ε
    assumes (at one shared seed the difference of two trials' models cancelled the noise), and
    two runs share them only where they are the same computation. The data's randomness (the
    validation split) stays the seed's, shared by the trials. With ``privacy.secret_streams``
    every trial draws its own secret key: ``config`` as it is."""
    if config.privacy.secret_streams:
        return config
    word = hashlib.sha256(f"dpfl-trial-streams/{digest}".encode()).hexdigest()[:15]
    return dataclasses.replace(config, stream_seed=int(word, 16))  # 60 bits: < 2**63


def trial_config(
    spec: SweepSpec, overrides: list[str], trial: SweepTrial, changes: dict | None = None
) -> ExperimentConfig:
    """``trial``'s config (its values; or ``changes``, the retraining of ``final_record``,
    with its name and seed); a ``ConfigError`` names which of the two it is."""
    retraining = changes is not None
    name = final_name(spec, trial) if retraining else trial.name(spec.name)
    extra = [f"seed={trial.seed}", f"tracking.run_name={json.dumps(name)}"]
    raw = merged(spec.base, overrides)
    if (raw.get("tracking") or {}).get("enabled", True) is False:  # an untracked checkpoint is
        directory = (raw.get("checkpoint") or {}).get("dir") or "checkpoints"  # named by seed
        extra.append(f"checkpoint.dir={json.dumps(f'{directory}/{name}')}")
    try:
        return build_config(spec.base, overrides, changes or dict(trial.values), extra)
    except ConfigError as error:
        which = f"trial {trial.label()}"
        if retraining:
            which = f"the retraining of {trial.label()} on all training rows"
        raise ConfigError(
            error.field_path, error.value, f"{error.fix} ({which}, seed {trial.seed})"
        ) from None


def final_name(spec: SweepSpec, trial: SweepTrial) -> str:
    return trial_name(
        spec.name, trial.label(), f"{values_digest(trial.values)}-final-seed{trial.seed}"
    )


def selected_changes(spec: SweepSpec, values: Values) -> dict:
    """The selected configuration's overrides; after cross-validation, on all training rows."""
    changes = dict(configuration_values(values))
    return changes | ({"data.validation": None} if spec.cross_validated else {})


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
