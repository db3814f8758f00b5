"""How heterogeneous a partition is: summary statistics, a terminal summary and plots.

``partition_summary`` takes either each client's labels or the (clients × classes) count matrix
(a store's ``class_counts()``); ``write_partition_report`` writes
``class_histogram.png``, ``client_sizes.png`` and ``partition_summary.json``. Plots use the Agg
canvas directly (no pyplot, no global backend switch), so this is safe in headless workers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from datasets.partition import client_class_counts

MAX_HEATMAP_CLIENTS = 100


def class_counts(client_labels: list[np.ndarray], num_classes: int) -> np.ndarray:
    """The (clients × classes) count matrix of per-client label arrays (labels in 0..K-1)."""
    labels = [np.asarray(y, dtype=np.int64) for y in client_labels]
    offsets = np.cumsum([0, *map(len, labels)])
    y = np.concatenate(labels) if labels else np.empty(0, dtype=np.int64)
    return client_class_counts(y, offsets, num_classes)


def _as_counts(data: list[np.ndarray] | np.ndarray, num_classes: int) -> np.ndarray:
    if isinstance(data, np.ndarray) and data.ndim == 2:
        if data.shape[1] != num_classes:
            raise ValueError(f"count matrix has {data.shape[1]} columns, expected {num_classes}")
        return data.astype(np.int64)
    return class_counts(list(data), num_classes)


def partition_summary(client_labels: list[np.ndarray] | np.ndarray, num_classes: int) -> dict:
    """Size, class-coverage and label-entropy statistics of a partition (JSON-ready).

    ``client_labels`` is a list of per-client label arrays, or a 2-D (clients × classes) count
    matrix. Entropies are of each client's empirical label distribution, in nats; the normalised
    entropy divides by log K (1: all classes equally, 0: one class). Clients with no rows have
    no label distribution and are left out of the entropy means (``empty_clients`` counts them).
    """
    counts = _as_counts(client_labels, num_classes)
    if len(counts) == 0:
        raise ValueError("a partition summary needs at least one client")
    sizes = counts.sum(axis=1)
    present = (counts > 0).sum(axis=1)
    nonempty = sizes > 0
    p = counts[nonempty] / sizes[nonempty, None]
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)
    mean_entropy = float(entropy.mean()) if len(entropy) else 0.0
    log_k = math.log(num_classes) if num_classes > 1 else 0.0
    return {
        "num_clients": int(len(counts)),
        "num_classes": int(num_classes),
        "total_rows": int(sizes.sum()),
        "empty_clients": int((~nonempty).sum()),
        "sizes": {
            "min": int(sizes.min()),
            "median": float(np.median(sizes)),
            "max": int(sizes.max()),
            "mean": float(sizes.mean()),
        },
        "classes_per_client": {
            "mean": float(present.mean()),
            "min": int(present.min()),
            "max": int(present.max()),
        },
        "label_entropy": {
            "mean_nats": mean_entropy,
            "mean_normalized": mean_entropy / log_k if log_k > 0 else 0.0,
        },
    }


def format_summary(summary: dict) -> str:
    """A few lines for the terminal."""
    s, c, e = summary["sizes"], summary["classes_per_client"], summary["label_entropy"]
    lines = [
        f"partition: {summary['num_clients']:,} clients, {summary['num_classes']} classes, "
        f"{summary['total_rows']:,} rows",
        f"  client size: min {s['min']:,}, median {s['median']:,.0f}, max {s['max']:,} "
        f"(mean {s['mean']:,.1f})",
        f"  classes per client: mean {c['mean']:.2f} (min {c['min']}, max {c['max']})",
        f"  label entropy: mean {e['mean_nats']:.3f} nats = {e['mean_normalized']:.3f} of log K",
    ]
    if summary.get("empty_clients"):
        lines.append(f"  empty clients: {summary['empty_clients']}")
    return "\n".join(lines)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def write_partition_report(
    counts: np.ndarray, out_dir: str | Path, max_clients: int = MAX_HEATMAP_CLIENTS
) -> list[Path]:
    """Write the heatmap, the size histogram and the JSON summary; returns their paths.

    The heatmap shows every client when there are at most ``max_clients``, else ``max_clients``
    evenly spaced clients (the title says so). The JSON is ``partition_summary(counts, K)``.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2:
        raise ValueError(f"counts must be (clients, classes), got shape {counts.shape}")
    num_clients, num_classes = counts.shape
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = partition_summary(counts, num_classes)

    shown = np.arange(num_clients)
    title = f"class counts per client ({num_clients} clients)"
    if num_clients > max_clients:
        shown = np.unique(np.linspace(0, num_clients - 1, max_clients).round().astype(np.int64))
        title = f"class counts, sample of {len(shown)} of {num_clients} clients (evenly spaced)"
    fig = Figure(figsize=(max(4.0, 0.35 * num_classes + 2), max(3.0, 0.08 * len(shown) + 1.5)))
    ax = fig.add_subplot()
    image = ax.imshow(counts[shown], aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client" if len(shown) == num_clients else "client (sampled)")
    # Tick labels are client ids, also when the rows are a sample.
    ticks = np.arange(len(shown)) if len(shown) <= 30 else np.linspace(0, len(shown) - 1, 10)
    ticks = np.unique(ticks.round().astype(np.int64))
    ax.set_yticks(ticks, [str(int(shown[t])) for t in ticks])
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="rows")
    fig.tight_layout()
    paths = [_save(fig, out / "class_histogram.png")]

    sizes = counts.sum(axis=1)
    fig = Figure(figsize=(5, 3.5))
    ax = fig.add_subplot()
    ax.hist(sizes, bins=max(1, min(50, len(np.unique(sizes)))), color="tab:blue")
    ax.set_xlabel("client size (rows)")
    ax.set_ylabel("clients")
    ax.set_title(
        f"client sizes: min {sizes.min()}, median {np.median(sizes):.0f}, max {sizes.max()}",
        fontsize=9,
    )
    fig.tight_layout()
    paths.append(_save(fig, out / "client_sizes.png"))

    json_path = out / "partition_summary.json"
    json_path.write_text(json.dumps(summary, indent=1))
    paths.append(json_path)
    return paths
