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

import torch

FORMAT_VERSION = 1


def save_checkpoint(path: Path, simulation_state: dict, config: dict, run_id: str | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format_version": FORMAT_VERSION,
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
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    payload = torch.load(path, weights_only=False, map_location="cpu")
    if payload.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {payload.get('format_version')} unsupported")
    return payload
