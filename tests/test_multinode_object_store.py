"""Three Ray nodes that share nothing but an object store and Ray's GCS: the shards, the
checkpoints and the recovery from a lost node all go through a real S3-compatible server (moto,
127.0.0.1), the code through the GCS (no node has the project on a path), and the run ends
bit-identical to the same run on one machine's disk."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import small_config

from cluster.runtime.checkpoint import load_checkpoint
from cluster.runtime.experiment import run_experiment
from tests.fixtures_ray_cluster import WORKERS, local_cluster
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


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The working directory of the nodes (started in it) and of the driver: any local write
    shows here."""
    path = tmp_path / "workdir"
    path.mkdir()
    monkeypatch.chdir(path)
    return path


@pytest.fixture
def bare_cluster(s3, workdir):
    """The three-node cluster, started after ``s3`` (its nodes get the AWS variables) in
    ``workdir``, with no project on its nodes' paths and a ``TMPDIR`` for each node."""
    with local_cluster(project_on_nodes=False) as running:
        yield running


@pytest.mark.timeout(300)
def test_nodes_sharing_only_the_object_store_recover_a_lost_node_bit_for_bit(
    s3, workdir, bare_cluster, store_root, tmp_path
):
    """DP-SCAFFOLD on the three-node cluster: the driver joins by address from outside the
    checkout, so the actors run the code it ships through the GCS (a plain task finds no
    project; each worker node unpacked the package itself); the store is built into the
    bucket by the driver, every actor reads its clients from there, checkpoints go there, and
    the node of one actor dies after round 3: its actor restarts on the survivor. The run rolls
    back to round 2's checkpointed c_i and ends as the same run on a local store with local
    checkpoints, ε included; nothing is written to the working directory."""
    overrides = [
        f"data.store_root={s3.uri('shards')}",
        f"checkpoint.dir={s3.uri('checkpoints')}",
        *RUN,
        *RAY,
    ]
    lost = bare_cluster.drive(overrides, kill_after=3, cwd=workdir)
    assert lost.plain_task_finds_the_project is False and lost.shipped is not None
    for node in WORKERS:  # each unpacked the package from the GCS into a TMPDIR of its own
        code = bare_cluster.node_temp_dir(node) / f"dpfl-code-{os.getuid()}" / lost.shipped
        assert (code / "actors" / "ray_actor.py").is_file()
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
