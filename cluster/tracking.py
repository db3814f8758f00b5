"""MLflow tracking, written by the driver only (DESIGN §8).

Default store: ``sqlite:///mlflow.db`` in the working directory; ``MLFLOW_TRACKING_URI``
overrides it. Metrics go in one ``log_batch`` per round; artifacts at the end: the resolved
config, accuracy and ε curves (PNG), the per-round history (JSON) and the final model.
"""

from __future__ import annotations

import json
import platform
import queue
import subprocess
import tempfile
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import yaml
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from cluster.config.runtime import tracking_uri
from cluster.simulation import RoundRecord

# MLflow 3's experiment type: "custom_model_development" is its classic machine-learning view.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
_PACKAGES = ("torch", "ray", "mlflow", "opacus", "numpy", "pyarrow")


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = str(value)
    return out


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
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :]).resolve()
        return (db.parent / "mlruns" / experiment).as_uri()
    return None


class MlflowTracker:
    def __init__(
        self, experiment: str, run_name: str | None, params: dict[str, str], tags: dict[str, str]
    ):
        self.uri = tracking_uri()
        self.client = MlflowClient(self.uri)
        self.experiment_id = self._experiment(experiment)
        all_tags = {"git_commit": git_commit(), **_versions(), **tags}
        self.run_id = self.client.create_run(
            self.experiment_id, run_name=run_name, tags=all_tags
        ).info.run_id
        items = [Param(k, v[:6000]) for k, v in params.items()]
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

    def run_page(self) -> str:
        """The run's page, in the machine-learning (not GenAI) workflow: on the tracking server,
        or under ``mlflow ui`` at its default address for a local store."""
        server = self.uri if self.uri.startswith("http") else "http://127.0.0.1:5000"
        return (
            f"{server.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
            "?workflowType=machine_learning"
        )

    @classmethod
    def resume(cls, run_id: str) -> MlflowTracker:
        """Continue an existing run (a resumed checkpoint logs into the same run)."""
        tracker = cls.__new__(cls)
        tracker.uri = tracking_uri()
        tracker.client = MlflowClient(tracker.uri)
        tracker.run_id = run_id
        tracker.experiment_id = tracker.client.get_run(run_id).info.experiment_id
        tracker.client.update_run(run_id, status="RUNNING")
        # Rounds logged after the checkpoint (a crash) are recomputed bit for bit on resume;
        # they are not logged twice.
        history = tracker.client.get_metric_history(run_id, "seconds_per_round")
        tracker.logged_through = max((m.step for m in history), default=0)
        return tracker

    def log_files(self, paths: list[Path], artifact_path: str) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    logged_through = 0  # the last round whose metrics this run holds already
    # Round metrics go to MLflow from one background thread, started with the first round (a
    # SQLite or HTTP write per round, off the round's critical path); ``flush`` waits for them.
    _pending: queue.Queue | None = None
    _write_error: BaseException | None = None

    def log_round(self, record: RoundRecord, when_ms: int | None = None) -> None:
        """Queue the round's metrics, stamped ``when_ms`` (ms since the epoch; default now)."""
        if record.round <= self.logged_through:
            return
        now = int(time.time() * 1000) if when_ms is None else when_ms
        values = {
            "seconds_per_round": record.seconds,
            "cohort_size": record.cohort_size,
            **record.metrics,
        }
        for name in ("epsilon", "test_accuracy", "test_loss"):
            if getattr(record, name) is not None:
                values[name] = getattr(record, name)
        metrics = [Metric(k, float(v), now, record.round) for k, v in values.items()]
        self._writer().put(metrics)

    def _writer(self) -> queue.Queue:
        if self._pending is None:
            self._pending = queue.Queue()
            threading.Thread(target=self._write_forever, name="mlflow-metrics", daemon=True).start()
        return self._pending

    def _write_forever(self) -> None:
        pending = self._pending
        while True:
            metrics = pending.get()
            try:
                if metrics is None:  # the run ended (``end``)
                    return
                if self._write_error is None:
                    self.client.log_batch(self.run_id, metrics=metrics)
            except BaseException as error:  # raised in the driver at the next flush
                self._write_error = error
            finally:
                pending.task_done()

    def flush(self) -> None:
        """Wait until every round's metrics are written (before a checkpoint, at the end)."""
        if self._pending is not None:
            self._pending.join()
            if self._write_error is not None:
                raise self._write_error

    def finish(
        self,
        config: dict,
        history: list[RoundRecord],
        model: torch.nn.Module,
        summary: dict,
        privacy_report: dict,
        status: str = "FINISHED",
    ) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            (out / "history.json").write_text(json.dumps([r.__dict__ for r in history], indent=1))
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            (out / "privacy_report.json").write_text(json.dumps(privacy_report, indent=1))
            torch.save(model.state_dict(), out / "model.pt")
            _plot_curves(history, out / "curves.png")
            for path in sorted(out.iterdir()):
                self.client.log_artifact(self.run_id, str(path))
        self.end(status)

    def end(self, status: str = "FINISHED") -> None:
        try:
            self.flush()
        except Exception:
            if status == "FINISHED":  # a failed run ends with its own error, not this one
                raise
        finally:
            if self._pending is not None:  # its writer thread ends (no thread per run left)
                self._pending.put(None)
                self._pending = None
            self.client.set_terminated(self.run_id, status)


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
