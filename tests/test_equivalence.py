"""Determinism and exact reductions (DESIGN §5, §6)."""

import numpy as np
import pytest
import torch
from helpers import run_local, small_config

from cluster.runtime.executors import LocalExecutor
from cluster.runtime.ray_executor import RayExecutor
from cluster.runtime.ray_runtime import without_failure_signal_handler
from cluster.runtime.simulation import Simulation
from cluster.runtime.store import open_store

DP = ("algorithm.name=dp_fedavg", "algorithm.clip_norm=0.5", "algorithm.noise_multiplier=1.0")


def test_dp_fedavg_without_noise_or_clipping_is_fedavg_bit_for_bit(store_root):
    fedavg = run_local(small_config(store_root))
    dp = run_local(
        small_config(
            store_root,
            "algorithm.name=dp_fedavg",
            "algorithm.clip_norm=.inf",
            "algorithm.noise_multiplier=0",
        )
    )
    assert torch.equal(fedavg.state.params, dp.state.params)
    assert dp.accountant is None  # σ=0 is non-private: no ε is claimed


def test_same_seed_same_params_other_seed_different(store_root):
    a = run_local(small_config(store_root, *DP))
    b = run_local(small_config(store_root, *DP))
    c = run_local(small_config(store_root, *DP, "seed=1"))
    assert torch.equal(a.state.params, b.state.params)
    assert not torch.allclose(a.state.params, c.state.params)


def test_poisson_and_client_placed_noise_run(store_root):
    poisson = run_local(small_config(store_root, *DP, "cohort.sampling=poisson"))
    sizes = [r.cohort_size for r in poisson.history]
    assert len(set(sizes)) > 1 or sizes[0] != 5  # realised sizes vary around 5
    client = run_local(small_config(store_root, *DP, "algorithm.noise_placement=client"))
    server = run_local(small_config(store_root, *DP))
    # Same batches, different noise realisations: close in distribution, not equal.
    assert not torch.equal(client.state.params, server.state.params)


def test_budget_stops_before_target_epsilon(store_root):
    sim = run_local(
        small_config(
            store_root, *DP, "rounds=50", "privacy.target_epsilon=3.0", "cohort.sampling=poisson"
        )
    )
    assert 0 < len(sim.history) < 50
    assert sim.history[-1].epsilon <= 3.0
    assert sim.accountant.epsilon_after(1.0, 0.25, sim.config.delta) > 3.0


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    # One logical GPU: actors asking for a fraction of it are packed, and fall back to the CPU.
    # address="local": a fresh instance even where a `ray start` left /tmp/ray/ray_current_cluster.
    # Without Ray's core failure handlers, as the project connects: its ``ray.shutdown`` would
    # reset SIGSEGV/SIGABRT to the default action, switching pytest's faulthandler off.
    with without_failure_signal_handler():
        ray.init(
            address="local", num_cpus=3, num_gpus=1, include_dashboard=False, log_to_driver=False
        )
    yield ray
    ray.shutdown()


# Sketches pre-aggregated on the actors, clip bits, the adaptive C broadcast back.
DPSFL_AC = (
    "algorithm.name=dpsfl_ac",
    "algorithm.local.local_steps=1",
    "algorithm.local.lr=1.0",
    "algorithm.sketch_cols=60",
    "algorithm.sketch_top_k=80",
    "algorithm.clip_norm=1.5",
    "algorithm.noise_multiplier=1.0",
)


