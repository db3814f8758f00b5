"""The actor pool on a three-node Ray cluster (tests/fixtures_ray_cluster.py): spread over the
worker nodes, and losing one of them mid-run. Every run is compared bit for bit, ε included,
with the same run elsewhere: the same ``num_actors`` and ``vectorize`` give the same hosts the
same clients (pinning is by actor index, never by node), so the node count, the placement and
a lost node change nothing in what is computed."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config

from cluster.runtime.checkpoint import load_checkpoint
from cluster.runtime.experiment import run_experiment
from tests.fixtures_ray_cluster import drive_embedded

pytest.importorskip("ray")

DP_FEDAVG = ("algorithm.name=dp_fedavg", "algorithm.clip_norm=0.5", "algorithm.noise_multiplier=1")
DP_SCAFFOLD = (
    "algorithm.name=dp_scaffold",
    "algorithm.clip_norm=1.0",
    "algorithm.noise_multiplier=2.0",
    "algorithm.local.batch_size=20",
    "algorithm.local.lr=0.5",
)
RAY = ("executor.kind=ray", "executor.num_actors=2", "executor.placement=spread")


def _overrides(store_root, tmp_path, name: str, *overrides: str) -> list[str]:
    """``small_config``'s overrides, with a checkpoint directory of the run's own (untracked
    runs are named by their config: two runs of one config would refuse each other's)."""
    return [
        f"data.store_root={store_root}",
        "data.num_clients=20",
        "data.synthetic.samples_per_user=100",
        "cohort.size=5",
        "algorithm.local.local_steps=5",
        "algorithm.local.batch_size=16",
        "tracking.enabled=false",
        f"checkpoint.dir={tmp_path / name}",
        *overrides,
    ]


def _elsewhere(store_root, tmp_path, name: str, *overrides: str):
    """The same run in this process (no cluster), its checkpoint elsewhere."""
    return run_experiment(small_config(store_root, f"checkpoint.dir={tmp_path / name}", *overrides))


def _assert_same_run(report, reference) -> None:
    assert torch.equal(report.params, reference.result.params)
    history = reference.result.history
    assert report.epsilons == [r.epsilon for r in history]
    assert report.test_accuracies == [r.test_accuracy for r in history]


def assert_recovered(lost, lost_round: int, back_to: int) -> None:
    """One loss, in ``lost_round``, rolled back to ``back_to``, timed and printed, the lost
    actor restarted on the surviving worker node."""
    (recovery,) = lost.recoveries
    replayed = lost_round - back_to
    assert (recovery.round, recovery.rolled_back_to, recovery.rounds_replayed) == (
        lost_round,
        back_to,
        replayed,
    )
    assert lost.killed_at < recovery.detected_at
    assert 0 < recovery.restart_s <= recovery.seconds
    assert any(
        line.startswith(f"recovered from the loss in round {lost_round} in ") for line in lost.lines
    )
    assert set(lost.nodes) == {"worker_a"}  # the restarted actor went to the survivor


@pytest.mark.slow  # ≈ 40 s (an embedded Ray besides); benchmarks.node_loss runs it too
@pytest.mark.timeout(300)
def test_spread_actors_span_the_worker_nodes_and_match_one_embedded_node(
    ray_cluster, store_root, tmp_path
):
    """Results are independent of node count and placement: actors spread over the two worker
    nodes end bit-identical, ε included, to the same pool packed on one embedded node."""
    run = (*DP_FEDAVG, "executor.kind=ray", "executor.num_actors=2", "rounds=3")
    run += ("executor.overlap_start=false",)  # the actors run every round
    spread = ray_cluster.drive(_overrides(store_root, tmp_path, "spread", *run, *RAY))
    assert sorted(spread.nodes) == ["worker_a", "worker_b"]  # the head has no CPU
    assert any(line.startswith("actors on 2 nodes: 0 on ") for line in spread.lines)
    embedded = drive_embedded(_overrides(store_root, tmp_path, "embedded", *run))
    assert torch.equal(spread.params, embedded.params)
    assert spread.epsilons == embedded.epsilons
    assert spread.test_accuracies == embedded.test_accuracies


@pytest.mark.slow  # ≈ 40 s; benchmarks.node_loss runs the same
@pytest.mark.timeout(300)
def test_a_lost_node_mid_run_is_recovered_bit_for_bit(ray_cluster, store_root, tmp_path):
    """DP-FedAvg: the node of one actor dies after round 2; the driver waits for Ray to restart
    the actor on the surviving node and recomputes round 3 alone (a round is a pure function
    of the broadcast and the seeds)."""
    run = (*DP_FEDAVG, "rounds=5")
    lost = ray_cluster.drive(_overrides(store_root, tmp_path, "lost", *run, *RAY), kill_after=2)
    assert_recovered(lost, 3, 2)
    # as many host threads as actors: the executors agree bit for bit
    reference = _elsewhere(store_root, tmp_path, "reference", *run, "executor.num_actors=2")
    _assert_same_run(lost, reference)


@pytest.mark.slow  # ≈ 47 s; CI runs the same recovery on S3 (test_multinode_object_store.py)
@pytest.mark.timeout(300)
def test_a_lost_node_rolls_client_states_back_to_the_checkpoint(ray_cluster, store_root, tmp_path):
    """DP-SCAFFOLD: the node dies after round 3; its actor's c_i are gone and the survivor's
    have moved past the checkpoint of round 2. Every actor gets round 2's c_i back (the
    restarted one refuses to train until it has them), rounds 3 and 4 are replayed."""
    run = (*DP_SCAFFOLD, "rounds=5", "checkpoint.every=2")
    lost = ray_cluster.drive(_overrides(store_root, tmp_path, "lost", *run, *RAY), kill_after=3)
    assert_recovered(lost, 4, 2)
    reference = _elsewhere(store_root, tmp_path, "reference", *run, "executor.num_actors=2")
    _assert_same_run(lost, reference)
    final = load_checkpoint(lost.checkpoint)["simulation"]["client_states"]
    expected = load_checkpoint(reference.checkpoint)["simulation"]["client_states"]
    assert final["client_ids"].tolist() == expected["client_ids"].tolist()
    assert (final["control"] == expected["control"]).all()


@pytest.mark.slow  # ≈ 35 s
@pytest.mark.timeout(300)
def test_no_surviving_node_with_room_stops_the_run_with_its_checkpoint_intact(
    ray_cluster, store_root, tmp_path
):
    """Actors of 2 CPUs fill a worker node each: the lost one has nowhere to go. The run
    stops with ``HostsUnavailable`` (exit 2 on the command line, as bad input) naming the fix,
    and the checkpoint of the last completed round is as it was written."""
    run = (*DP_FEDAVG, *RAY, "executor.cpus_per_actor=2", "rounds=4", "checkpoint.every=1")
    lost = ray_cluster.drive(
        _overrides(store_root, tmp_path, "stuck", *run),
        kill_after=2,
        env={"DPFL_RESTART_TIMEOUT_S": "3"},
    )
    assert "no surviving node has room" in lost.error and "add a node" in lost.error
    assert "still starting" not in lost.error  # its node is gone: Ray gave it no process
    (path,) = (tmp_path / "stuck").glob("*.pt")
    assert load_checkpoint(path)["simulation"]["rounds_done"] == 2
