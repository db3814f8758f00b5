"""Recovering from lost hosts wherever the driver meets the loss, without a cluster: a restarted
actor's refusal reaches the driver as a lost host; a loss in a round, in a round's checkpoint or
in the final one rolls back and ends bit for bit like an uninterrupted run; hosts that cannot
come back, or a stop signal while waiting for them, leave a checkpoint of the last valid point
that resumes bit for bit. The multi-node tests (tests/test_multinode.py) lose real nodes."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
import torch
from helpers import run_local, small_config
from test_multinode import DP_FEDAVG, DP_SCAFFOLD

import cluster.runtime.experiment as experiment
from actors.client_state import ClientStateStore
from cluster.runtime.checkpoint import load_checkpoint, open_checkpoint
from cluster.runtime.executors import HostsLost, HostsUnavailable
from cluster.runtime.experiment import run_experiment
from cluster.runtime.ray_executor import ActorRecord, RayExecutor

ray = pytest.importorskip("ray")

TWO_HOSTS = ("executor.num_actors=2", "rounds=5")


# --- RayExecutor's side, with a stand-in for ray.get -------------------------------------------


class _Ray:
    """``ray.get`` over ready answers: a value, or the exception the call raised."""

    def get(self, answer, timeout=None):
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _pool() -> RayExecutor:
    pool = RayExecutor.__new__(RayExecutor)  # no actors: only the answers are looked at
    pool._ray = _Ray()
    return pool


def _task_error(cause: BaseException):
    """What ``ray.get`` raises for an actor method that raised ``cause``."""
    from ray.exceptions import RayTaskError

    return RayTaskError("ClientHostActor.run_round", "Traceback ...", cause).as_instanceof_cause()


def test_a_restarted_actors_refusal_is_a_lost_host():
    from actors.ray_actor import ClientStatesLost

    refusal = _task_error(ClientStatesLost("actor 1 was restarted and holds none of its clients"))
    with pytest.raises(HostsLost) as lost:
        _pool()._answers([0, 1, 2], ["partial 0", refusal, "partial 2"])
    assert lost.value.hosts == [1] and "actor 1 was restarted" in str(lost.value)
    assert _pool()._answers([0, 2], ["partial 0", "partial 2"]) == ["partial 0", "partial 2"]


def test_an_actors_own_error_is_not_a_lost_host():
    failure = _task_error(ValueError("a diverged client"))
    with pytest.raises(ValueError) as raised:  # Ray's error, also a ValueError
        _pool()._answers([0, 1], ["partial 0", failure])
    assert raised.value is failure and str(raised.value.cause) == "a diverged client"


@pytest.mark.timeout(30)
def test_waiting_for_hosts_polls_the_stop_check(monkeypatch):
    pool = _pool()
    pool.actors = [object(), object()]
    monkeypatch.setattr(pool, "_actor_record", lambda index: ActorRecord("RESTARTING", 1, ""))
    polls = []

    def check() -> None:
        polls.append(1)
        if len(polls) == 3:
            raise KeyboardInterrupt("stop")

    with pytest.raises(KeyboardInterrupt, match="stop"):
        pool.await_hosts(timeout_s=60, check=check)
    assert len(polls) == 3


# --- the driver's side: two in-process hosts, host 1 lost on cue --------------------------------


class LossyHosts:
    """A ``LocalExecutor`` of 2 hosts whose host 1 is lost on cue: the ``n``-th call of a method
    in ``lose_on`` wipes its clients' states and raises ``HostsLost``; ``lose_quietly`` (a round
    index) wipes them before that round, as a node that died between calls. Like a restarted
    Ray actor, host 1 then refuses rounds and state reads until its states are loaded back (a
    ``HostsLost``, as ``RayExecutor._answers`` turns ``ClientStatesLost``). ``await_hosts``
    calls ``on_wait``, polls ``check``, and raises ``HostsUnavailable`` if ``unavailable``."""

    can_lose_hosts = True

    def __init__(self, inner, lose_on=None, lose_quietly=None, unavailable=False, on_wait=None):
        self.inner = inner
        self.lose_on = lose_on or {}
        self.lose_quietly = lose_quietly
        self.unavailable = unavailable
        self.on_wait = on_wait
        self.calls = Counter()
        self.restarted = False
        self.waits = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _lose(self) -> None:
        self.inner.hosts[1].load_client_states(ClientStateStore.merge([]))
        self.restarted = True

    def _enter(self, method: str) -> None:
        self.calls[method] += 1
        if self.calls[method] == self.lose_on.get(method):
            self._lose()
            raise HostsLost([1], RuntimeError("node of actor 1 died"))
        if self.restarted:
            raise HostsLost([1], RuntimeError("ClientStatesLost: actor 1 was restarted"))

    def run_round(self, round_index, *args):
        if round_index == self.lose_quietly:
            self.lose_quietly = None
            self._lose()
        self._enter("run_round")
        return self.inner.run_round(round_index, *args)

    def client_states(self) -> dict:
        self._enter("client_states")
        return self.inner.client_states()

    def load_client_states(self, states: dict) -> None:
        self.inner.load_client_states(states)
        self.restarted = False

    def await_hosts(self, timeout_s=None, check=None) -> None:
        self.waits += 1
        if self.on_wait is not None:
            self.on_wait()
        if check is not None:
            check()
        if self.unavailable:
            raise HostsUnavailable("executor: no surviving node has room for them: add a node")

    def describe_placement(self) -> str:
        return "actors in this process"


@pytest.fixture
def lossy(monkeypatch):
    """``lossy(**cues)`` makes the next run_experiment's executor ``LossyHosts(..., **cues)``
    (listed in ``lossy.made``), and those after it the usual ones (a resumed run's)."""
    build = experiment.make_executor
    made = []

    def arm(**cues):
        def make(*args, **kwargs):
            if made:
                return build(*args, **kwargs)
            made.append(LossyHosts(build(*args, **kwargs), **cues))
            return made[-1]

        monkeypatch.setattr(experiment, "make_executor", make)

    arm.made = made
    return arm


def _config(store_root, tmp_path, name: str, *overrides: str):
    return small_config(store_root, f"checkpoint.dir={tmp_path / name}", *TWO_HOSTS, *overrides)


def _assert_same(outcome, straight) -> None:
    assert torch.equal(outcome.result.params, straight.result.params)
    history, reference = outcome.result.history, straight.result.history
    assert [r.epsilon for r in history] == [r.epsilon for r in reference]
    assert [r.test_accuracy for r in history] == [r.test_accuracy for r in reference]
    assert [r.update_norms for r in history] == [r.update_norms for r in reference]


def _same_client_states(path, reference_path) -> bool:
    states = load_checkpoint(path)["simulation"]["client_states"]
    expected = load_checkpoint(reference_path)["simulation"]["client_states"]
    return states["client_ids"].tolist() == expected["client_ids"].tolist() and bool(
        (states["control"] == expected["control"]).all()
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("every", "cue", "lost_round", "rolled_back_to"),
    [
        # a restarted actor refuses round 4: back to round 2's checkpoint
        (2, {"lose_quietly": 3}, 4, 2),
        # round 4's checkpoint loses a host: back to round 2's
        (2, {"lose_on": {"client_states": 2}}, 4, 2),
        # the final checkpoint loses one: back to round 4's, round 5 replayed, written again
        (2, {"lose_on": {"client_states": 3}}, 5, 4),
        # the final checkpoint, no periodic one: back to round 0 (no host asked for it)
        (0, {"lose_on": {"client_states": 1}}, 5, 0),
    ],
    ids=["refusal-before-a-round", "round-checkpoint", "final-checkpoint", "final-from-round-0"],
)
def test_a_run_with_client_state_recovers_wherever_hosts_are_lost(
    store_root, tmp_path, lossy, every, cue, lost_round, rolled_back_to
):
    run = (*DP_SCAFFOLD, f"checkpoint.every={every}")
    straight = run_experiment(_config(store_root, tmp_path, "straight", *run))
    lossy(**cue)
    lines = []
    outcome = run_experiment(_config(store_root, tmp_path, "lost", *run), say=lines.append)
    (recovery,) = outcome.result.recoveries
    assert (recovery.round, recovery.rolled_back_to) == (lost_round, rolled_back_to)
    assert recovery.restart_s <= recovery.seconds  # the lost round was recomputed
    assert lossy.made[0].waits == 1 and not lossy.made[0].restarted
    assert any(line.startswith(f"round {lost_round}: lost actor [1]") for line in lines)
    assert not outcome.interrupted and len(outcome.result.history) == 5
    _assert_same(outcome, straight)
    assert load_checkpoint(outcome.checkpoint)["simulation"]["rounds_done"] == 5
    assert _same_client_states(outcome.checkpoint, straight.checkpoint)


@pytest.mark.timeout(300)
def test_hosts_that_cannot_come_back_leave_the_last_completed_round_checkpointed(
    store_root, tmp_path, lossy
):
    """Stateless, no periodic checkpoint: round 3 loses a host that cannot come back. The run
    stops with round 2 checkpointed (it needs no host), which resumes bit for bit."""
    run = (*DP_FEDAVG, "checkpoint.every=0")
    straight = run_experiment(_config(store_root, tmp_path, "straight", *run))
    lossy(lose_on={"run_round": 3}, unavailable=True)
    with pytest.raises(HostsUnavailable) as stopped:
        run_experiment(_config(store_root, tmp_path, "stuck", *run))
    (path,) = (tmp_path / "stuck").glob("*.pt")
    message = str(stopped.value)
    assert "no surviving node has room" in message and "add a node" in message
    assert f"the run stopped at round 2, its checkpoint {path}: resume it" in message
    saved, config = open_checkpoint(path)
    assert saved["simulation"]["rounds_done"] == 2
    _assert_same(run_experiment(config, resume=saved), straight)


@pytest.mark.timeout(300)
def test_a_stop_signal_while_waiting_for_hosts_ends_the_run_at_its_roll_back_point(
    store_root, tmp_path, lossy
):
    """DP-SCAFFOLD: round 4 loses a host; SIGTERM comes while the driver waits for it. The run
    ends at round 2 (its checkpoint's point), the checkpoint holds round 2's client states
    without asking the hosts, and it resumes bit for bit."""
    run = (*DP_SCAFFOLD, "checkpoint.every=2")
    straight = run_experiment(_config(store_root, tmp_path, "straight", *run))
    lossy(lose_on={"run_round": 4}, on_wait=lambda: os.kill(os.getpid(), signal.SIGTERM))
    outcome = run_experiment(_config(store_root, tmp_path, "stopped", *run))
    assert outcome.interrupted and len(outcome.result.history) == 2
    assert outcome.result.stop_reason == (
        "interrupted by SIGTERM while lost hosts were restarted (back at round 2)"
    )
    assert lossy.made[0].restarted  # no host was asked for states: the roll-back point's
    saved, config = open_checkpoint(outcome.checkpoint)
    assert saved["simulation"]["rounds_done"] == 2
    _assert_same(run_experiment(config, resume=saved), straight)


def test_no_roll_back_point_is_kept_where_no_host_can_be_lost(store_root):
    sim = run_local(small_config(store_root, "algorithm.name=scaffold", "rounds=2"))
    assert sim.keeps_client_state and sim._checkpointed is None
    assert len(sim.state_dict()["client_states"]["client_ids"]) > 0 and sim._checkpointed is None


def test_actors_not_back_in_time_are_told_apart_placed_from_unplaced():
    """After the wait: an actor that the GCS shows on a new worker is still starting, not short
    of room; one with no worker (a restart not yet leased one) or still on the lost worker
    (a loss Ray has not noticed) has not been placed. The free CPU count leaves out what the
    starting one holds, so it cannot tell them apart (2 free here). One dead meanwhile is
    reported as dead."""

    class Waited:
        _unplaceable = RayExecutor._unplaceable
        placement = [{"worker_id": "a0"}, {"worker_id": "b0"}, {"worker_id": "c0"}]
        states = ["RESTARTING", "RESTARTING", "ALIVE", "DEAD"]
        workers = ["a1", "", "c0"]  # leased anew; none yet; the lost one still

        class _ray:
            available_resources = staticmethod(lambda: {"CPU": 2.0})
            nodes = staticmethod(lambda: [{"Alive": True}, {"Alive": False}])

        def _actor_record(self, index):
            state = self.states[index]
            return ActorRecord(state, 1, "" if state == "DEAD" else self.workers[index])

        def _dead(self, index, record):
            return f"executor: actor {index} is dead ({record.state})"

    assert Waited()._unplaceable([0, 1, 2], 120.0) == (
        "executor: actors [1, 2] lost with their node could not be restarted within 120 s: Ray "
        "has leased no new worker for them: no surviving node has room for them (1 nodes alive, "
        "free CPU 2, GPU 0), or a node has not finished starting its worker: add a node (or lower "
        "executor.num_actors / cpus_per_actor) or give them longer ($DPFL_RESTART_TIMEOUT_S), and "
        "resume the run; actors [0] were restarted but "
        "did not answer within 120 s: Ray gave them new processes, still starting (a loaded "
        "node, or a slow store or import): give them longer ($DPFL_RESTART_TIMEOUT_S) and "
        "resume the run"
    )
    only_unplaced = Waited()._unplaceable([1], 120.0)
    assert "no surviving node has room" in only_unplaced and "still starting" not in only_unplaced
    assert Waited()._unplaceable([0, 3], 120.0) == "executor: actor 3 is dead (DEAD)"
