"""A run stopped and resumed from its checkpoint reaches bit-identical parameters; a checkpoint
is checked against its config before any work, and loading one never runs code."""

import pickle
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
import torch
from helpers import small_config
from mlflow.tracking import MlflowClient
from test_bad_input import code_payload

from cluster.cli.main import main
from cluster.config import ConfigError, config_from_dict
from cluster.runtime import simulation
from cluster.runtime.checkpoint import checkpoint_path, open_checkpoint, save_checkpoint
from cluster.runtime.checkpoint_match import check_state
from cluster.runtime.experiment import run_experiment
from cluster.runtime.store import open_store
from datasets.sources import source_shape

SCAFFOLD = ("algorithm.name=scaffold", "rounds=6")


def test_resume_continues_bit_for_bit_with_client_state(store_root, tmp_path):
    ckpt = f"checkpoint.dir={tmp_path}"
    straight = run_experiment(small_config(store_root, *SCAFFOLD, ckpt, "checkpoint.every=0"))

    first = run_experiment(
        small_config(store_root, *SCAFFOLD, ckpt, "rounds=3", "tracking.run_name=first-half")
    )
    saved, config = open_checkpoint(first.checkpoint, ["rounds=6"])
    assert saved["simulation"]["rounds_done"] == 3
    states = saved["simulation"]["client_states"]  # SCAFFOLD's c_i travel with the checkpoint
    assert len(states["client_ids"]) > 0 and states["control"].shape[0] == len(states["client_ids"])
    _refuses_client_states_of_another_config(saved, config)
    resumed = run_experiment(config, resume=saved)

    assert len(resumed.result.history) == 6
    assert torch.equal(resumed.result.params, straight.result.params)
    assert resumed.result.history[-1].test_accuracy == straight.result.history[-1].test_accuracy
    assert [r.update_norms for r in resumed.result.history] == [
        r.update_norms for r in straight.result.history
    ]
    # The model's input is known from the config alone: what the built store holds.
    manifest = open_store(config)[0].manifest
    shape = (tuple(manifest["x_shape"]), manifest["num_classes"])
    assert source_shape(*config.store_parameters[:2]) == shape


def test_a_failed_round_keeps_the_rounds_before_it(store_root, tmp_path, monkeypatch):
    """An error in a round (a client's, the server's, an evaluation's: here raised in round 4
    after its server step changed the model) leaves the driver at round 3 again, which the run
    keeps as a checkpoint before the error goes on, saying where; resumed, the run ends as one
    that never failed."""
    common = ("rounds=6", "checkpoint.every=0", f"checkpoint.dir={tmp_path}")
    straight = run_experiment(small_config(store_root, *common, "tracking.run_name=straight"))
    failing = small_config(store_root, *common)
    budget = simulation.byte_budget_spent  # read after the server step, before the evaluation

    def fails_in_round_4(config, metrics, rounds):
        if rounds == 4:
            raise MemoryError("injected in round 4")
        return budget(config, metrics, rounds)

    monkeypatch.setattr(simulation, "byte_budget_spent", fails_in_round_4)
    with pytest.raises(MemoryError) as failed:
        run_experiment(failing)
    monkeypatch.undo()
    path = checkpoint_path(failing, None)
    assert failed.value.__notes__ == [
        f"the run stopped at round 3, its checkpoint {path}: resume it with: "
        f"uv run python -m cluster resume {path}"
    ]
    saved, config = open_checkpoint(path)
    assert saved["simulation"]["rounds_done"] == 3 and len(saved["simulation"]["history"]) == 3
    resumed = run_experiment(config, resume=saved)
    assert torch.equal(resumed.result.params, straight.result.params)
    assert [r.epsilon for r in resumed.result.history] == [
        r.epsilon for r in straight.result.history
    ]


