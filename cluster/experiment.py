"""Assemble and run one experiment: data store → executor → Simulation → MLflow."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from algorithms.layout import ParamLayout
from cluster.config import ExperimentConfig
from cluster.executors import LocalExecutor, RayExecutor
from cluster.simulation import RoundRecord, Simulation, SimulationResult, final_epsilon
from datasets.sources import build_or_open_store
from datasets.store import ShardStore
from privacy.accountant import sampling_assumption


def open_store(config: ExperimentConfig) -> tuple[ShardStore, bool]:
    d = config.data
    params = {**asdict(d.synthetic), "num_users": d.num_clients} if d.source == "synthetic" else {}
    return build_or_open_store(
        d.resolved_store_root(), d.source, params, asdict(d.partition), d.num_clients, config.seed
    )


def make_executor(config: ExperimentConfig, store: ShardStore):
    algorithm = config.build_algorithm()
    e = config.executor
    if e.kind == "local":
        # In process, the driver is the one "actor": it gets the same thread budget.
        torch.set_num_threads(max(1, int(e.cpus_per_actor)))
        return LocalExecutor(store, config.task, algorithm, config.seed)
    from cluster.ray_runtime import check_resources, connect

    where = connect(e.address)
    if where == "embedded local Ray":
        check_resources(e.num_actors, e.cpus_per_actor, e.gpus_per_actor)
    return RayExecutor(
        store, config.task, algorithm, config.seed, e.num_actors, e.cpus_per_actor, e.gpus_per_actor
    )


@dataclass
class Outcome:
    result: SimulationResult
    run_id: str | None
    tracking_uri: str | None

    @property
    def final_accuracy(self) -> float | None:
        evals = [r.test_accuracy for r in self.result.history if r.test_accuracy is not None]
        return evals[-1] if evals else None

    @property
    def epsilon(self) -> float:
        return final_epsilon(self.result.history)


def privacy_tags(config: ExperimentConfig, sim: Simulation) -> dict[str, str]:
    if not sim.private:
        return {"privacy.unit": "none"}
    return {
        "privacy.unit": "client",
        "privacy.accountant": config.privacy.accountant,
        "privacy.assumption": sampling_assumption(config.cohort.sampling),
        "privacy.delta": f"{config.delta:g}",
        "privacy.noise_multiplier": f"{sim.noise_multiplier:g}",
        "privacy.sample_rate": f"{config.sample_rate:g}",
    }


def run_experiment(
    config: ExperimentConfig, on_round: Callable[[RoundRecord], None] = lambda r: None
) -> Outcome:
    store, _ = open_store(config)
    executor = make_executor(config, store)
    tracker = None
    try:
        sim = Simulation(config, store, executor)
        if config.tracking.enabled:
            from cluster.tracking import MlflowTracker, flatten

            tags = {
                "algorithm": config.algorithm.name,
                "task": config.task,
                "store": store.path.name,
                **privacy_tags(config, sim),
            }
            tracker = MlflowTracker(
                config.tracking.experiment,
                config.tracking.run_name,
                flatten(config.to_dict()),
                tags,
            )

        def report(record: RoundRecord) -> None:
            if tracker is not None:
                tracker.log_round(record)
            on_round(record)

        result = sim.run(report)
        if tracker is not None:
            ParamLayout.of(sim.model).load_into(sim.model, result.params)
            eps = final_epsilon(result.history)
            tracker.set_tags({"stop_reason": result.stop_reason})
            tracker.finish(
                config.to_dict(),
                result.history,
                sim.model,
                {
                    "rounds": len(result.history),
                    "stop_reason": result.stop_reason,
                    "epsilon": eps if math.isfinite(eps) else None,
                    "delta": config.delta,
                },
            )
    except BaseException:
        if tracker is not None:
            tracker.fail()
        raise
    finally:
        executor.close()
    return Outcome(result, tracker.run_id if tracker else None, tracker.uri if tracker else None)
