"""The in-process executor's host threads: concurrent, and the same computation as one host."""

import threading

import numpy as np
import pytest
import torch
from helpers import run_local, small_config

from actors.client_host import ClientHost
from cluster.config import ConfigError
from cluster.runtime.executors import LocalExecutor, torch_threads
from cluster.runtime.preflight import preflight
from cluster.runtime.simulation import Simulation
from cluster.runtime.store import open_store

DP = ("algorithm.name=dp_fedavg", "algorithm.clip_norm=0.5", "algorithm.noise_multiplier=1.0")


def test_local_hosts_train_a_round_at_the_same_time(store_root, monkeypatch):
    config = small_config(store_root, *DP, "rounds=2")
    store, _ = open_store(config)
    # Each host's round waits for the other's to have started: run one after the other, the
    # first would wait alone until the barrier breaks.
    both_started = threading.Barrier(2, timeout=30)
    threads = set()
    run_round = ClientHost.run_round

    def run_round_together(self, *args):
        threads.add(threading.current_thread().name)
        both_started.wait()
        return run_round(self, *args)

    monkeypatch.setattr(ClientHost, "run_round", run_round_together)
    executor = LocalExecutor(store, config.task, config.build_algorithm(), config.seed, 2)
    try:
        Simulation(config, store, executor).run()
    finally:
        executor.close()
    assert len(threads) == 2 and all(name.startswith("client-host") for name in threads)


def test_hosts_of_a_model_with_dropout_take_turns(store_root, monkeypatch):
    import cluster.runtime.executors as executors
    from models import draws_from_global_rng
    from models.cnn import EmnistCnn, ReddiCnn

    assert draws_from_global_rng(ReddiCnn()) and not draws_from_global_rng(EmnistCnn())
    config = small_config(store_root, *DP, "rounds=2")
    store, _ = open_store(config)
    threads = set()
    run_round = ClientHost.run_round

    def recorded(self, *args):
        threads.add(threading.current_thread().name)
        return run_round(self, *args)

    monkeypatch.setattr(ClientHost, "run_round", recorded)
    monkeypatch.setattr(executors, "draws_from_global_rng", lambda model: True)
    executor = LocalExecutor(store, config.task, config.build_algorithm(), config.seed, 2)
    try:
        Simulation(config, store, executor).run()
    finally:
        executor.close()
    assert threads == {threading.main_thread().name}


def test_local_hosts_equal_one_host_up_to_summation_order(store_root):
    config = small_config(store_root, *DP, "algorithm.clip_norm=5.0")
    one, two = run_local(config), run_local(config, num_hosts=2)
    np.testing.assert_allclose(two.state.params.numpy(), one.state.params.numpy(), atol=1e-6)
    for mine, theirs in zip(two.history, one.history, strict=True):
        assert mine.epsilon == theirs.epsilon
        assert mine.metrics["clients"] == theirs.metrics["clients"]
        assert mine.metrics["clip_fraction"] == theirs.metrics["clip_fraction"]


