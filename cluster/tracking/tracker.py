"""One MLflow run, written from the tracking process (``cluster.tracking.service``, DESIGN §8).

Default store: ``sqlite:///mlflow.db`` in the working directory; ``MLFLOW_TRACKING_URI``
overrides it. Rounds' metrics go in few ``log_batch`` calls (``log_rounds``); artifacts at the
end: the resolved config, accuracy and ε curves (PNG), the per-round history (JSON) and the
final model. Nothing here imports torch: the process that runs this module only writes to MLflow.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from cluster.tracking.settings import ARTIFACT_TIMEOUT_VARIABLE, sqlite_path

if TYPE_CHECKING:
    from cluster.runtime.records import RoundRecord

# MLflow 3's experiment type: "custom_model_development" is its classic machine-learning view.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
METRICS_PER_BATCH = 1000  # MLflow's limit per log_batch call
PARAM_CHARS = 6000  # MLflow refuses a longer param value
_PACKAGES = ("torch", "ray", "mlflow", "opacus", "numpy", "pyarrow")


def logged_param(value: str) -> str:
    """A param's value as the run logs it (cut to ``PARAM_CHARS``)."""
    return value[:PARAM_CHARS]


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict[str, str]:
    tags = {"version.python": platform.python_version()}
    for package in _PACKAGES:
        try:
            tags[f"version.{package}"] = version(package)
        except PackageNotFoundError:
            tags[f"version.{package}"] = "absent"
    return tags


def _artifact_location(uri: str, experiment: str) -> str | None:
    """Keep artifacts next to a SQLite store (a Ray job's working directory is temporary)."""
    database = sqlite_path(uri)
    if database is None:
        return None
    return (database.resolve().parent / "mlruns" / experiment).as_uri()


# Known only once a lost round is recomputed (``Simulation._recovered``).
RECOVERY_METRICS = frozenset({"recovery_seconds", "rounds_replayed"})


