"""``executor.overlap_start`` (``cluster/runtime/overlapped_start.py``): an embedded Ray's first
rounds run in the driver while Ray starts, and the run is bit-identical to one executor's
whatever round the actors take over at.

Most tests stand a second ``LocalExecutor`` in for the Ray actors (``_start_ray`` replaced), its
start held until a chosen round has run, so that the hand-over round is fixed; the last one
starts a real embedded Ray."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import small_config

from cluster.config import ConfigError
from cluster.runtime import experiment, overlapped_start
from cluster.runtime.executors import HostsLost, HostsUnavailable, LocalExecutor
from cluster.runtime.experiment import run_experiment

SCAFFOLD = [
    "algorithm.name=dp_scaffold",
    "algorithm.local.batch_size=10",
    "algorithm.clip_norm=1",
    "algorithm.noise_multiplier=1",
]
PRIVATE = ["algorithm.name=dp_fedavg", "algorithm.clip_norm=0.5", "algorithm.noise_multiplier=1"]


class HeldStart:
    """``experiment._start_ray``'s stand-in: once ``release`` is called, a local executor of
    the same hosts (what the actors would be), or ``failure`` raised."""

    def __init__(self, failure: Exception | None = None, lost_at_hand_over: bool = False):
        self.gate = threading.Event()
        self.failure = failure
        self.lost_at_hand_over = lost_at_hand_over
        self.made: list[LocalExecutor] = []
        self.closed = 0

    def release(self) -> None:
        self.gate.set()

    def __call__(self, config, store, algorithm, streams, say, verbose, hooks):
        hooks.connected()
        self.gate.wait(timeout=60)
        if self.failure is not None:
            raise self.failure
        if hooks.cancelled():
            return None
        say("actors on 1 node: stand-ins")
        actors = experiment._local_executor(config, store, algorithm, streams)
        close = actors.close

        def counted_close() -> None:
            self.closed += 1
            close()

        actors.close = counted_close
        if self.lost_at_hand_over:  # an actor dies as the clients' states arrive
            _lose_first_load(actors)
        self.made.append(actors)
        return actors


def _lose_first_load(actors: LocalExecutor) -> None:
    """``actors`` (stand-ins) lose a host on their first ``load_client_states``, and come back
    at once (``await_hosts``), as Ray's restarted actors would."""
    load = actors.load_client_states

    def lost_once(states) -> None:
        actors.load_client_states = load
        raise HostsLost([0], RuntimeError("actor 0 died"))

    actors.load_client_states = lost_once
    actors.await_hosts = lambda timeout_s=None, check=None: None
    actors.describe_placement = lambda: "stand-ins"


@pytest.fixture
def held_start(monkeypatch):
    monkeypatch.setattr(overlapped_start, "ray_here_only", lambda config: True)
    start = HeldStart()
    monkeypatch.setattr(experiment, "_start_ray", start)
    return start


def _config(store_root, tmp_path, *overrides: str):
    return small_config(
        store_root,
        "rounds=4",
        "executor.num_actors=2",
        f"checkpoint.dir={tmp_path}",
        *overrides,
    )


def _released_after(start: HeldStart, rounds: int):
    """An ``on_round`` that lets the stand-in actors start once ``rounds`` rounds ran, and
    waits (briefly) until they answer, so that they take the next call."""

    def on_round(record) -> None:
        if record.round == rounds:
            start.release()
            time.sleep(0.2)

    return on_round


@pytest.mark.parametrize("algorithm", [PRIVATE, SCAFFOLD], ids=["dp_fedavg", "dp_scaffold"])
def test_handed_over_mid_run_the_run_is_bit_identical_to_one_executor(
    store_root, tmp_path, held_start, algorithm
):
    """Rounds 1–2 in the driver, 3–4 on the stand-in actors (SCAFFOLD's c_i moved over):
    the same weights and ε as the local executor's run, bit for bit."""
    said = []
    ran = run_experiment(
        _config(store_root, tmp_path / "over", "executor.kind=ray", *algorithm),
        on_round=_released_after(held_start, 2),
        say=said.append,
    )
    alone = run_experiment(
        _config(store_root, tmp_path / "alone", "executor.kind=local", *algorithm)
    )
    assert torch.equal(ran.result.params, alone.result.params)
    assert ran.epsilon == alone.epsilon
    handed = [line for line in said if "took over" in line]
    assert len(handed) == 1 and "after round 2" in handed[0], said
    assert "actors on 1 node: stand-ins" in said
    assert held_start.closed == 1  # the stand-in actors, at the run's end


def test_an_actor_lost_as_it_takes_over_is_recovered_from_like_any_loss(
    store_root, tmp_path, monkeypatch
):
    """The hand-over's first call on the actors loses one: the run rolls back to its last
    point (SCAFFOLD: the c_i of round 0), waits for it and replays, ending bit-identical."""
    monkeypatch.setattr(overlapped_start, "ray_here_only", lambda config: True)
    start = HeldStart(lost_at_hand_over=True)
    monkeypatch.setattr(experiment, "_start_ray", start)
    said = []
    ran = run_experiment(
        _config(store_root, tmp_path / "over", "executor.kind=ray", *SCAFFOLD),
        on_round=_released_after(start, 2),
        say=said.append,
    )
    alone = run_experiment(_config(store_root, tmp_path / "alone", *SCAFFOLD))
    assert torch.equal(ran.result.params, alone.result.params)
    assert len(ran.result.recoveries) == 1, said
    assert any("actor 0 died" in line for line in said), said