# dp_fedavg runs with the slow tests: its Ray run matching the local one is checked in CI by
# test_fractional_gpu_actors_are_packed_and_a_stateless_round_survives_a_killed_actor below,
# the metrics and the bit-for-bit match with threads by the other two algorithms here.
@pytest.mark.parametrize(
    "algorithm", [pytest.param("dp_fedavg", marks=pytest.mark.slow), "scaffold", "dpsfl_ac"]
)
def test_ray_executor_matches_local_executor(store_root, ray_session, algorithm):
    extra = {"dp_fedavg": DP, "scaffold": ("algorithm.name=scaffold",), "dpsfl_ac": DPSFL_AC}[
        algorithm
    ]
    config = small_config(store_root, *extra, "data.test_per_client=10")
    store, _ = open_store(config)
    local = run_local(config)
    # Three actors: against one host (the actor count changes no result beyond rounding) and,
    # bit for bit, three host threads (one actor against one host is that case's n = 1).
    num_actors = 3
    executor = RayExecutor(
        store,
        config.task,
        config.build_algorithm(),
        config.seed,
        num_actors,
        cpus_per_actor=1,
        test_per_client=10,
    )
    try:
        sim = Simulation(config, store, executor)
        sim.run()
    finally:
        executor.close()
    np.testing.assert_allclose(
        sim.state.params.numpy(), local.state.params.numpy(), atol=1e-6, rtol=0
    )
    assert sim.history[-1].test_accuracy == pytest.approx(local.history[-1].test_accuracy)
    # Per-client matched test sets: each actor evaluates its own clients' sets.
    assert sim.history[-1].metrics["client_test_accuracy"] == pytest.approx(
        local.history[-1].metrics["client_test_accuracy"]
    )
    for name, value in local.state.extras.items():
        np.testing.assert_allclose(sim.state.extras[name].numpy(), value.numpy(), atol=1e-6)
    # As many threads in process as actors: the same sums in the same order, bit for bit.
    threaded = run_local(config, num_hosts=num_actors)
    assert torch.equal(threaded.state.params, sim.state.params)
    assert threaded.history[-1].metrics == sim.history[-1].metrics
    for name, value in threaded.state.extras.items():
        assert torch.equal(value, sim.state.extras[name])


def test_fractional_gpu_actors_are_packed_and_a_stateless_round_survives_a_killed_actor(
    store_root, ray_session
):
    """Two actors of half a CPU and half the logical GPU share it (one pool for both checks:
    a pool's start-up is most of either's time); one is killed after round 2, Ray restarts it
    and retries its calls, and the run still matches the local one."""
    config = small_config(store_root, *DP, "rounds=4")
    store, _ = open_store(config)
    executor = RayExecutor(
        store,
        config.task,
        config.build_algorithm(),
        config.seed,
        num_actors=2,
        cpus_per_actor=0.5,
        gpus_per_actor=0.5,
    )
    try:
        expected = "cuda:0" if torch.cuda.is_available() else "cpu"
        assert executor.devices == [expected, expected]
        sim = Simulation(config, store, executor)
        pid_before = executor.actor_info()[0]["pid"]

        def kill_after_round_2(record):
            if record.round == 2:  # the actor dies; Ray restarts it and retries its calls
                ray_session.kill(executor.actors[0], no_restart=False)

        sim.run(kill_after_round_2)
        assert executor.actor_info()[0]["pid"] != pid_before  # it really died and came back
    finally:
        executor.close()
    np.testing.assert_allclose(
        sim.state.params.numpy(), run_local(config).state.params.numpy(), atol=1e-6, rtol=0
    )


def test_scaffold_server_control_is_mean_of_client_controls(store_root):
    config = small_config(store_root, "algorithm.name=scaffold")
    store, _ = open_store(config)
    executor = LocalExecutor(store, config.task, config.build_algorithm(), config.seed)
    sim = Simulation(config, store, executor)
    sim.run()
    states = executor.hosts[0].client_state.state_dict()
    assert len(states["client_ids"]) > config.cohort.size  # several rounds, several clients
    total = torch.from_numpy(states["control"]).sum(0)
    expected = total / config.data.num_clients  # unseen clients still hold c_i = 0
    torch.testing.assert_close(sim.state.extras["control"], expected, atol=1e-6, rtol=1e-5)