class MlflowTracker:
    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str | None,
        params: dict[str, str],
        tags: dict[str, str],
    ):
        self.uri = uri
        self.client = MlflowClient(uri)
        self.experiment_id = self._experiment(experiment)
        all_tags = {"git_commit": git_commit(), **_versions(), **tags}
        self.run_id = self.client.create_run(
            self.experiment_id, run_name=run_name, tags=all_tags
        ).info.run_id
        items = [Param(k, logged_param(v)) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def _experiment(self, name: str) -> str:
        """The experiment's id, created on first use, marked as model training so that MLflow's
        UI shows runs, metrics and charts (MLflow 3 otherwise offers its GenAI views)."""
        found = self.client.get_experiment_by_name(name)
        if found is None:
            location = _artifact_location(self.uri, name)
            return self.client.create_experiment(name, location, EXPERIMENT_KIND)
        if EXPERIMENT_KIND.items() - found.tags.items():
            for key, value in EXPERIMENT_KIND.items():
                self.client.set_experiment_tag(found.experiment_id, key, value)
        return found.experiment_id

    @classmethod
    def resume(cls, uri: str, run_id: str) -> MlflowTracker:
        """Continue an existing run (a resumed checkpoint logs into the same run)."""
        tracker = cls.__new__(cls)
        tracker.uri = uri
        tracker.client = MlflowClient(uri)
        tracker.run_id = run_id
        tracker.experiment_id = tracker.client.get_run(run_id).info.experiment_id
        tracker.client.update_run(run_id, status="RUNNING")
        # Rounds logged after the checkpoint (a crash) are recomputed bit for bit on resume;
        # they are not logged twice.
        history = tracker.client.get_metric_history(run_id, "seconds_per_round")
        tracker.logged_through = max((m.step for m in history), default=0)
        return tracker

    def log_files(self, paths: list[Path], artifact_path: str | None) -> None:
        """Upload ``paths``, each try under the tracking process's artifact timeout (see
        ``ARTIFACT_TIMEOUT_VARIABLE``: MLflow reads its own at each request)."""
        timeout = os.environ.get(ARTIFACT_TIMEOUT_VARIABLE)
        saved = os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT")
        if timeout:
            os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = timeout
        try:
            for path in paths:
                self.client.log_artifact(self.run_id, str(path), artifact_path)
        finally:
            if timeout and saved is not None:
                os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = saved
            elif timeout:
                del os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    logged_through = 0  # the last round whose metrics this run holds already

    def log_rounds(self, rounds: list[tuple[RoundRecord, int]]) -> None:
        """Rounds' metrics, each stamped with its ``when_ms`` (ms since the epoch: when the
        round ended), in as few ``log_batch`` calls as MLflow's limit of 1,000 metrics allows:
        a call is one SQLite transaction, ≈ 5 ms of CPU, and a round's ≈ 25 metrics add ≈ 1 ms
        to it. A call the store refuses as invalid is retried round by round: the rounds before
        the bad one are written and its error is raised, as if each round had been written
        alone. Any other failure (the store unreachable) is raised at once: retrying round by
        round would spend MLflow's HTTP retries again on a server that is gone.

        A round this run holds already is not logged again, but for its ``RECOVERY_METRICS``:
        a node lost while a checkpoint was written (after the round was logged) recomputes
        it, and only then is the recovery's time known."""
        pending = []
        for record, when_ms in rounds:
            if record.round > self.logged_through:
                pending.append((record.round, self._round_metrics(record, when_ms)))
            elif RECOVERY_METRICS & record.metrics.keys():
                recovery = {k: record.metrics[k] for k in RECOVERY_METRICS if k in record.metrics}
                pending.append((record.round, _metrics(recovery, record, when_ms)))
        group: list[tuple[int, list[Metric]]] = []
        size = 0
        for number, metrics in pending:
            if group and size + len(metrics) > METRICS_PER_BATCH:
                self._write(group)
                group, size = [], 0
            group.append((number, metrics))
            size += len(metrics)
        if group:
            self._write(group)

    def _write(self, group: list[tuple[int, list[Metric]]]) -> None:
        """One ``log_batch`` for the rounds in ``group`` ((round, its metrics), in order)."""
        try:
            self.client.log_batch(self.run_id, metrics=[m for _, ms in group for m in ms])
        except Exception as error:
            if len(group) == 1 or getattr(error, "error_code", None) != "INVALID_PARAMETER_VALUE":
                raise
            for one in group:
                self._write([one])
            return
        self.logged_through = max(self.logged_through, group[-1][0])

    @staticmethod
    def _round_metrics(record: RoundRecord, when_ms: int) -> list[Metric]:
        values = {
            "seconds_per_round": record.seconds,
            "cohort_size": record.cohort_size,
            **record.metrics,
        }
        for name in ("epsilon", "test_accuracy", "test_loss"):
            if getattr(record, name) is not None:
                values[name] = getattr(record, name)
        return _metrics(values, record, when_ms)

    def finish(
        self,
        config: dict,
        history: list[RoundRecord],
        model_file: str,
        summary: dict,
        privacy_report: dict,
        status: str = "FINISHED",
    ) -> None:
        """Log the run's artifacts (``model_file``: the final model's ``state_dict``, saved by
        the driver) and end it with ``status``. A stopped run (KILLED) is ended first: `ray job
        stop` SIGKILLs the job 3 s after its SIGTERM, and the status must be in by then; the
        artifacts follow in what time is left."""
        if status != "FINISHED":
            self.end(status)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            rounds = [{k: v for k, v in r.__dict__.items() if k != "update_norms"} for r in history]
            (out / "history.json").write_text(json.dumps(rounds, indent=1))
            if any(r.update_norms for r in history):
                offsets, norms = _update_norms(history)
                np.savez_compressed(
                    out / "update_norms.npz",
                    rounds=np.array([r.round for r in history]),
                    offsets=offsets,
                    norms=norms,
                    clip_norm=np.array([r.metrics.get("clip_norm", np.nan) for r in history]),
                )
                clip_norm = (config.get("algorithm") or {}).get("clip_norm")
                _plot_update_norms(history, offsets, norms, clip_norm, out / "update_norms.png")
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            (out / "privacy_report.json").write_text(json.dumps(privacy_report, indent=1))
            shutil.copyfile(model_file, out / "model.pt")
            _plot_curves(history, out / "curves.png")
            self.log_files(sorted(out.iterdir()), None)
        if status == "FINISHED":
            self.end(status)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)