def test_a_run_that_ends_before_the_actors_answer_cancels_their_start(
    store_root, tmp_path, held_start
):
    said = []
    timer = threading.Timer(1.0, held_start.release)  # after the 4 rounds (< 1 s here)
    timer.start()
    ran = run_experiment(
        _config(store_root, tmp_path, "executor.kind=ray", *PRIVATE), say=said.append
    )
    timer.join()
    assert len(ran.result.history) == 4
    assert held_start.made == []  # cancelled: no actors were made
    assert not any("took over" in line for line in said)
    assert any("every round (4) ran in this process" in line for line in said), said


def test_a_ray_that_fails_to_start_stops_the_run_at_its_last_round_kept(
    store_root, tmp_path, monkeypatch
):
    monkeypatch.setattr(overlapped_start, "ray_here_only", lambda config: True)
    start = HeldStart(failure=RuntimeError("raylet did not register"))
    monkeypatch.setattr(experiment, "_start_ray", start)
    with pytest.raises(HostsUnavailable) as error:
        run_experiment(
            _config(store_root, tmp_path, "executor.kind=ray", *PRIVATE),
            on_round=_released_after(start, 1),
        )
    message = str(error.value)
    assert "Ray's actors did not start (RuntimeError: raylet did not register)" in message
    assert "while 1 round ran in this process" in message
    assert "resume it with" in message  # the checkpoint of round 1


def test_auto_leaves_it_off_and_true_is_refused_where_the_data_held_twice_would_not_fit(
    store_root, tmp_path, monkeypatch
):
    from cluster.runtime.store import open_store

    config = _config(store_root, tmp_path, "executor.kind=ray")
    store, _ = open_store(config)
    monkeypatch.setattr(overlapped_start, "ray_here_only", lambda config: True)
    need = overlapped_start.in_process_bytes(store, 2, config.task)
    monkeypatch.setattr(overlapped_start, "physical_memory", lambda: 3 * need)
    applies, why = overlapped_start.applies(config, store)
    assert not applies and "would be held twice" in why
    forced = _config(store_root, tmp_path, "executor.kind=ray", "executor.overlap_start=true")
    assert overlapped_start.applies(forced, store) == (True, None)
    monkeypatch.setattr(overlapped_start, "physical_memory", lambda: 5 * need)
    assert overlapped_start.applies(config, store) == (True, None)
    # Forced where the two copies together would not fit: refused, naming the fix.
    monkeypatch.setattr(overlapped_start, "physical_memory", lambda: 2 * need - 1)
    with pytest.raises(ConfigError) as error:
        overlapped_start.applies(forced, store)
    assert "executor.overlap_start" in str(error.value) and "false" in str(error.value)
    monkeypatch.setattr(overlapped_start, "physical_memory", lambda: 2 * need)
    assert overlapped_start.applies(forced, store) == (True, None)


def test_it_applies_only_to_a_ray_of_the_runs_own(store_root, tmp_path, monkeypatch):
    """A loopback address is no proof of a one-machine Ray (a port-forward to a cluster, a head
    bound to every interface): only an embedded Ray is."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def here(*overrides: str) -> bool:
        return overlapped_start.ray_here_only(_config(store_root, tmp_path, *overrides))

    assert here("executor.kind=ray")  # embedded
    assert not here()  # the local executor
    for address in ("127.0.0.1:6379", "localhost:6379", "auto", "10.0.0.5:6379"):
        assert not here("executor.kind=ray", f"executor.address={address}")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # `ray start --head` suggests it
    assert not here("executor.kind=ray")
    assert here("executor.kind=ray", "executor.address=local")  # a new embedded Ray


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["executor.kind=local"], "the local executor's hosts are in this process"),
        (["executor.kind=ray", "executor.address=auto"], "a running Ray's actors"),
        (["executor.kind=ray", "executor.address=127.0.0.1:6379"], "a running Ray's actors"),
        (["executor.kind=ray", "executor.gpus_per_actor=0.5"], "a CUDA context"),
    ],
)
def test_true_is_refused_where_it_cannot_apply(store_root, monkeypatch, overrides, names):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *overrides, "executor.overlap_start=true")
    assert "executor.overlap_start" in str(error.value) and names in str(error.value)


@pytest.mark.timeout(300)
def test_an_embedded_rays_actors_take_over_with_the_same_result(store_root, tmp_path, monkeypatch):
    """A real embedded Ray: round 3 waits for the actors, which take over with SCAFFOLD's c_i
    of rounds 1–2, and the run equals the local executor's bit for bit."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    between_rounds = overlapped_start.OverlappedStart.between_rounds

    def actors_by_round_3(self):
        if self.rounds_in_process == 2:
            self._started.exception(timeout=240)
        between_rounds(self)

    monkeypatch.setattr(overlapped_start.OverlappedStart, "between_rounds", actors_by_round_3)
    said = []
    options = ("rounds=5", "executor.cpus_per_actor=0.5", *SCAFFOLD)
    try:
        ran = run_experiment(
            _config(store_root, tmp_path / "ray", "executor.kind=ray", *options), say=said.append
        )
    finally:
        ray.shutdown()
    alone = run_experiment(_config(store_root, tmp_path / "local", *options))
    assert torch.equal(ran.result.params, alone.result.params)
    assert ran.epsilon == alone.epsilon
    handed = [line for line in said if "took over" in line]
    assert len(handed) == 1, said
    assert any(line.startswith("actors on 1 node") for line in said), said