def _restarted(ray, actor, timeout_s: float = 120) -> None:
    """Kill ``actor``'s process and return once Ray has restarted it (or failed to)."""
    import time

    from ray._private.state import actors

    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = actors(actor_id=actor._actor_id.hex())
        if state["State"] == "DEAD" or (state["State"] == "ALIVE" and state["NumRestarts"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"actor not restarted within {timeout_s} s")


def test_an_actor_whose_restart_fails_stops_the_wait_naming_the_error(tmp_path, ray_session):
    """Ray restarts a lost actor by running its constructor again; where that fails (here: its
    clients' shard store is gone), the actor is dead for good and the driver's wait for it
    ends naming the constructor's error, not only the restarts spent."""
    import shutil

    from cluster.runtime.executors import HostsUnavailable

    config = small_config(tmp_path / "shards", *DP, "rounds=1")
    store, _ = open_store(config)
    executor = RayExecutor(store, config.task, config.build_algorithm(), config.seed, 1)
    try:
        executor.await_hosts(timeout_s=60)
        shutil.rmtree(store.location)
        _restarted(ray_session, executor.actors[0])
        gone = "actor 0 failed as Ray restarted it: datasets.store.StoreError: .*shards"
        with pytest.raises(HostsUnavailable, match=gone):
            executor.await_hosts(timeout_s=60)
    finally:
        executor.close()


def test_an_actor_still_starting_at_the_deadline_is_not_said_to_lack_room(store_root, ray_session):
    """A lost actor that Ray has given a new process (the GCS's pid and worker changed), whose
    constructor still runs when the wait ends, is reported as still starting, not as lacking
    room."""
    import time

    from ray._private.state import actors

    from cluster.runtime.executors import HostsUnavailable

    config = small_config(store_root, *DP, "rounds=1")
    store, _ = open_store(config)
    executor = RayExecutor(store, config.task, config.build_algorithm(), config.seed, 1)
    try:
        actor, before = executor.actors[0], executor.placement[0]["pid"]
        # the worker the actor reports is the one the GCS's record names, in the same form
        record = executor._actor_record(0)
        assert (record.state, record.worker_id) == ("ALIVE", executor.placement[0]["worker_id"])
        ray_session.kill(actor, no_restart=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until its new process runs the constructor
            state = actors(actor_id=actor._actor_id.hex())
            if state["State"] == "RESTARTING" and state.get("Pid") not in (None, 0, before):
                break
            time.sleep(0.05)
        else:
            pytest.fail("Ray never showed the actor restarting in a new process")
        with pytest.raises(HostsUnavailable, match=r"actors \[0\] were restarted but") as late:
            executor.await_hosts(timeout_s=0)
        assert "no surviving node has room" not in str(late.value)
        executor.await_hosts(timeout_s=120)  # and it does come back
    finally:
        executor.close()


def test_an_actor_that_fails_to_start_stops_the_start_naming_its_error(tmp_path, ray_session):
    """A host actor whose constructor fails (here: its clients' shard store is gone, as on a
    node without the credentials of an object store) ends the executor's start with one line
    naming the constructor's error (``HostsUnavailable``: the CLI's exit 2), not Ray's
    traceback; and an actor's error that Ray wraps reaches the CLI as itself."""
    import shutil

    from cluster.cli.main import raised_in_actor
    from cluster.runtime.executors import HostsUnavailable
    from datasets.store import StoreError

    config = small_config(tmp_path / "shards", *DP, "rounds=1")
    store, _ = open_store(config)
    shutil.rmtree(store.location)
    gone = "a host actor failed to start: datasets.store.StoreError: shard store .*shards"
    with pytest.raises(HostsUnavailable, match=gone):
        RayExecutor(store, config.task, config.build_algorithm(), config.seed, 1)

    @ray_session.remote
    def read(location):
        from datasets.store import ShardStore

        return ShardStore.open(location)

    with pytest.raises(StoreError) as wrapped:
        ray_session.get(read.remote(store.location))
    assert type(raised_in_actor(wrapped.value)) is StoreError
    assert str(raised_in_actor(wrapped.value)).startswith(f"shard store {store.location}:")