def _metrics(values: dict, record: RoundRecord, when_ms: int) -> list[Metric]:
    """``values`` as MLflow metrics of ``record``'s round, stamped ``when_ms``."""
    return [Metric(k, float(v), when_ms, record.round) for k, v in values.items()]


def _update_norms(history: list[RoundRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Every round's per-client pre-clip norms in one float64 array, ragged: round
    ``history[i]``'s are ``norms[offsets[i]:offsets[i + 1]]``."""
    sizes = [len(r.update_norms) for r in history]
    norms = np.concatenate([np.frombuffer(r.update_norms, dtype=np.float32) for r in history])
    return np.concatenate([[0], np.cumsum(sizes)]), norms.astype(np.float64)


def _plot_update_norms(
    history: list[RoundRecord],
    offsets: np.ndarray,
    norms: np.ndarray,
    clip_norm: float | None,
    path: Path,
) -> None:
    """``update_norms.png``: histograms of the clients' pre-clip norms at four rounds (first,
    a third, two thirds, last), and their p10/p50/p90 over the rounds, with the clip norm C
    (C_t per round where it adapts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A NaN norm is a client that released no update (a warm-up round's, a dropped one): left
    # out, and so are rounds with none (DP-SCAFFOLD-warm's warm-up rounds).
    rounds = [(r, norms[offsets[i] : offsets[i + 1]]) for i, r in enumerate(history)]
    per_round = [(r, own[~np.isnan(own)]) for r, own in rounds]
    per_round = [(r, own) for r, own in per_round if own.size]
    if not per_round:
        return
    picks = sorted({per_round[int(i * (len(per_round) - 1) / 3)][0].round for i in range(4)})
    fig, (hist, band) = plt.subplots(1, 2, figsize=(9.2, 3.6))
    finite = norms[np.isfinite(norms)]
    bins = np.linspace(0, finite.max() if finite.size else 1.0, 40)
    for r, own in per_round:
        if r.round in picks:
            hist.hist(own, bins=bins, histtype="step", label=f"round {r.round}")
    hist.set(xlabel="‖Δ_i‖₂ before clipping", ylabel="clients", title="update norms")
    xs = [r.round for r, _ in per_round]
    for q in (10, 50, 90):
        band.plot(xs, [np.percentile(own, q) for _, own in per_round], label=f"p{q}")
    adaptive = [(r.round, r.metrics["clip_norm"]) for r, _ in per_round if "clip_norm" in r.metrics]
    if adaptive:
        band.plot(*zip(*adaptive, strict=True), "k--", label="C_t")
    elif isinstance(clip_norm, int | float) and np.isfinite(clip_norm):
        hist.axvline(clip_norm, color="k", linestyle="--", label="C")
        band.axhline(clip_norm, color="k", linestyle="--", label="C")
    band.set(xlabel="round", ylabel="‖Δ_i‖₂", title="quantiles per round")
    hist.legend(fontsize=7)
    band.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_curves(history: list[RoundRecord], path: Path) -> None:
    """``curves.png``: test accuracy, ε spent and (for clipped presets) the fraction of clients
    whose update was clipped, per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [(r.round, r.test_accuracy) for r in history if r.test_accuracy is not None]
    eps = [(r.round, r.epsilon) for r in history if r.epsilon is not None]
    clipped = [
        (r.round, r.metrics["clip_fraction"]) for r in history if "clip_fraction" in r.metrics
    ]
    panels = [
        ("accuracy", "test accuracy", evals),
        ("privacy spent (ε)" if eps else "non-private", "ε", eps),
    ]
    if clipped:
        panels.append(("clipping", "fraction of updates clipped", clipped))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6))
    for ax, (title, label, points) in zip(axes, panels, strict=True):
        if points:
            ax.plot(*zip(*points, strict=True), marker="." if len(points) < 50 else None)
        ax.set(xlabel="round", ylabel=label, title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
