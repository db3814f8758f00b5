"""SIGINT/SIGTERM stop a run after the round in progress: checkpoint, KILLED, exact resume, and
no metric point logged twice (also after a crash past the last checkpoint)."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import small_config
from mlflow.tracking import MlflowClient

from cluster.cli.main import main
from cluster.config import config_from_dict
from cluster.runtime.checkpoint import load_checkpoint
from cluster.runtime.experiment import run_experiment
from cluster.runtime.interrupts import Interrupted, RoundDropped, StopSignals

RUN = ("algorithm.name=scaffold", "rounds=5", "tracking.enabled=true")  # with client state


@pytest.fixture
def tracking(tmp_path, monkeypatch, sqlite_store):
    uri = sqlite_store(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(uri)


def _steps(client, run_id, name="seconds_per_round"):
    return sorted(m.step for m in client.get_metric_history(run_id, name))


# Three tracked runs: slow. Its checks are made in CI by test_cli_prints_how_to_resume_and_exits_130
# (a SIGINT after a round: stop, checkpoint), test_interrupt_phases.py's
# test_a_round_with_client_state_finishes_before_the_stop (SCAFFOLD: KILLED, the round's
# checkpoint) and test_a_round_without_client_state_is_dropped_and_resumes_bit_for_bit (the
# resume: bit for bit, the same MLflow run FINISHED, no step twice), and
# test_a_killed_driver_resumes_bit_for_bit_on_ray (a resume with client state).
@pytest.mark.slow
def test_sigint_checkpoints_marks_killed_and_resumes_bit_for_bit(store_root, tmp_path, tracking):
    options = (*RUN, f"checkpoint.dir={tmp_path}", "checkpoint.every=0")
    straight = run_experiment(small_config(store_root, *options, "tracking.run_name=straight"))

    def interrupt_after_round_2(record):
        if record.round == 2:
            os.kill(os.getpid(), signal.SIGINT)

    stopped = run_experiment(small_config(store_root, *options), interrupt_after_round_2)
    assert stopped.interrupted and len(stopped.result.history) == 2
    assert stopped.result.stop_reason == "interrupted by SIGINT after round 2"
    killed = tracking.get_run(stopped.run_id)
    assert killed.info.status == "KILLED"
    assert killed.info.run_name == f"scaffold · synthetic_logreg · s0 · {stopped.run_id[:6]}"
    assert killed.data.tags["mlflow.note.content"].startswith(
        "2/5 rounds (interrupted by SIGINT after round 2) · final test accuracy "
    )
    saved = load_checkpoint(stopped.checkpoint)
    assert saved["simulation"]["rounds_done"] == 2
    resumed = run_experiment(config_from_dict(saved["config"]), resume=saved)
    assert torch.equal(resumed.result.params, straight.result.params)
    finished = tracking.get_run(stopped.run_id)  # the same run, its name kept, its line new
    assert finished.info.status == "FINISHED" and finished.info.run_name == killed.info.run_name
    assert finished.data.tags["mlflow.note.content"].startswith(
        "5/5 rounds (completed 5 rounds) · "
    )
    assert finished.data.tags["mlflow.note.content"].endswith(" · not private (no noise)")
    named = tracking.get_run(straight.run_id).info.run_name
    assert named == f"straight · scaffold · synthetic_logreg · s0 · {straight.run_id[:6]}"
    assert _steps(tracking, stopped.run_id) == [1, 2, 3, 4, 5]


def test_resume_after_a_crash_does_not_log_rounds_twice(store_root, tmp_path, tracking):
    """Rounds 3–5 were logged after the round-2 checkpoint; resuming recomputes them silently."""
    options = (*RUN, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=2")
    copy = tmp_path / "round2.pt"

    def keep_round_2(record):
        if record.round == 2:
            (written,) = (tmp_path / "ck").glob("*.pt")
            shutil.copy(written, copy)

    first = run_experiment(small_config(store_root, *options), keep_round_2)
    accuracy = {m.step: m.value for m in tracking.get_metric_history(first.run_id, "test_accuracy")}
    saved = load_checkpoint(copy)
    assert saved["simulation"]["rounds_done"] == 2
    resumed = run_experiment(config_from_dict(saved["config"]), resume=saved)
    assert torch.equal(resumed.result.params, first.result.params)
    assert _steps(tracking, first.run_id) == [1, 2, 3, 4, 5]
    history = tracking.get_metric_history(first.run_id, "test_accuracy")
    assert {m.step: m.value for m in history} == accuracy and len(history) == 5


def test_stop_signals_act_by_phase():
    notices = []
    before_blocks = signal.getsignal(signal.SIGINT)  # SIG_IGN where pytest started in background
    with StopSignals(notices.append) as stop:
        with pytest.raises(Interrupted) as before:  # start-up: nothing to keep, stop now
            os.kill(os.getpid(), signal.SIGTERM)
        assert before.value.exit_code == 143 and stop.exit_code == 143
    with StopSignals(notices.append) as stop, stop.rounds():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reason == "interrupted by SIGTERM"  # the round in progress goes on
        os.kill(os.getpid(), signal.SIGINT)  # a second signal: the round's next poll aborts
        with pytest.raises(Interrupted, match="second SIGINT"):
            stop.check_round()
    with StopSignals(notices.append) as stop, stop.rounds():
        with stop.droppable():
            stop.check_round()  # no signal yet: the round goes on
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises nothing (Ray's C++ frames)
            with pytest.raises(RoundDropped):
                stop.check_round()
        stop.check_round()  # a round that cannot be dropped finishes
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(Interrupted, match="second SIGINT") as second:
            stop.check_round()
        assert second.value.exit_code == 130
    with StopSignals(notices.append) as stop:
        with stop.rounds():
            stop.settle()  # the rounds are over: one way, to the command's end
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.exit_code == 130  # recorded, nothing raised
        with pytest.raises(Interrupted, match="the next run was not started"):
            stop.begin()  # compare's next run
    assert signal.getsignal(signal.SIGINT) is before_blocks  # restored
    assert "SIGINT: finishing the checkpoint and the run's end first" in notices


def test_cli_prints_how_to_resume_and_exits_130(store_root, tmp_path, capsys, monkeypatch):
    import cluster.cli.run as cli

    real = cli._progress_line

    def progress_then_interrupt(record, *args):
        if record.round == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(record, *args)

    monkeypatch.setattr(cli, "_progress_line", progress_then_interrupt)
    sets = [
        f"data.store_root={store_root}",
        f"checkpoint.dir={tmp_path}",
        "rounds=4",
        "executor.kind=local",
        "tracking.enabled=false",
    ]
    assert main(["run", "configs/quickstart.yaml", *(x for s in sets for x in ("--set", s))]) == 130
    out = capsys.readouterr().out
    assert "SIGINT: stopping after this round" in out
    assert "interrupted by SIGINT after round 1: checkpoint" in out
    assert "resume with: uv run python -m cluster resume" in out


def test_a_killed_driver_resumes_bit_for_bit_on_ray(store_root, tmp_path, tracking):
    """SIGKILL of the driver process group mid-run (no handler runs, nothing is flushed) on a
    real local Ray: `resume` from the last checkpoint ends bit-identical to an undisturbed run,
    in the same MLflow run, with no metric step logged twice."""
    options = (*RUN, "rounds=8", "checkpoint.every=2")
    straight = run_experiment(  # the reference's params only: no tracking process to start
        small_config(store_root, *options, f"checkpoint.dir={tmp_path}/a", "tracking.enabled=false")
    )
    config = small_config(store_root, *options, f"checkpoint.dir={tmp_path}/b")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    ray_pool = ["--executor", "ray", "--set", "executor.num_actors=2"]
    ray_pool += ["--set", "executor.overlap_start=false"]  # the actors run every round
    ray_pool += ["--set", "executor.cpus_per_actor=0.5"]

    driver = subprocess.Popen(
        [sys.executable, "-m", "cluster", "run", str(path), *ray_pool],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the kill takes Ray's processes too
    )
    lines = []
    for line in driver.stdout:
        lines.append(line)
        if line.startswith("round    5/8"):  # the round-4 checkpoint is on disk
            os.killpg(driver.pid, signal.SIGKILL)
            break
    assert driver.wait(timeout=60) == -signal.SIGKILL, "".join(lines)
    # Quiet: only the project's lines (Ray's and MLflow's stay in their logs without --verbose)
    assert not [
        line for line in lines if " INFO " in line or "WARNING" in line or "(raylet)" in line
    ]
    assert lines[0].startswith("run ") and any(line.startswith("Ray: ") for line in lines)
    (checkpoint,) = [line.split()[1] for line in lines if line.startswith("checkpoint: ")]
    saved = load_checkpoint(checkpoint)
    assert saved["simulation"]["rounds_done"] == 4
    run_id = saved["run_id"]
    assert tracking.get_run(run_id).info.status == "RUNNING"  # nobody could mark it

    resumed = subprocess.run(
        [sys.executable, "-m", "cluster", "resume", checkpoint, *ray_pool],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    final = load_checkpoint(checkpoint)
    assert final["simulation"]["rounds_done"] == 8
    assert torch.equal(final["simulation"]["params"], straight.result.params)
    assert tracking.get_run(run_id).info.status == "FINISHED"
    assert _steps(tracking, run_id) == list(range(1, 9))


def test_a_run_whose_completed_rounds_are_not_all_in_its_checkpoint_is_tagged_so(store_root):
    """A second signal abandoning round 9 of a run checkpointed every 5 rounds: its MLflow run
    ends KILLED tagged ``rounds_not_in_checkpoint`` 3 (rounds 6-8), which a sweep never
    continues; a run whose checkpoint holds every round is not tagged."""
    from types import SimpleNamespace

    from cluster.runtime.experiment import _abandon

    config = small_config(store_root, "rounds=10", "checkpoint.every=5")
    for unsaved, tags in [(3, {"rounds_not_in_checkpoint": "3"}), (0, {})]:
        ended = []
        run = SimpleNamespace(set_tags=ended.append, abandon=ended.append)
        error = Interrupted(signal.SIGINT, "second SIGINT: the round in progress abandoned")
        error.unsaved_rounds = unsaved
        _abandon(run, error, config, ("checkpoint.pt", 8 - unsaved), None)
        assert ended[0].keys() - {"mlflow.note.content"} == tags.keys()
        assert {k: ended[0][k] for k in tags} == tags and ended[1] == "KILLED"
