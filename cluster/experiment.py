"""Assemble and run one experiment: data store → executor → Simulation → MLflow."""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.client_host import Kernels
from algorithms.layout import ParamLayout
from cluster.checkpoint import checkpoint_path, save_checkpoint
from cluster.config import ExperimentConfig
from cluster.executors import LocalExecutor, RayExecutor
from cluster.interrupts import GracefulStop
from cluster.preflight import check_store_matches, preflight
from cluster.privacy_plan import (
    PrivacyClaim,
    calibrate_with_message,
    privacy_claim,
    privacy_report,
    privacy_warnings,
)
from cluster.simulation import RoundRecord, Simulation, SimulationResult, final_epsilon
from datasets.sources import build_or_open_store
from datasets.store import ShardStore


def open_store(config: ExperimentConfig) -> tuple[ShardStore, bool]:
    """The run's store: ``data.store`` as given, or built from the config on first use."""
    d = config.data
    if d.store is not None:
        store = ShardStore.open(d.store)
        check_store_matches(store, d)
        return store, False
    return build_or_open_store(
        d.resolved_store_root(),
        *config.store_parameters,
        data_root=d.resolved_data_root(),
        download=d.download,
    )


def make_executor(
    config: ExperimentConfig,
    store: ShardStore,
    say: Callable[[str], None] = lambda message: None,
    verbose: bool = False,
):
    algorithm = config.build_algorithm()
    e = config.executor
    if e.kind == "local":
        # In process, each host is an "actor" on a thread, with the same thread budget.
        torch.set_num_threads(max(1, int(e.cpus_per_actor)))
        return LocalExecutor(
            store,
            config.task,
            algorithm,
            config.seed,
            num_hosts=e.num_actors,
            device="cuda" if e.gpus_per_actor > 0 else "cpu",
            test_per_client=config.data.test_per_client,
            kernels=Kernels(e.vectorize, e.channels_last),
        )
    from cluster.ray_runtime import check_resources, connect

    session = connect(e.address, verbose)
    say(session.describe())
    if session.embedded:
        check_resources(e.num_actors, e.cpus_per_actor, e.gpus_per_actor)
    return RayExecutor(
        store,
        config.task,
        algorithm,
        config.seed,
        e.num_actors,
        e.cpus_per_actor,
        e.gpus_per_actor,
        test_per_client=config.data.test_per_client,
        kernels=Kernels(e.vectorize, e.channels_last),
    )


@dataclass
class Outcome:
    result: SimulationResult
    config: ExperimentConfig  # as run: after privacy calibration
    run_id: str | None
    tracking_uri: str | None
    checkpoint: Path
    claim: PrivacyClaim  # what the run may say about privacy; every ε comes from it
    interrupted: bool = False  # stopped by SIGINT/SIGTERM after a round, checkpoint written
    run_page: str | None = None  # the MLflow run's page under `mlflow ui` (default port)

    @property
    def final_accuracy(self) -> float | None:
        evals = [r.test_accuracy for r in self.result.history if r.test_accuracy is not None]
        return evals[-1] if evals else None

    @property
    def epsilon(self) -> float:
        """The accountant's final ε (∞ for a run without one: check ``claim.dp_valid``)."""
        return final_epsilon(self.result.history)

    @property
    def epsilon_vs_server(self) -> float | None:
        values = [r.metrics.get("epsilon_vs_server") for r in self.result.history]
        return values[-1] if values else None

    def privacy_line(self) -> str:
        """The run's final privacy statement for the terminal."""
        claim = self.claim
        if not claim.private:
            return "privacy: none (non-private run)"
        if not claim.dp_valid:
            return f"privacy: ε not available ({claim.status})"
        line = (
            f"privacy spent: ε = {self.epsilon:.3f} at δ = {claim.delta:g} "
            f"({claim.accounting_text})"
        )
        if claim.client_placed and self.epsilon_vs_server is not None:
            line += (
                f"; against a server that sees each upload: ε = {self.epsilon_vs_server:.4g} "
                f"(per-client σ {claim.client_noise_multiplier:.4g})"
            )
        return line


def _start_tracking(
    config: ExperimentConfig,
    claim: PrivacyClaim,
    store: ShardStore,
    run_id: str | None,
    parent_run_id: str | None,
):
    # MLflow and matplotlib load here, on the opening thread, not before the rounds can start.
    from cluster.tracking import MlflowTracker, flatten
    from datasets.partition_report import write_partition_report

    if run_id is not None:
        return MlflowTracker.resume(run_id)
    tags = {
        "algorithm": config.algorithm.name,
        "task": config.task,
        "store": store.path.name,
        **claim.tags(),
    }
    if parent_run_id is not None:  # MLflow's UI nests the run under its parent
        tags["mlflow.parentRunId"] = parent_run_id
    tracker = MlflowTracker(
        config.tracking.experiment, config.tracking.run_name, flatten(config.to_dict()), tags
    )
    with tempfile.TemporaryDirectory() as tmp:
        tracker.log_files(write_partition_report(store.class_counts(), tmp), "partition")
    return tracker


def _tracking_in_background(
    config: ExperimentConfig,
    store: ShardStore,
    run_id: str | None,
    parent_run_id: str | None,
) -> Future | None:
    """Open the MLflow run on a thread while Ray and the actors start (seconds each: a fresh
    database migrates its schema); None when tracking is off."""
    if not config.tracking.enabled:
        return None
    claim = privacy_claim(config, config.build_algorithm(), store.client_sizes)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-open")
    opening = pool.submit(_start_tracking, config, claim, store, run_id, parent_run_id)
    pool.shutdown(wait=False)
    return opening