def test_scaffold_states_split_over_hosts_round_trip(store_root):
    config = small_config(store_root, "algorithm.name=scaffold", "rounds=3")
    store, _ = open_store(config)

    def executor():
        return LocalExecutor(store, config.task, config.build_algorithm(), config.seed, 3)

    first, second = executor(), executor()
    try:
        Simulation(config, store, first).run()
        states = first.client_states()
        held = [len(h.client_state.state_dict()["client_ids"]) for h in first.hosts]
        assert sum(held) == len(states["client_ids"]) > config.cohort.size
        assert sum(n > 0 for n in held) >= 2  # the c_i really live on several hosts
        second.load_client_states(states)
        back = second.client_states()
    finally:
        first.close()
        second.close()
    order, back_order = np.argsort(states["client_ids"]), np.argsort(back["client_ids"])
    for name, value in states.items():
        assert torch.equal(torch.as_tensor(back[name][back_order]), torch.as_tensor(value[order]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_local_executor_on_a_gpu_needs_one(store_root):
    config = small_config(store_root, "executor.gpus_per_actor=1")
    with pytest.raises(ConfigError) as error:
        preflight(config)
    assert "executor.gpus_per_actor" in str(error.value)
    assert "GPUs, this machine has 0" in str(error.value)


def test_the_local_executor_gives_the_caller_its_thread_count_back(store_root):
    """``executor.cpus_per_actor`` is the hosts' intra-op thread count while the executor is
    open; torch's count is process-wide, so a notebook or benchmark calling ``run_experiment``
    keeps its own afterwards."""
    from cluster.runtime.experiment import make_executor

    config = small_config(store_root, *DP, "executor.cpus_per_actor=1")
    store, _ = open_store(config)
    with torch_threads(3):
        executor = make_executor(config, store)
        assert torch.get_num_threads() == 1
        executor.close()
        assert torch.get_num_threads() == 3
        if not torch.cuda.is_available():  # a host that fails to start: the count is back too
            with pytest.raises(RuntimeError):
                LocalExecutor(
                    store,
                    config.task,
                    config.build_algorithm(),
                    0,
                    device="cuda",
                    intra_op_threads=1,
                )
            assert torch.get_num_threads() == 3


def test_partial_sums_of_float32_uploads_are_the_float64_sums_torch_computes():
    """Float32 uploads are summed into float64 by NumPy on the CPU (faster than torch's
    mixed-type add): bit for bit torch's sum; the uploads themselves are left as they were."""
    from algorithms.aggregate import PartialAggregate

    g = torch.Generator().manual_seed(0)
    uploads = [torch.randn(1000, generator=g) * 10.0**k for k in range(-3, 4)]
    uploads.append(torch.randn(2000, generator=g)[::2])  # not contiguous
    before = [u.clone() for u in uploads]
    partial = PartialAggregate()
    for update in uploads:
        partial.add({"delta": update}, 1.0)
    expected = torch.zeros(1000, dtype=torch.float64)
    for update in uploads:
        expected += update.double()
    assert torch.equal(partial.sums["delta"], expected)
    assert partial.count == len(uploads) and partial.weight == len(uploads)
    assert all(torch.equal(u, b) for u, b in zip(uploads, before, strict=True))


def test_a_partial_aggregate_crosses_processes_as_arrays():
    """What an actor returns is pickled by Ray: its sums travel as NumPy arrays (out of band,
    no torch.save) and come back as float64 tensors the driver may accumulate into; read-only
    arrays (views of Ray's object store) are copied, the object store is never written."""
    import pickle

    import numpy as np

    from algorithms.aggregate import ClientReport, PartialAggregate

    sums = {"delta": torch.arange(6, dtype=torch.float64), "clip_bit": torch.ones(1)}
    partial = PartialAggregate(sums, 2.0, 2, [ClientReport(7, 80, 5, 0.3, 0.9)])
    state = partial.__getstate__()
    assert all(isinstance(v, np.ndarray) for v in state["sums"].values())
    back = pickle.loads(pickle.dumps(partial, protocol=5))
    assert back.weight == 2.0 and back.count == 2 and back.reports[0].client_id == 7
    assert all(
        torch.equal(back.sums[k], v) and back.sums[k].dtype == v.dtype for k, v in sums.items()
    )
    frozen = state["sums"]["delta"].copy()
    frozen.flags.writeable = False
    restored = PartialAggregate.__new__(PartialAggregate)
    restored.__setstate__({**state, "sums": {"delta": frozen}})
    total = PartialAggregate.combine([restored, restored])
    assert torch.equal(total.sums["delta"], 2 * sums["delta"])
    restored.sums["delta"].add_(1)  # its own copy
    assert np.array_equal(frozen, np.arange(6))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("executor.placement=scatter",), "must be one of 'pack', 'spread'"),
        (("executor.kind=local", "executor.placement=spread"), "set executor.kind=ray"),
    ],
)
def test_a_placement_that_cannot_be_is_refused_naming_the_field(store_root, overrides, expected):
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *overrides)
    message = str(error.value)
    assert "executor.placement" in message and expected in message
    assert overrides[-1].split("=")[1] in message  # the value given


def test_actor_options_spread_or_pack_and_never_retry_a_call():
    """Ray restarts a lost actor, but never retries its call: a restarted actor holds no
    client state, and only the driver knows what to restore (``Simulation``)."""
    from cluster.runtime.executors import MAX_RESTARTS
    from cluster.runtime.ray_executor import actor_options

    spread, pack = actor_options(1, 0, "spread"), actor_options(0.5, 0.25, "pack")
    assert spread["scheduling_strategy"] == "SPREAD" and pack["scheduling_strategy"] == "DEFAULT"
    assert (pack["num_cpus"], pack["num_gpus"]) == (0.5, 0.25)
    for options in (spread, pack):
        assert (options["max_restarts"], options["max_task_retries"]) == (MAX_RESTARTS, 0)
