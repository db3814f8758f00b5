"""``python -m cluster landscape CHECKPOINT``: loss-landscape slices around a run's model.

    python -m cluster landscape checkpoints/RUN.pt [--dims 2] [--steps 21] [--span 1.0]
        [--slices 1] [--split train] [--rows 2000] [--seed 0] [--out DIR] [--no-mlflow]

reads the model a run checkpointed (its config names the store and the task), evaluates the loss on
a grid along one or two filter-normalised random directions (``cluster.analysis.landscape``), prints
the sharpness (``--slices``: mean ± std over independent slices), writes ``landscape.json`` and
``landscape.png`` to ``--out`` (default: ``<checkpoint>-landscape/`` beside it, or in the working
directory for a checkpoint in an object store) and, when the checkpoint's run was tracked, logs both
to that MLflow run under ``landscape/``. The same ``--seed`` draws the same Gaussian directions for
every run of the same model, each normalised to that run's own filters.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from datasets.locations import parse_location


def add_parser(commands, help_text: str) -> None:
    p = commands.add_parser(
        "landscape",
        help=help_text,
        description="Loss on a grid around a checkpoint's model along filter-normalised random "
        "directions (Li et al. 2018), as the DP-FedSAM and DP-FedPGN papers plot flatness.",
    )
    p.add_argument("checkpoint", help="checkpoint file written by a run")
    p.add_argument("--dims", type=int, choices=[1, 2], default=1, help="1-D curve or 2-D surface")
    p.add_argument("--steps", type=int, default=21, help="grid points per axis, odd (default 21)")
    p.add_argument("--span", type=float, default=1.0, help="grid from -span to span (default 1)")
    p.add_argument("--split", choices=["train", "test"], default="train", help="rows evaluated")
    p.add_argument("--rows", type=int, default=2000, help="seeded subset size (default 2000)")
    p.add_argument("--slices", type=int, default=1, help="independent slices, averaged (1)")
    p.add_argument("--seed", type=int, default=0, help="directions and subset (default 0)")
    p.add_argument("--out", type=Path, help="output directory")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to the run")
    p.set_defaults(handler=run)


# Model evaluations one command may ask for (--slices × --steps ** --dims): the default is
# 21 ** 2 = 441 a slice; a grid past this is a typo, not a plot (10⁶ steps in 2-D held a 7 TiB
# grid).
MAX_POINTS = 100_000


def _check(args: argparse.Namespace) -> None:
    from cluster.config import ConfigError

    if args.steps < 3 or args.steps % 2 == 0:
        raise ConfigError("--steps", args.steps, "an odd number >= 3, so the grid holds the model")
    points = args.slices * args.steps**args.dims
    if args.slices >= 1 and points > MAX_POINTS:
        raise ConfigError(
            "--steps",
            args.steps,
            f"--slices {args.slices} × --steps {args.steps} ** --dims {args.dims} = {points} "
            f"model evaluations, over {MAX_POINTS}; lower --steps (at most "
            f"{_largest_steps(args.slices, args.dims)} here) or --slices",
        )
    if not (args.span > 0 and math.isfinite(args.span)):
        raise ConfigError("--span", args.span, "must be > 0 (e.g. 1.0)")
    if args.slices < 1:
        raise ConfigError("--slices", args.slices, "must be >= 1 (e.g. 5 for a mean ± std)")
    if args.rows < 1:
        raise ConfigError("--rows", args.rows, "must be >= 1 (e.g. 2000)")


def _largest_steps(slices: int, dims: int) -> int:
    """The largest odd --steps whose grid keeps ``slices`` slices within ``MAX_POINTS``."""
    steps = int((MAX_POINTS / slices) ** (1 / dims))
    while slices * steps**dims > MAX_POINTS:
        steps -= 1
    return steps if steps % 2 else steps - 1


def _rows(store, split: str, count: int, seed: int):
    """A seeded subset of ``count`` rows of the split, in the model's input form."""
    import numpy as np
    import torch

    arrays = store.train_rows() if split == "train" else store.test_rows()
    total = len(arrays.y)
    index = np.sort(np.random.default_rng(seed).permutation(total)[: min(count, total)])
    return torch.tensor(arrays.x[index]), torch.tensor(arrays.y[index], dtype=torch.long)