def test_a_checkpoint_the_disk_refuses_ends_the_run_in_one_paragraph(
    store_root, tmp_path, monkeypatch, capsys
):
    """A full disk (or a failing object store) at round 4's checkpoint: exit 1, one paragraph
    naming the checkpoint and the OS's reason, and where the rounds before are kept (round 2's
    checkpoint), no traceback (review M)."""
    import errno

    import yaml

    from datasets import locations

    config = small_config(
        store_root, "rounds=6", "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ck'}"
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    write, calls = locations.write_atomic, []

    def disk_full_from_round_4(location, writer):
        calls.append(location)
        if len(calls) > 1:  # rounds 2 then 4 (and the retry at round 4)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(location, writer)

    monkeypatch.setattr(locations, "write_atomic", disk_full_from_round_4)
    assert main(["run", str(path), "--executor", "local"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint ") and "Traceback" not in err
    assert "could not be written ([Errno 28] No space left on device)" in err
    assert "no checkpoint of round 4 could be written" in err and "of round 2" in err


def _refuses_client_states_of_another_config(saved: dict, config) -> None:
    state = saved["simulation"]
    narrow = {**state["client_states"], "control": state["client_states"]["control"][:, :-1]}
    with pytest.raises(ConfigError, match=r"clients' 'control' hold 409 values each.* has 410"):
        check_state("x.pt", {**state, "client_states": narrow}, config)
    assert state["client_states"]["client_ids"].max() >= 10
    fewer = config_from_dict(saved["config"], ["data.num_clients=10"])
    with pytest.raises(ConfigError, match=r"state of client 1\d, the config has 10 clients"):
        check_state("x.pt", state, fewer)


def test_the_catalogues_code_payload_runs_code_when_unpickled_unsafely(tmp_path):
    """The bad-input catalogue's checkpoints that would create a file (refused there by
    `resume`, `landscape` and `run`'s overwrite check, the file never created) are live."""
    target = tmp_path / "created"
    pickle.loads(pickle.dumps(code_payload(target)()))
    assert target.exists()


def _wrong(saved: dict, path, change) -> str:
    """``saved`` with its config dict changed by ``change``, written to ``path``."""
    config = config_from_dict(saved["config"]).to_dict()
    change(config)
    save_checkpoint(path, saved["simulation"], config, saved["run_id"])
    return str(path)


def test_resumed_run_logs_into_the_same_mlflow_run(
    store_root, tmp_path, monkeypatch, capsys, sqlite_store
):
    uri = sqlite_store(tmp_path / "mlflow.db")
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
    saved, _ = open_checkpoint(first.checkpoint)
    client = MlflowClient(uri)
    finished = client.get_run(first.run_id).info
    assert finished.status == "FINISHED"

    # Refused before any work (exit 2), or nothing to do (exit 0): the run is left as it was.
    refused = {
        "params hold 410 values": lambda c: c["data"]["synthetic"].update(num_features=60),
        "server state holds nothing": lambda c: c["algorithm"].update(name="dp_scaffold"),
        "accountant charged 2 rounds": lambda c: c["data"].update(num_clients=40),
    }
    for index, (expected, change) in enumerate(refused.items()):
        assert main(["resume", _wrong(saved, tmp_path / f"bad{index}.pt", change)]) == 2
        assert expected in capsys.readouterr().err
    assert main(["resume", str(first.checkpoint), "--set", "rounds=1"]) == 2
    assert "rounds = 1: the checkpoint has completed 2 rounds" in capsys.readouterr().err
    assert main(["resume", str(first.checkpoint)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert not ray.is_initialized()
    after = client.get_run(first.run_id).info
    assert (after.status, after.end_time) == ("FINISHED", finished.end_time)

    # Killed after its last checkpoint, before the run was closed: resume closes it from the
    # checkpoint (artifacts, FINISHED), running no round and logging no metric point again.
    client.update_run(first.run_id, status="RUNNING")
    client.delete_tag(first.run_id, "stop_reason")
    assert main(["resume", str(first.checkpoint)]) == 0
    assert f"its MLflow run {first.run_id} is RUNNING" in capsys.readouterr().out
    closed = client.get_run(first.run_id)
    assert closed.info.status == "FINISHED" and closed.data.tags["stop_reason"]
    artifacts = {a.path for a in client.list_artifacts(first.run_id)}
    assert {"model.pt", "summary.json", "privacy_report.json"} <= artifacts
    assert [m.step for m in client.get_metric_history(first.run_id, "epsilon")] == [1, 2]

    planted = tmp_path / "planted.pt"
    save_checkpoint(planted, saved["simulation"], saved["config"], "../../etc")
    assert main(["resume", str(planted)]) == 2
    assert "its run_id '../../etc' is not an MLflow run id" in capsys.readouterr().err
    # Another run's checkpoint naming this run: refused, the run left as it was.
    lr = _wrong(saved, tmp_path / "other.pt", lambda c: c["algorithm"]["local"].update(lr=0.5))
    assert main(["resume", lr, "--set", "rounds=3"]) == 2
    assert "algorithm.local.lr = '0.5' here" in capsys.readouterr().err

    older = tmp_path / "round2.pt"
    older.write_bytes(first.checkpoint.read_bytes())
    config = small_config(store_root, *dp, "rounds=4")
    resumed = run_experiment(config, resume=saved)
    assert resumed.run_id == first.run_id
    steps = [m.step for m in client.get_metric_history(first.run_id, "epsilon")]
    assert steps == [1, 2, 3, 4]
    assert client.get_run(first.run_id).info.status == "FINISHED"
    # The run went on to round 4 from another copy: ending it at 3 from round 2 is refused.
    assert main(["resume", str(older), "--set", "rounds=3"]) == 2
    assert "has logged 4 rounds already" in capsys.readouterr().err
    assert main(["resume", str(older), "--set", "rounds=4"]) == 0  # recomputed, nothing logged
    assert [m.step for m in client.get_metric_history(first.run_id, "epsilon")] == steps


def test_a_checkpoint_is_written_by_one_command_at_a_time(
    store_root, tmp_path, capsys, monkeypatch
):
    """While another process holds a checkpoint's lock (``checkpoint_lock``), a resume of it
    and a new untracked run that would write it are refused before any work, the file
    unchanged; once it is released, the resume runs (by a relative path: the same lock). This
    process takes a lock it holds again without conflict. Lock files are never links
    followed."""
    import yaml

    from cluster.runtime.checkpoint import checkpoint_path
    from cluster.runtime.checkpoint_lock import checkpoint_locks, lock_file
    from datasets.locations import ObjectLocation

    first = run_experiment(small_config(store_root, f"checkpoint.dir={tmp_path}", "rounds=2"))
    other = small_config(store_root, f"checkpoint.dir={tmp_path}", "rounds=2", "seed=7")
    config_file = tmp_path / "other.yaml"
    config_file.write_text(yaml.safe_dump(other.to_dict()))
    before = first.checkpoint.read_bytes()
    busy = "another run or resume is writing this checkpoint now"
    with _held_by_another_process(first.checkpoint, checkpoint_path(other, None)):
        assert main(["resume", str(first.checkpoint), "--set", "rounds=3"]) == 2
        assert busy in capsys.readouterr().err
        assert main(["run", str(config_file)]) == 2
        assert busy in capsys.readouterr().err
    assert first.checkpoint.read_bytes() == before
    assert not checkpoint_path(other, None).exists()
    monkeypatch.chdir(first.checkpoint.parent)  # a relative path names the same lock
    assert main(["resume", first.checkpoint.name, "--set", "rounds=3"]) == 0
    assert open_checkpoint(first.checkpoint)[0]["simulation"]["rounds_done"] == 3

    with checkpoint_locks(first.checkpoint), checkpoint_locks(Path(first.checkpoint.name)):
        pass  # held twice by one process, through two spellings of its path
    planted = tmp_path / "planted.pt"
    lock_file(planted).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="cannot be opened"), checkpoint_locks(planted):
        pass
    assert not (tmp_path / "elsewhere").exists()
    with checkpoint_locks(ObjectLocation("bucket", "ck/run.pt")):  # no lock on an object store
        pass


def test_the_resume_command_printed_is_quoted_for_the_shell(store_root, tmp_path, capsys):
    """A checkpoint directory named with ``$(…)`` is a valid name; the command ``run`` prints
    to continue it, pasted into a shell, names that directory and runs nothing."""
    import subprocess

    import yaml

    marker = tmp_path / "ran"
    directory = tmp_path / f"$(touch {marker})"
    config = small_config(store_root, f"checkpoint.dir={directory}", "rounds=1")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.to_dict()))
    assert main(["run", str(config_file)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "continue with:" in x)
    command = line.split("continue with: ", 1)[1].removesuffix(" --set rounds=N)")
    words = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {command}"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert words[:5] == ["uv", "run", "python", "-m", "cluster"]
    assert words[6] == str(directory / f"{config.tracking.experiment}-fedavg-seed0.pt")
    assert not marker.exists()


@contextmanager
def _held_by_another_process(*checkpoints: Path):
    """The checkpoints' locks, held by a child process for the block."""
    import subprocess
    import sys

    from cluster.runtime.checkpoint_lock import lock_file

    locks = [str(lock_file(c.parent.resolve() / c.name)) for c in checkpoints]
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "for path in sys.argv[1:]:\n"
            "    fcntl.flock(os.open(path, os.O_RDONLY | os.O_CREAT), fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n",
            *locks,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_a_resume_never_overwrites_another_runs_checkpoint_at_its_target(
    store_root, tmp_path, capsys
):
    """An untracked resume writes the checkpoint its config names; where that is not the file
    it read (``--set checkpoint.dir``, or an older naming), a checkpoint of another run there
    was overwritten in silence: now refused, as ``run`` refuses it."""
    import yaml

    def untracked(directory, lr):
        config = small_config(
            store_root, f"checkpoint.dir={directory}", "rounds=1", "tracking.enabled=false",
            f"algorithm.local.lr={lr}",
        )  # fmt: skip
        path = tmp_path / f"c{lr}.yaml"
        path.write_text(yaml.safe_dump(config.to_dict()))
        assert main(["run", str(path)]) == 0
        return next((tmp_path / directory).glob("*.pt"))

    mine, theirs = untracked(tmp_path / "mine", 0.1), untracked(tmp_path / "theirs", 0.2)
    assert mine.name == theirs.name
    kept = theirs.read_bytes()
    capsys.readouterr()
    argv = ["resume", str(mine), "--set", "rounds=2", "--set", f"checkpoint.dir={theirs.parent}"]
    assert main(argv) == 2
    assert "holds a checkpoint of another run" in capsys.readouterr().err
    assert theirs.read_bytes() == kept
