"""A run stopped and resumed from its checkpoint reaches bit-identical parameters."""

import torch
from helpers import small_config
from mlflow.tracking import MlflowClient

from cluster.checkpoint import load_checkpoint
from cluster.config import config_from_dict
from cluster.experiment import run_experiment

SCAFFOLD = ("algorithm.name=scaffold", "rounds=6")


def test_resume_continues_bit_for_bit_with_client_state(store_root, tmp_path):
    ckpt = f"checkpoint.dir={tmp_path}"
    straight = run_experiment(small_config(store_root, *SCAFFOLD, ckpt, "checkpoint.every=0"))

    first = run_experiment(
        small_config(store_root, *SCAFFOLD, ckpt, "rounds=3", "tracking.run_name=first-half")
    )
    saved = load_checkpoint(first.checkpoint)
    assert saved["simulation"]["rounds_done"] == 3
    states = saved["simulation"]["client_states"]  # SCAFFOLD's c_i travel with the checkpoint
    assert len(states["client_ids"]) > 0 and states["control"].shape[0] == len(states["client_ids"])
    config = config_from_dict(saved["config"], ["rounds=6"])
    resumed = run_experiment(config, resume=saved)

    assert len(resumed.result.history) == 6
    assert torch.equal(resumed.result.params, straight.result.params)
    assert resumed.result.history[-1].test_accuracy == straight.result.history[-1].test_accuracy


def test_resumed_run_logs_into_the_same_mlflow_run(store_root, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    dp = (
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=0.5",
        "algorithm.noise_multiplier=1",
        "tracking.enabled=true",
        f"checkpoint.dir={tmp_path}",
        "checkpoint.every=2",
    )
    first = run_experiment(small_config(store_root, *dp, "rounds=2"))
    saved = load_checkpoint(first.checkpoint)
    config = small_config(store_root, *dp, "rounds=4")
    resumed = run_experiment(config, resume=saved)
    assert resumed.run_id == first.run_id
    client = MlflowClient(uri)
    steps = [m.step for m in client.get_metric_history(first.run_id, "epsilon")]
    assert steps == [1, 2, 3, 4]
    assert client.get_run(first.run_id).info.status == "FINISHED"
