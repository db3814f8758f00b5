"""A stop signal at every phase of `run`: exit 130 (SIGINT) or 143 (SIGTERM), no traceback, the
MLflow run KILLED where the signal cut its rounds short, and the last completed round's
checkpoint whole on disk.

Each case runs the real command in process (``cluster.cli.main.main``) and sends the signal from
inside the phase (a wrapper around the function that does that phase's work), so the test waits
for a state, never for a fixed time.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import yaml
from helpers import small_config
from mlflow.tracking import MlflowClient

import cluster.runtime.experiment
import cluster.runtime.ray_runtime
import cluster.runtime.store
from cluster.cli.main import main
from cluster.config import config_from_dict
from cluster.runtime.checkpoint import load_checkpoint
from cluster.runtime.executors import HostPool
from cluster.runtime.experiment import run_experiment

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def tracking(tmp_path, monkeypatch, sqlite_store):
    uri = sqlite_store(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(uri)


def _config_file(tmp_path, store_root, *overrides: str):
    config = small_config(
        store_root, f"checkpoint.dir={tmp_path / 'ck'}", "tracking.enabled=true", *overrides
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def _signal_once(target, name: str, signum: int, when=lambda *a, **k: True):
    """Wrap ``target.name`` to send ``signum`` to this process the first time ``when`` holds
    for its arguments, then do the real work."""
    real = getattr(target, name)
    sent = []

    def wrapper(*args, **kwargs):
        if not sent and when(*args, **kwargs):
            sent.append(signum)
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    return wrapper


def _at_round(number: int):
    return lambda pool, round_index, *rest: round_index == number - 1


def _only_run(client) -> object:
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return run


def _checkpoint(tmp_path) -> dict:
    (path,) = (tmp_path / "ck").glob("*.pt")
    return load_checkpoint(path)


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err, err


def test_sigint_while_the_store_is_built(store_root, tmp_path, tracking, monkeypatch, capsys):
    fresh = tmp_path / "fresh-shards"  # not built yet: the store is built in this run
    path = _config_file(tmp_path, fresh)
    build = _signal_once(cluster.runtime.store, "build_or_open_store", signal.SIGINT)
    monkeypatch.setattr(cluster.runtime.store, "build_or_open_store", build)
    assert main(["run", str(path)]) == 130
    err = capsys.readouterr().err
    _no_traceback(err)
    assert "aborted: interrupted by SIGINT; no round completed: nothing to resume" in err
    assert not (tmp_path / "ck").exists()


def test_sigterm_during_ray_start_up_ends_the_run_killed(
    store_root, tmp_path, tracking, monkeypatch, capfd
):
    """Without Ray's core failure signal handler: it would dump a stack on file descriptor 2
    and arm a 3 s alarm that aborts the process, however far its run's end has got."""
    import ray

    path = _config_file(
        tmp_path,
        store_root,
        "executor.kind=ray",
        "executor.num_actors=1",
        "executor.cpus_per_actor=1",
        "executor.overlap_start=false",  # Ray starts before the first round, not beside it
    )
    real_init = ray.init

    def init_then_sigterm(*args, **kwargs):  # Ray is up, the actors not yet
        result = real_init(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(ray, "init", init_then_sigterm)
    assert main(["run", str(path)]) == 143
    err = capfd.readouterr().err
    _no_traceback(err)
    assert "SIGTERM received" not in err  # Ray's handler: its dump, then the alarm
    assert "aborted: interrupted by SIGTERM; no round completed: nothing to resume" in err
    run = _only_run(tracking)
    assert run.info.status == "KILLED"
    assert run.data.tags["mlflow.note.content"] == (  # cluster.runtime.run_names
        "0/5 rounds kept, no checkpoint (stopped: interrupted by SIGTERM)"
    )
    assert not ray.is_initialized()  # the embedded Ray was shut down
    assert not (tmp_path / "ck").exists()


def test_a_round_without_client_state_is_dropped_and_resumes_bit_for_bit(
    store_root, tmp_path, tracking, monkeypatch, capsys
):
    """dp_fedavg keeps no client state: the first signal drops round 3 at once; the checkpoint
    holds round 2 with the accountant as it was after round 2."""
    options = ("algorithm.name=dp_fedavg", "algorithm.clip_norm=1.0")
    options += ("algorithm.noise_multiplier=1.0", "rounds=4")
    straight = run_experiment(small_config(store_root, *options, f"checkpoint.dir={tmp_path}/a"))
    path = _config_file(tmp_path, store_root, *options)
    drop = _signal_once(HostPool, "run_round", signal.SIGINT, _at_round(3))
    monkeypatch.setattr(HostPool, "run_round", drop)
    assert main(["run", str(path)]) == 130
    out = capsys.readouterr()
    _no_traceback(out.err)
    assert "SIGINT: dropping the round in progress" in out.out
    assert "interrupted by SIGINT during round 3 (dropped): checkpoint" in out.out
    run = _only_run(tracking)
    assert run.info.status == "KILLED"
    description = run.data.tags["mlflow.note.content"]  # cluster.runtime.run_names
    assert description.startswith("2/4 rounds (interrupted by SIGINT during round 3 (dropped)) · ")
    saved = _checkpoint(tmp_path)
    assert saved["simulation"]["rounds_done"] == 2
    # the accountant as after round 2: round 3's charge was taken back
    assert sum(run[-1] for run in saved["simulation"]["accountant"]["history"]) == 2
    monkeypatch.undo()  # the real run_round again
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.tracking_uri)
    resumed = run_experiment(config_from_dict(saved["config"]), resume=saved)
    assert torch.equal(resumed.result.params, straight.result.params)
    assert resumed.epsilon == straight.epsilon
    assert tracking.get_run(run.info.run_id).info.status == "FINISHED"  # the same MLflow run
    steps = tracking.get_metric_history(run.info.run_id, "seconds_per_round")
    assert sorted(m.step for m in steps) == [1, 2, 3, 4]  # the dropped round 3 logged once
    finished = tracking.get_run(run.info.run_id)  # keeps its name; its line is the whole run's
    assert finished.info.run_name == run.info.run_name
    assert finished.data.tags["mlflow.note.content"].startswith(
        "4/4 rounds (completed 4 rounds) · "
    )


