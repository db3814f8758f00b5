"""``executor:``, ``checkpoint:``, ``tracking:``: where and how a run executes (never what it
computes: a resumed run may change these)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from cluster.config.errors import ConfigError, positive
from cluster.config.paths import configured_path

if TYPE_CHECKING:
    from cluster.config.experiment import ExperimentConfig


@dataclass
class ExecutorConfig:
    kind: Literal["local", "ray"] = "ray"
    num_actors: int = 2
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    address: str | None = None  # Ray address; None = $RAY_ADDRESS or an embedded Ray
    # Train each actor's clients of a round as vmapped batches where that is the same
    # computation (algorithms/vectorized.py): true wherever possible; auto where it is also
    # faster (on a GPU; on the CPU for models without convolutions); false never (one client at
    # a time, bit-identical across actor layouts). Vectorised is equal to sequential up to float
    # rounding, which for convolutions depends on how many clients share a batch.
    vectorize: Literal["auto", True, False] = "auto"
    # 2-D convolutions on NHWC views (algorithms.local.ModelObjective): auto = on the CPU.
    channels_last: Literal["auto", True, False] = "auto"


def in_ray_job() -> bool:
    """Launched by ``ray job submit``: Ray hands the entrypoint its job config in this variable."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


@dataclass
class CheckpointConfig:
    every: int = 10  # rounds between checkpoints; 0 = only at the end
    # $DPFL_CHECKPOINT_DIR, else this; relative: to the working directory, or in a Ray job to
    # the store root (a job's working directory is a temporary copy, deleted with the job)
    dir: str = "checkpoints"

    def resolved_dir(self, store_root: Path) -> Path:
        path = self.configured_path()
        if not path.is_absolute() and in_ray_job():
            path = store_root / path
        return path.resolve()

    def configured_path(self) -> Path:
        return configured_path("DPFL_CHECKPOINT_DIR", self.dir)


@dataclass
class TrackingConfig:
    enabled: bool = True
    experiment: str = "dpfl"
    run_name: str | None = None


# ----------------------------------------------------------------------------- checks


def validate_runtime(c: ExperimentConfig) -> None:
    e = c.executor
    positive("executor.num_actors", e.num_actors, "2")
    positive("executor.cpus_per_actor", e.cpus_per_actor, "1")
    g = e.gpus_per_actor
    if g < 0 or (g > 1 and g != int(g)):
        raise ConfigError(
            "executor.gpus_per_actor",
            g,
            "must be a fraction in [0, 1] or a whole number of GPUs, e.g. 0.25",
        )
    if e.num_actors > c.data.num_clients:
        raise ConfigError(
            "executor.num_actors",
            e.num_actors,
            f"more actors than the {c.data.num_clients} clients; lower it",
        )
    persistent = c.checkpoint.configured_path().is_absolute() or c.data.store_is_absolute
    if in_ray_job() and not persistent:
        raise ConfigError(
            "checkpoint.dir",
            c.checkpoint.dir,
            "this Ray job runs in a temporary copy of the working directory, deleted when the "
            "job ends, and so would its checkpoints and shards: set DPFL_CHECKPOINT_DIR or "
            "DPFL_STORE_ROOT to an absolute path (--runtime-env-json '{\"env_vars\": {...}}'), "
            "or checkpoint.dir to one",
        )
    if c.checkpoint.every < 0:
        raise ConfigError("checkpoint.every", c.checkpoint.every, "must be >= 0 (0: at the end)")
