"""A comparison's accuracy against communication (DPSFL's Fig. 5): one point per run label.

Each run's communication is the last round's ``communication_bytes``
(``cluster.runtime.simulation``): every byte so far, both ways, Σ_t (upload_bytes_total_t +
download_bytes_t · ``|cohort_t|``), with a client's upload its sketch, sparse or dense update and
any extra scalar (DPSFL-AC's noisy bit), and its download the dense model or the sparse Δ. A
label's point is the mean over its seeds of those bytes and of the final test accuracy; its error
bar the accuracies' standard deviation. Labels of one preset (``algorithm.name``) are joined by a
line in order of bytes, so the compression levels of a preset read as a curve.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

COMMUNICATION_PLOT = "compare_communication.png"


@dataclass(frozen=True)
class CommunicationPoint:
    label: str
    preset: str  # algorithm.name: the series the point belongs to
    total_bytes: float  # mean over seeds
    accuracy: float  # mean final test accuracy over seeds
    accuracy_std: float  # over seeds (0 for one)


def communicated_bytes(outcome) -> float | None:
    """Every byte ``outcome``'s run sent, both ways (None: its rounds logged no bytes)."""
    history = outcome.result.history
    if not history:
        return None
    return history[-1].metrics.get("communication_bytes")


def communication_points(results: dict[str, list]) -> list[CommunicationPoint]:
    """One point per label whose runs logged bytes and a test accuracy (the others are left
    out); ``results``: label → its outcomes (one per seed)."""
    points = []
    for label, outcomes in results.items():
        measured = [
            (communicated_bytes(o), o.final_accuracy)
            for o in outcomes
            if communicated_bytes(o) is not None and o.final_accuracy is not None
        ]
        if not measured:
            continue
        accuracies = [accuracy for _, accuracy in measured]
        points.append(
            CommunicationPoint(
                label,
                outcomes[0].config.algorithm.name,
                statistics.mean(total for total, _ in measured),
                statistics.mean(accuracies),
                statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
            )
        )
    return points


def accuracy_against_communication(results: dict[str, list], out: Path) -> Path | None:
    """Final test accuracy against total bytes communicated (log scale), written to
    ``out``/compare_communication.png; None (and no file) when no run logged bytes."""
    from matplotlib.figure import Figure

    points = communication_points(results)
    if not points:
        return None
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for preset in dict.fromkeys(p.preset for p in points):
        series = sorted((p for p in points if p.preset == preset), key=lambda p: p.total_bytes)
        ax.errorbar(
            [p.total_bytes for p in series],
            [p.accuracy for p in series],
            yerr=[p.accuracy_std for p in series],
            marker="o",
            capsize=3,
            label=preset,
        )
        for p in series:
            ax.annotate(
                p.label,
                (p.total_bytes, p.accuracy),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xscale("log")
    ax.set_xlabel("bytes communicated, both ways (all rounds, all clients)")
    ax.set_ylabel("final test accuracy (mean over seeds)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = out / COMMUNICATION_PLOT
    fig.savefig(path, dpi=100)
    return path
