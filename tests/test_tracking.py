"""A finished run is read back from a real MLflow store through MlflowClient."""

import pytest
from helpers import small_config
from mlflow.tracking import MlflowClient

from cluster.experiment import run_experiment


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_run_is_logged_with_params_metrics_and_artifacts(store_root, tracking_uri):
    config = small_config(
        store_root,
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=0.5",
        "algorithm.noise_multiplier=1.0",
        "rounds=4",
        "eval_every=2",
        "tracking.enabled=true",
        "tracking.experiment=test-tracking",
    )
    outcome = run_experiment(config)
    client = MlflowClient(tracking_uri)
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["algorithm.clip_norm"] == "0.5"
    assert run.data.params["cohort.size"] == "5"
    assert run.data.tags["algorithm"] == "dp_fedavg"
    assert run.data.tags["privacy.unit"] == "client"
    assert "version.torch" in run.data.tags and "git_commit" in run.data.tags

    epsilon = client.get_metric_history(outcome.run_id, "epsilon")
    assert [m.step for m in epsilon] == [1, 2, 3, 4]
    values = [m.value for m in epsilon]
    assert values == sorted(values) and values[-1] == pytest.approx(outcome.epsilon)
    accuracy = client.get_metric_history(outcome.run_id, "test_accuracy")
    assert [m.step for m in accuracy] == [2, 4]
    assert all(0 <= m.value <= 1 for m in accuracy)
    for name in ("seconds_per_round", "clip_fraction", "mean_pre_clip_norm"):
        assert len(client.get_metric_history(outcome.run_id, name)) == 4

    artifacts = {a.path for a in client.list_artifacts(outcome.run_id)}
    assert {"config.yaml", "curves.png", "model.pt", "history.json"} <= artifacts
    local = client.download_artifacts(outcome.run_id, "config.yaml")
    with open(local) as f:
        assert "dp_fedavg" in f.read()
