"""A sweep's results: the table (one row per configuration, the mean ± std over its trials),
the per-trial rows, their markdown and the per-parameter plot (``cluster.analysis.sweep`` writes
them to the parent run and ``--out``), from each trial's ``TrialRecord``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.analysis.compare import mean_std
from cluster.analysis.sweep_spec import (
    SweepSpec,
    SweepTrial,
    Values,
    configuration,
    format_value,
    labels,
)


@dataclass
class TrialRecord:
    """One trial as the table shows it: run now, or found finished in MLflow (``resumed``)."""

    trial: SweepTrial
    name: str  # unique in the sweep: its key in every table
    digest: str
    status: str = "NOT RUN"
    run_id: str | None = None
    metric: float | None = None  # the selection metric's last evaluation
    test_accuracy: float | None = None
    epsilon: str = ""
    error: str = ""
    seconds: float = 0.0
    privacy: dict | None = None  # its TrialPrivacy
    resumed: bool = False
    repeat: int = 0  # earlier draws of the same configuration and seed (random search)


# A repeated draw's place among its configuration's draws, in the values that key its row.
DRAW = "draw"


def draw_values(record: TrialRecord) -> Values:
    """The values that key ``record``'s row: its configuration's, and for a random search's
    repeated draw of it, which draw (``DRAW``). Each draw is its own Q of Papernot–Steinke's
    bound, which covers the best of K draws ranked by each one's own score: a mean over two
    draws' runs would rank by several Q's outputs at once."""
    values = configuration(record.trial.values)
    return (*values, (DRAW, record.repeat)) if record.repeat else values


def configuration_values(values: Values) -> Values:
    """A row's values as config fields: without its ``DRAW``."""
    return tuple((f, v) for f, v in values if f != DRAW)


def configurations(records: list[TrialRecord]) -> dict[Values, list[TrialRecord]]:
    """The trials of each row (``draw_values``): a configuration's seeds and folds."""
    grouped: dict[Values, list[TrialRecord]] = {}
    for record in records:
        grouped.setdefault(draw_values(record), []).append(record)
    return grouped


def display_labels(records: list[TrialRecord]) -> dict[Values, str]:
    """Each configuration's label (``sweep_spec.labels``: distinct where the values are)."""
    grouped = list(configurations(records))
    return dict(zip(grouped, labels(grouped), strict=True))


def summarize(spec: SweepSpec, records: list[TrialRecord]) -> list[dict]:
    """One row per configuration (a random search's repeated draw of one: a row per draw), in
    the order of ``configurations(records)``; ``selected`` marks the best mean over seeds
    among those whose every trial finished."""
    rows = []
    shown = display_labels(records)
    for values, group in configurations(records).items():
        done = [r for r in group if r.status == "FINISHED" and r.metric is not None]
        metric = mean_std([r.metric for r in done]) if done else (None, None)
        tests = [r.test_accuracy for r in done if r.test_accuracy is not None]
        test = mean_std(tests) if tests else (None, None)
        rows.append(
            {"configuration": shown[values], **{f: v for f, v in values},
             "trials_finished": len(done), "trials": len(group),
             f"{spec.select.metric}_mean": metric[0], f"{spec.select.metric}_std": metric[1],
             "test_accuracy_mean": test[0], "test_accuracy_std": test[1],
             "epsilon": next((r.epsilon for r in done), ""), "selected": False}
        )  # fmt: skip
    complete = [r for r in rows if r["trials_finished"] == r["trials"]]
    if complete:
        key = f"{spec.select.metric}_mean"
        best = spec.select.best([r[key] for r in complete])
        next(r for r in complete if r[key] == best)["selected"] = True
    return rows


def trial_rows(records: list[TrialRecord], metric: str) -> list[dict]:
    shown = display_labels(records)
    return [
        {"trial": r.name, "configuration": shown[draw_values(r)],
         "seed": r.trial.seed,
         "status": r.status, "run_id": r.run_id or "", metric: r.metric,
         "test_accuracy": r.test_accuracy, "epsilon": r.epsilon, "seconds": round(r.seconds, 2),
         "resumed": r.resumed, "error": r.error}
        for r in records
    ]  # fmt: skip


def mean_std_cell(mean: float | None, std: float | None) -> str:
    return "—" if mean is None else f"{mean:.4f} ± {std:.4f}"


def markdown(spec: SweepSpec, rows: list[dict], records: list[TrialRecord]) -> str:
    metric = spec.select.metric
    fields = spec.fields
    header = f"| configuration | {' | '.join(fields)} | trials | {metric} | test accuracy | ε | |"
    lines = [header, "|---" * header.count(" |") + "|"]
    for r in rows:
        cells = " | ".join(format_value(r[f]) for f in fields)
        lines.append(
            f"| {r['configuration']} | {cells} | {r['trials_finished']}/{r['trials']} "
            f"| {mean_std_cell(r[f'{metric}_mean'], r[f'{metric}_std'])} "
            f"| {mean_std_cell(r['test_accuracy_mean'], r['test_accuracy_std'])} | {r['epsilon']} "
            f"| {'selected' if r['selected'] else ''} |"
        )
    failed = [r for r in records if r.status != "FINISHED"]
    lines += [f"\n{r.name}: {r.status} {r.error}".rstrip() for r in failed]
    return "\n".join(lines)


def plot_parameters(spec: SweepSpec, records: list[TrialRecord], path: Path) -> None:
    """The selection metric against each swept field: one dot per trial, the configurations'
    means over seeds joined (matplotlib's object API, as ``compare`` draws)."""
    from matplotlib.figure import Figure

    fields = spec.fields
    fig = Figure(figsize=(4.2 * len(fields), 3.6))
    for index, name in enumerate(fields):
        ax = fig.add_subplot(1, len(fields), index + 1)
        done = [r for r in records if r.status == "FINISHED" and r.metric is not None]
        xs = [dict(r.trial.values)[name] for r in done]
        # a number axis only where every value is one ([10, null] is a category axis)
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs)
        xs = xs if numeric else [str(x) for x in xs]
        ax.scatter(xs, [r.metric for r in done], alpha=0.5, label="trials")
        means: dict = {}
        for x, r in zip(xs, done, strict=True):
            means.setdefault(x, []).append(r.metric)
        points = sorted(means) if numeric else list(means)
        ax.plot(points, [sum(means[p]) / len(means[p]) for p in points], "k.-", label="mean")
        if numeric and points and min(points) > 0 and max(points) / min(points) >= 10:
            ax.set_xscale("log")
        ax.set(xlabel=name, ylabel=spec.select.metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
