"""Three Ray nodes that share nothing but an object store: the shards, the checkpoints and the
recovery from a lost node all go through a real S3-compatible server (moto, 127.0.0.1), and
the run ends bit-identical to the same run on one machine's disk."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import small_config

from cluster.runtime.checkpoint import load_checkpoint
from cluster.runtime.experiment import run_experiment
from tests.test_multinode import DP_SCAFFOLD, RAY, assert_recovered

pytest.importorskip("ray")

RUN = (
    "data.num_clients=20",
    "data.synthetic.samples_per_user=100",
    "cohort.size=5",
    "algorithm.local.local_steps=5",
    "tracking.enabled=false",
    *DP_SCAFFOLD,
    "rounds=5",
    "checkpoint.every=2",
)


@pytest.mark.timeout(300)
def test_nodes_sharing_only_the_object_store_recover_a_lost_node_bit_for_bit(
    s3, ray_cluster, store_root, tmp_path, monkeypatch
):
    """DP-SCAFFOLD on the three-node cluster (``s3`` is set up first, so the nodes and the
    driver get its AWS variables): the store is built into the bucket by the driver, every
    actor reads its clients from there, checkpoints go there, and the node of one actor dies
    after round 3. The run rolls back to round 2's checkpointed c_i and ends as the same run on
    a local store with local checkpoints, ε included; nothing is written to the working
    directory."""
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)  # the driver process inherits it: any local write shows here
    overrides = [
        f"data.store_root={s3.uri('shards')}",
        f"checkpoint.dir={s3.uri('checkpoints')}",
        *RUN,
        *RAY,
    ]
    lost = ray_cluster.drive(overrides, kill_after=3)
    assert_recovered(lost, 4, 2)
    assert os.listdir(workdir) == []  # no local `s3:` folder, no local checkpoint
    keys = s3.keys()
    assert any(k.startswith("shards/") and k.endswith("/manifest.json") for k in keys)
    assert lost.checkpoint.startswith(s3.uri("checkpoints") + "/")
    assert lost.checkpoint.removeprefix(f"s3://{s3.bucket}/") in keys

    local = run_experiment(
        small_config(
            store_root, *RUN, f"checkpoint.dir={tmp_path / 'local'}", "executor.num_actors=2"
        )
    )
    assert torch.equal(lost.params, local.result.params)
    assert lost.epsilons == [r.epsilon for r in local.result.history]
    assert lost.test_accuracies == [r.test_accuracy for r in local.result.history]
    final = load_checkpoint(lost.checkpoint)["simulation"]["client_states"]
    expected = load_checkpoint(local.checkpoint)["simulation"]["client_states"]
    assert (final["control"] == expected["control"]).all()