def _abandon(opening: Future | None, status: str = "FAILED") -> None:
    """End a run that failed (or was killed) after its MLflow run was opened."""
    if opening is not None and opening.exception() is None:
        opening.result().end(status)


class OpeningRun:
    """The run's MLflow tracker while it opens on a thread (importing MLflow, a fresh SQLite
    store's schema, the partition report: seconds of a short run): the rounds start at once
    and their records wait here, in order, until the run exists. What needs the run itself —
    its id, which names the checkpoint; the final artifacts — waits for it (``tracker``)."""

    def __init__(self, opening: Future, on_open: Callable[[Any], None]):
        self._opening = opening
        self._on_open = on_open
        self._waiting: list[tuple[RoundRecord, int]] = []  # (record, when: ms since the epoch)
        self._tracker = None

    def log_round(self, record: RoundRecord) -> None:
        if self._tracker is None and not self._opening.done():
            self._waiting.append((record, int(time.time() * 1000)))
        else:
            self.tracker().log_round(record)

    def tracker(self):
        """The open ``MlflowTracker`` (waiting for it), with every waiting record handed on."""
        if self._tracker is None:
            self._tracker = self._opening.result()
            self._on_open(self._tracker)
            for record, when in self._waiting:
                self._tracker.log_round(record, when)
            self._waiting.clear()
        return self._tracker


def run_experiment(
    config: ExperimentConfig,
    on_round: Callable[[RoundRecord], None] = lambda r: None,
    resume: dict | None = None,
    say: Callable[[str], None] = lambda message: None,
    calibrate: bool = True,
    verbose: bool = False,
    parent_run_id: str | None = None,
) -> Outcome:
    """Run (or, given a loaded checkpoint, continue) one experiment end to end.

    ``say`` receives one-line notices (calibration, privacy warnings) for the terminal. A fresh
    run calibrates σ or the rounds first (``privacy.calibrate``); a resumed run keeps the values
    its checkpoint was calibrated with; so does a caller that calibrated already
    (``calibrate=False``). Ray's own log lines reach the terminal only when ``verbose``.
    ``parent_run_id``: the MLflow run this one is listed under (``compare``'s parent run).
    """
    preflight(config)
    if resume is None and calibrate:
        config = calibrate_with_message(config, say)
    if config.build_algorithm().privacy_unit != "none":
        for warning in privacy_warnings(config):
            say(f"warning: {warning}")
    store, _ = open_store(config)
    resumed_run = resume.get("run_id") if resume is not None else None
    opening = _tracking_in_background(config, store, resumed_run, parent_run_id)
    try:
        executor = make_executor(config, store, say, verbose)
    except BaseException:
        _abandon(opening)
        raise
    every = config.checkpoint.every

    def announce(run_id: str | None) -> None:
        path = checkpoint_path(config, run_id)
        say(f"checkpoint: {path} ({f'every {every} rounds and ' if every else ''}at the end)")

    run = None
    if opening is None:
        announce(None)
    else:
        run = OpeningRun(opening, lambda tracker: announce(tracker.run_id))
    try:
        sim = Simulation(config, store, executor)
        for notice in sim.claim.notices():
            say(notice)
        if resume is not None:
            sim.load_state_dict(resume["simulation"])

        def checkpoint_here() -> Path:
            run_id = None
            if run is not None:  # named by the MLflow run, whose rounds are all in it first
                tracker = run.tracker()
                tracker.flush()
                run_id = tracker.run_id
            path = checkpoint_path(config, run_id)
            save_checkpoint(path, sim.state_dict(), config.to_dict(), run_id)
            return path

        def report(record: RoundRecord) -> None:
            if run is not None:
                run.log_round(record)
            if every and record.round % every == 0:
                checkpoint_here()
            on_round(record)

        with GracefulStop(say) as stop:
            result = sim.run(report, lambda: stop.reason)
        interrupted = stop.reason is not None
        path = checkpoint_here()
        tracker = run.tracker() if run is not None else None
        if tracker is not None:
            ParamLayout.of(sim.model).load_into(sim.model, result.params)
            eps = final_epsilon(result.history)
            tracker.set_tags({"stop_reason": result.stop_reason, "checkpoint": str(path)})
            summary = {
                "rounds": len(result.history),
                "stop_reason": result.stop_reason,
                "epsilon": eps if math.isfinite(eps) else None,
                "epsilon_vs_server": sim.claim.epsilon_vs_server(len(result.history)),
                "dp_valid": sim.claim.dp_valid,
                "delta": sim.claim.delta,
            }
            report = privacy_report(config, sim.claim, len(result.history), eps)
            status = "KILLED" if interrupted else "FINISHED"
            tracker.finish(config.to_dict(), result.history, sim.model, summary, report, status)
    except BaseException as error:
        # A second Ctrl-C is the user's stop, not a failure.
        _abandon(opening, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        executor.close()
    run_id = tracker.run_id if tracker else None
    uri = tracker.uri if tracker else None
    page = tracker.run_page() if tracker else None
    return Outcome(result, config, run_id, uri, path, sim.claim, interrupted, page)
