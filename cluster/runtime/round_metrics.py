"""What the rounds' records report: one round's diagnostics from its clients' scalars, the
communication budget the rounds spent, and the run's final ε."""

from __future__ import annotations

import math

import numpy as np

from algorithms.aggregate import PartialAggregate
from cluster.config import ExperimentConfig
from cluster.runtime.records import RoundRecord

# Per-client stats whose round mean is logged under another name.
STAT_METRICS = {
    "alpha": "mean_alpha",
    "post_clip_norm": "mean_post_clip_norm",
    "client_clip_norm": "mean_client_clip_norm",
    "vectorized": "vectorized_fraction",  # of the clients: trained together (ClientHost)
}


def round_metrics(total: PartialAggregate) -> dict[str, float]:
    """Diagnostics from the per-client scalars of one round."""
    reports = [r for r in total.reports if not r.dropped]
    metrics = {"clients": float(total.count), "dropped_updates": float(total.dropped)}
    if reports:
        norms = np.array([r.pre_clip_norm for r in reports])
        metrics["mean_pre_clip_norm"] = float(norms.mean())
        with np.errstate(invalid="ignore"):  # an ∞ norm (a diverged client) interpolates to nan
            for q in (10, 50, 90):
                metrics[f"pre_clip_norm_p{q}"] = float(np.percentile(norms, q))
        clipped = np.array([r.clipped for r in reports])
        if not np.isnan(clipped).all():
            metrics["clip_fraction"] = float(np.nanmean(clipped))
        for name in dict.fromkeys(k for r in reports for k in r.stats):  # α_i, kept fraction, …
            values = [r.stats[name] for r in reports if name in r.stats]
            metrics[STAT_METRICS.get(name, name)] = float(np.mean(values))
            if name == "upload_bytes":  # and what the whole cohort sent this round
                metrics["upload_bytes_total"] = float(np.sum(values))
        trained = [r for r in reports if math.isfinite(r.train_loss)]  # not warm-up reports
        if trained:
            metrics["train_loss"] = float(np.mean([r.train_loss for r in trained]))
            metrics["train_accuracy"] = float(np.mean([r.train_accuracy for r in trained]))
    return metrics


def byte_budget_spent(
    config: ExperimentConfig, metrics: dict[str, float] | None, rounds_done: int
) -> str | None:
    """The stop reason once the cumulative ``communication_bytes`` in ``metrics``, the metrics
    of round ``rounds_done`` (None: no round yet), has reached ``config.stop_at_bytes`` (None:
    below it, or no budget). The round that reaches it is the run's last: it is evaluated,
    and no round follows."""
    budget = config.stop_at_bytes
    spent = (metrics or {}).get("communication_bytes", 0.0)
    if budget is None or spent < budget:
        return None
    return (
        f"communication budget spent: {spent:,.0f} bytes up and down after round {rounds_done} "
        f"(stop_at_bytes = {budget:,.0f})"
    )


def final_epsilon(history: list[RoundRecord]) -> float:
    eps = [r.epsilon for r in history if r.epsilon is not None]
    return eps[-1] if eps else math.inf