@pytest.mark.timeout(300)
def test_actors_created_for_a_run_that_ended_are_killed(store_root, tmp_path, monkeypatch):
    """A real embedded Ray whose actors are created as the run's one round ends: the run does
    not wait for them to import torch; they are killed at its end."""
    import ray
    from ray._private.state import actors as actor_table

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    created = threading.Event()
    record_created = overlapped_start.StartHooks.created

    def created_then_tell(self, actors):
        record_created(self, actors)
        created.set()

    monkeypatch.setattr(overlapped_start.StartHooks, "created", created_then_tell)
    said = []
    config = _config(store_root, tmp_path, "executor.kind=ray", "rounds=1", *PRIVATE)
    try:
        ran = run_experiment(
            config, on_round=lambda record: created.wait(timeout=120), say=said.append
        )
        assert created.is_set()
        assert len(ran.result.history) == 1
        assert any("every round (1) ran in this process" in line for line in said), said
        deadline = time.monotonic() + 30  # the GCS records a kill asynchronously
        while {a["State"] for a in actor_table().values()} - {"DEAD"}:
            assert time.monotonic() < deadline, actor_table()
            time.sleep(0.2)
    finally:
        ray.shutdown()


def test_a_start_that_fails_mid_round_stops_the_run_after_it_with_a_checkpoint_that_resumes(
    store_root, tmp_path, monkeypatch
):
    """Ray's start fails while round 2 trains (SCAFFOLD's c_i already moved on): the run stops
    only before round 3, so its checkpoint of round 2 holds round 2's c_i, and resuming it
    ends where a run never stopped ends, bit for bit."""
    from cluster.runtime.checkpoint import open_checkpoint

    monkeypatch.setattr(overlapped_start, "ray_here_only", lambda config: True)
    start = HeldStart(failure=RuntimeError("raylet did not register"))
    monkeypatch.setattr(experiment, "_start_ray", start)
    run_round = LocalExecutor.run_round

    def failing_during_round_2(self, round_index, *args, **kwargs):
        result = run_round(self, round_index, *args, **kwargs)
        if round_index == 1:  # failed before round 2 is evaluated
            start.release()
            time.sleep(0.2)
        return result

    monkeypatch.setattr(LocalExecutor, "run_round", failing_during_round_2)
    options = ("eval_every=1", *SCAFFOLD)
    with pytest.raises(HostsUnavailable) as error:
        run_experiment(_config(store_root, tmp_path / "stopped", "executor.kind=ray", *options))
    assert "while 2 rounds ran in this process" in str(error.value)
    monkeypatch.setattr(LocalExecutor, "run_round", run_round)
    (kept,) = (tmp_path / "stopped").glob("*.pt")
    saved, config = open_checkpoint(kept, ["executor.kind=local"])
    assert saved["simulation"]["rounds_done"] == 2
    resumed = run_experiment(config, resume=saved)
    straight = run_experiment(_config(store_root, tmp_path / "straight", *options))
    assert torch.equal(resumed.result.params, straight.result.params)


@pytest.mark.timeout(300)
def test_a_sigterm_once_ray_is_connected_stops_the_run_after_its_round(
    store_root, tmp_path, monkeypatch
):
    """A real embedded Ray, connected on its thread while round 1 ran in the driver: SIGTERM
    stops the run after that round, with its checkpoint. Ray's core, were it left to install
    its own handler (``ray_runtime.connect`` leaves it out), would abort the process 3 s later
    (exit 134)."""
    import os
    import signal

    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    connected = threading.Event()
    tell_connected = overlapped_start.StartHooks.connected

    def connected_then_tell(self):
        tell_connected(self)
        connected.set()

    monkeypatch.setattr(overlapped_start.StartHooks, "connected", connected_then_tell)

    def sigterm_once_connected(record) -> None:
        if record.round == 1:
            assert connected.wait(timeout=120)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(4)  # longer than Ray's abort would wait

    config = _config(store_root, tmp_path, "executor.kind=ray", "rounds=20", *PRIVATE)
    try:
        ran = run_experiment(config, on_round=sigterm_once_connected)
    finally:
        ray.shutdown()
    assert ran.interrupted
    assert len(ran.result.history) == 1
    assert list(tmp_path.glob("*.pt"))
