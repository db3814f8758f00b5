"""Driver checkpoints: the Simulation's state plus the config and the MLflow run to continue.

Written atomically (temporary file, then rename), so a crash mid-write never leaves a corrupt
checkpoint behind. Resuming restores the server state, the accountant, the round history and
every client's state (e.g. SCAFFOLD c_i) and reaches bit-identical parameters, because all
randomness is keyed by (seed, round, client) rather than carried in generator state.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from algorithms.presets import SKETCH_PRESETS
from algorithms.sketch import HASH_FAMILY

if TYPE_CHECKING:
    from cluster.config import ExperimentConfig

FORMAT_VERSION = 1


def checkpoint_path(config: ExperimentConfig, run_id: str | None) -> Path:
    """A tracked run's checkpoint is named by its MLflow run; an untracked one by what it runs."""
    name = run_id or f"{config.tracking.experiment}-{config.algorithm.name}-seed{config.seed}"
    return config.checkpoint_dir / f"{name}.pt"


def save_checkpoint(path: Path, simulation_state: dict, config: dict, run_id: str | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format_version": FORMAT_VERSION,
        "sketch_hash_family": HASH_FAMILY,
        "config": config,
        "run_id": run_id,
        "simulation": simulation_state,
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path) -> dict:
    """The checkpoint at ``path``; a ``ConfigError`` (field CHECKPOINT) when there is none, it
    is not a checkpoint, or another version of this code wrote it."""
    from cluster.config import ConfigError

    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            "CHECKPOINT", str(path), "no such file; the run printed its checkpoint path at start"
        )
    try:
        payload = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as error:  # torch.load raises many types for a file it cannot read
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"not a checkpoint this code can read ({type(error).__name__}: {error}); pass a "
            "file written by `run` (checkpoints are written atomically, so a crash leaves the "
            "previous one intact)",
        ) from None
    version = payload.get("format_version") if isinstance(payload, dict) else None
    if version != FORMAT_VERSION:
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"checkpoint format {version}, this code reads format {FORMAT_VERSION}: resume it "
            "with the version of the code that wrote it (its MLflow run's git_commit tag), or "
            "start the run afresh",
        )
    family = payload.get("sketch_hash_family", "linear-buckets")
    if payload["config"]["algorithm"]["name"] in SKETCH_PRESETS and family != HASH_FAMILY:
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"its sketches were hashed with the {family} count-sketch hash of an earlier version, "
            f"this code hashes with {HASH_FAMILY} (algorithms/sketch.py): its momentum and error "
            "sketches cannot be continued; resume it with the version of the code that wrote it "
            "(its MLflow run's git_commit tag), or start the run afresh",
        )
    return payload