def test_a_round_with_client_state_finishes_before_the_stop(
    store_root, tmp_path, tracking, monkeypatch, capsys
):
    """SCAFFOLD's c_i change on the hosts during the round: it is finished, then checkpointed."""
    path = _config_file(tmp_path, store_root, "algorithm.name=scaffold", "rounds=5")
    stop = _signal_once(HostPool, "run_round", signal.SIGTERM, _at_round(3))
    monkeypatch.setattr(HostPool, "run_round", stop)
    assert main(["run", str(path)]) == 143
    out = capsys.readouterr()
    _no_traceback(out.err)
    assert "interrupted by SIGTERM after round 3: checkpoint" in out.out
    run = _only_run(tracking)
    assert run.info.status == "KILLED"
    description = run.data.tags["mlflow.note.content"]  # cluster.runtime.run_names
    assert description.startswith("3/5 rounds (interrupted by SIGTERM after round 3) · ")
    assert _checkpoint(tmp_path)["simulation"]["rounds_done"] == 3


def test_a_second_signal_waits_for_the_final_checkpoint(
    store_root, tmp_path, tracking, monkeypatch, capsys
):
    """Ctrl-C after round 2, and again while the checkpoint is written: it is written whole."""
    path = _config_file(tmp_path, store_root, "algorithm.name=scaffold", "rounds=5")
    monkeypatch.setattr(
        HostPool, "run_round", _signal_once(HostPool, "run_round", signal.SIGINT, _at_round(2))
    )
    save = _signal_once(cluster.runtime.experiment, "save_checkpoint", signal.SIGINT)
    monkeypatch.setattr(cluster.runtime.experiment, "save_checkpoint", save)
    assert main(["run", str(path)]) == 130
    out = capsys.readouterr()
    _no_traceback(out.err)
    assert "SIGINT: finishing the checkpoint and the run's end first" in out.out
    assert _only_run(tracking).info.status == "KILLED"
    assert _checkpoint(tmp_path)["simulation"]["rounds_done"] == 2


@pytest.mark.parametrize("phase", ["final checkpoint", "shutdown after done"])
def test_a_signal_after_the_last_round_keeps_the_finished_run(
    phase, store_root, tmp_path, tracking, monkeypatch, capsys
):
    """The rounds are all done: the run stays FINISHED, its checkpoint whole; the exit code
    still says a signal came."""
    path = _config_file(tmp_path, store_root, "rounds=3")
    if phase == "final checkpoint":
        target, name = cluster.runtime.experiment, "save_checkpoint"
    else:
        target, name = cluster.runtime.ray_runtime, "disconnect"
    monkeypatch.setattr(target, name, _signal_once(target, name, signal.SIGINT))
    assert main(["run", str(path)]) == 130
    out = capsys.readouterr()
    _no_traceback(out.err)
    assert "done: completed 3 rounds" in out.out
    assert _only_run(tracking).info.status == "FINISHED"
    assert _checkpoint(tmp_path)["simulation"]["rounds_done"] == 3
