"""The MLflow UI as a person sees it: a real `mlflow server` on the run's store, opened in headless
Chromium. The run page renders the run with its metrics, the experiment opens in the classic
machine-learning view listing the run, and the screenshots are kept as test artifacts
(``$DPFL_TEST_ARTIFACTS``, default ``test-artifacts/``). Skipped when no Chromium is installed
(Debian: ``apt-get install chromium``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import small_config
from mlflow.tracking import MlflowClient

from cluster.runtime.experiment import run_experiment

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH")
ARTIFACTS = Path(os.environ.get("DPFL_TEST_ARTIFACTS", "test-artifacts"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("mlflow server did not come up")
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def _chromium(url: str, *flags: str) -> str:
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--window-size=1400,1000", "--virtual-time-budget=20000", *flags, url],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_run_page_renders_in_the_machine_learning_view(store_root, tmp_path, mlflow_server):
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_server
    try:
        outcome = run_experiment(
            small_config(
                store_root,
                "algorithm.name=dp_fedavg",
                "algorithm.clip_norm=0.5",
                "algorithm.noise_multiplier=1",
                "rounds=3",
                "tracking.enabled=true",
                "tracking.experiment=ui",
                "tracking.run_name=ui-check",
                f"checkpoint.dir={tmp_path}",
            )
        )
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("ui")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    artifacts = {a.path for a in client.list_artifacts(outcome.run_id)}
    assert {"curves.png", "partition"} <= artifacts, artifacts
    assert outcome.run_page.startswith(f"{mlflow_server}/#/experiments/")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    run_dom = _chromium(outcome.run_page, "--dump-dom")
    assert "ui-check" in run_dom and "test_accuracy" in run_dom and "epsilon" in run_dom
    experiment_page = (
        f"{mlflow_server}/#/experiments/{experiment.experiment_id}?workflowType=machine_learning"
    )
    # Without ?workflowType the UI shows its GenAI overview, which does not list runs.
    experiment_dom = _chromium(experiment_page, "--dump-dom")
    assert "Run Name" in experiment_dom and "ui-check" in experiment_dom
    for name, url in (("run", outcome.run_page), ("experiment", experiment_page)):
        shot = ARTIFACTS / f"mlflow_{name}_page.png"
        _chromium(url, f"--screenshot={shot.resolve()}")
        assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
