"""A finished run is read back from a real MLflow store through MlflowClient."""

import json

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
        "privacy.sampling=poisson",  # a fixed cohort accounted as Poisson, as DP-FedSAM does
    )
    messages = []
    outcome = run_experiment(config, say=messages.append)
    assert any("approximation" in m for m in messages)  # the mismatch is warned about
    client = MlflowClient(tracking_uri)
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["algorithm.clip_norm"] == "0.5"
    assert run.data.params["cohort.size"] == "5"
    assert run.data.tags["algorithm"] == "dp_fedavg"
    assert run.data.tags["privacy.unit"] == "client"
    assert "version.torch" in run.data.tags and "git_commit" in run.data.tags
    assert run.data.tags["privacy.accountant"] == "pld"
    assert run.data.tags["privacy.assumption"] == "poisson-subsampled gaussian"
    assert run.data.tags["privacy.cohort_sampler"] == "fixed"
    assert run.data.tags["privacy.assumption_mismatch"] == "true"

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
    partition = {a.path for a in client.list_artifacts(outcome.run_id, "partition")}
    assert partition == {
        "partition/class_histogram.png",
        "partition/client_sizes.png",
        "partition/partition_summary.json",
    }
    with open(client.download_artifacts(outcome.run_id, "privacy_report.json")) as f:
        report = json.load(f)
    assert report["unit"] == "client" and report["accountant"] == "pld"
    assert report["rounds"] == 4 and report["sample_rate"] == 0.25
    assert report["noise_multiplier"] == 1.0 and report["clip_norm"] == 0.5
    assert report["delta"] == pytest.approx(20**-1.1)  # default δ = population^-1.1
    assert report["dp_valid"] is True and "trusted server" in report["threat_model"]
    assert report["epsilon"] == pytest.approx(outcome.epsilon)
    assert report["noise_cohort_size"] == 5 and report["noise_std_on_mean"] == 0.1
    assert "approximation" in report["assumption_warning"]
    by = report["epsilon_by_accountant"]
    assert by["pld"] == pytest.approx(outcome.epsilon) and by["rdp"] >= by["pld"]
    local = client.download_artifacts(outcome.run_id, "config.yaml")
    with open(local) as f:
        assert "dp_fedavg" in f.read()


def test_round_metrics_are_written_off_the_round_and_flushed_in_order():
    """log_round queues; one background thread writes; flush waits and re-raises its error."""
    import threading

    from cluster.simulation import RoundRecord
    from cluster.tracking import MlflowTracker

    class SlowClient:
        def __init__(self):
            self.batches, self.release = [], threading.Event()

        def log_batch(self, run_id, metrics):
            self.release.wait(5)
            if metrics[0].step == 3:
                raise RuntimeError("store unavailable")
            self.batches.append(sorted({m.step for m in metrics}))

        def set_terminated(self, run_id, status):
            self.status = status

    def writers():
        return {t for t in threading.enumerate() if t.name == "mlflow-metrics"}

    before = writers()
    tracker = MlflowTracker.__new__(MlflowTracker)
    tracker.client, tracker.run_id = SlowClient(), "run"
    for step in (1, 2):
        tracker.log_round(RoundRecord(round=step, cohort_size=5, seconds=0.1, metrics={}))
    assert tracker.client.batches == []  # the round did not wait for the write
    tracker.client.release.set()
    tracker.flush()
    assert tracker.client.batches == [[1], [2]]
    tracker.log_round(RoundRecord(round=3, cohort_size=5, seconds=0.1, metrics={}))
    with pytest.raises(RuntimeError, match="store unavailable"):
        tracker.flush()
    (writer,) = writers() - before
    tracker.end("FAILED")  # a failed run still ends, with its own error
    assert tracker.client.status == "FAILED"
    writer.join(timeout=5)  # and its writer thread with it: none left per finished run
    assert not writer.is_alive()