def run(args: argparse.Namespace) -> int:
    _check(args)
    import torch

    from actors.client_host import build_model
    from algorithms.layout import ParamLayout
    from cluster.analysis.landscape import filter_normalized_direction, loss_slice
    from cluster.runtime.checkpoint import open_checkpoint
    from cluster.runtime.store import check_data, open_store
    from datasets.tasks import TASKS

    checkpoint, config = open_checkpoint(args.checkpoint)  # checked: its params fit the model
    check_data(config)  # as `run` checks it: an object store's credentials, endpoint, bucket
    store, _ = open_store(config)
    model = build_model(store, config.task)
    params = checkpoint["simulation"]["params"].to(torch.float32)
    layout = ParamLayout.of(model)
    generator = torch.Generator().manual_seed(args.seed)
    x, y = _rows(store, args.split, args.rows, args.seed)
    x = TASKS[config.task].preprocess(x)
    coordinates = [args.span * (2 * i / (args.steps - 1) - 1) for i in range(args.steps)]
    rounds = checkpoint["simulation"]["rounds_done"]
    points = args.steps**args.dims
    print(
        f"landscape of {config.algorithm.name} on {config.task} after round {rounds}: "
        f"{args.slices} × {points} points, {len(y)} {args.split} rows",
        flush=True,
    )
    start, done, total = time.perf_counter(), [0], args.slices * points

    def progress() -> None:  # a line at every tenth of the points
        done[0] += 1
        if done[0] * 10 // total > (done[0] - 1) * 10 // total:
            print(f"  {done[0]}/{total} points, {time.perf_counter() - start:.1f} s", flush=True)

    slices = []
    for _ in range(args.slices):
        directions = [
            filter_normalized_direction(layout, params, generator) for _ in range(args.dims)
        ]
        slices.append(loss_slice(model, params, directions, coordinates, x, y, progress=progress))
    summary = _summary(slices)
    print("  " + _describe(summary), flush=True)
    out = args.out or _default_out(args.checkpoint)
    files = _write(out, args, config, rounds, slices, summary, rows=len(y))
    print(f"wrote {', '.join(str(f) for f in files)}", flush=True)
    run_id = checkpoint.get("run_id")
    if run_id and not args.no_mlflow:
        _log_to_run(run_id, files)
    return 0


def _default_out(checkpoint: str) -> Path:
    """``<checkpoint>-landscape/`` beside a local checkpoint; for one in an object store, in
    the working directory (the plots are local files)."""
    location = parse_location(checkpoint)
    stem = Path(location.name).stem + "-landscape"
    return location.with_name(stem) if isinstance(location, Path) else Path(stem)


def _summary(slices: list) -> dict[str, float]:
    """Each sharpness number's mean over the slices, and its std where there are several."""
    import numpy as np

    each = [s.sharpness() for s in slices]
    summary = {key: float(np.mean([e[key] for e in each])) for key in each[0]}
    if len(slices) > 1:
        summary |= {f"{k}_std": float(np.std([e[k] for e in each], ddof=1)) for k in each[0]}
    return summary


def _describe(summary: dict[str, float]) -> str:
    """``center_loss 0.36, edge_loss_increase 0.33 ± 0.08, …`` (± where slices vary)."""
    parts = []
    for key, value in summary.items():
        if key.endswith("_std"):
            continue
        std = summary.get(f"{key}_std")
        parts.append(f"{key} {value:.4g}" + (f" ± {std:.2g}" if std else ""))
    return ", ".join(parts)


def _write(
    out: Path, args, config, rounds: int, slices: list, summary: dict, rows: int
) -> list[Path]:
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    record = {
        "algorithm": config.algorithm.name,
        "task": config.task,
        "rounds_done": rounds,
        "dims": args.dims,
        "normalization": "filter (Li et al. 2018); 1-D tensors zero",
        "split": args.split,
        "rows": rows,  # the split may hold fewer than --rows
        "seed": args.seed,
        "coordinates": slices[0].coordinates,
        "slices": [
            {"loss": s.loss.tolist(), "accuracy": s.accuracy.tolist(), **s.sharpness()}
            for s in slices
        ],
        **summary,
    }
    (out / "landscape.json").write_text(json.dumps(record, indent=1) + "\n")
    fig = Figure(figsize=(6, 4.5))
    ax = fig.add_subplot()
    coordinates = slices[0].coordinates
    if args.dims == 1:
        for s in slices:
            ax.plot(coordinates, s.loss, marker=".", alpha=0.8)
        ax.set_xlabel("α (filter-normalised direction)")
        ax.set_ylabel(f"{args.split} loss")
    else:  # the first surface; the others are in the JSON
        contour = ax.contour(coordinates, coordinates, slices[0].loss.T, levels=20)
        ax.clabel(contour, fontsize=6)
        ax.plot([0], [0], "k+", markersize=10)  # the model
        ax.set_xlabel("α")
        ax.set_ylabel("β")
    ax.set_title(f"{config.algorithm.name}, {config.task}, round {rounds}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "landscape.png", dpi=100)
    return [out / "landscape.json", out / "landscape.png"]


def _log_to_run(run_id: str, files: list[Path]) -> None:
    """The run's artifacts under ``landscape/`` (where this shell's tracking URI points)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from cluster.config import ConfigError
    from cluster.tracking.settings import tracking_uri

    uri = tracking_uri()
    client = MlflowClient(uri)
    try:
        client.get_run(run_id)
    except MlflowException:
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            uri,
            f"the checkpoint's run {run_id} is not in this store (the files are written): set "
            "MLFLOW_TRACKING_URI to the store the run used, or pass --no-mlflow",
        ) from None
    for path in files:
        client.log_artifact(run_id, str(path), "landscape")
    print(f"logged to MLflow run {run_id} under landscape/", flush=True)
