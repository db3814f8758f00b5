"""The CLI as a user runs it: progress lines, a summary, and clean errors for bad input."""

import subprocess
import sys

import pytest


def _cli(*args, env_extra=None, cwd=None):
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "cluster", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_cli_runs_locally_and_prints_progress(tmp_path, store_root):
    result = _cli(
        "run",
        "configs/quickstart.yaml",
        "--executor",
        "local",
        "--set",
        "rounds=3",
        "--set",
        "eval_every=1",
        "--set",
        "data.num_clients=20",
        "--set",
        "data.synthetic.samples_per_user=100",
        "--set",
        "cohort.size=5",
        env_extra={
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'm.db'}",
            "DPFL_STORE_ROOT": str(store_root),
        },
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # The first line repeats the command with every override, --executor's included.
    assert lines[0].startswith("run configs/quickstart.yaml --set rounds=3")
    assert lines[0].endswith("--set executor.kind=local")
    progress = [line for line in lines if line.startswith("round")]
    assert len(progress) == 3 and "ε" in progress[0] and "acc" in progress[0]
    assert any(line.startswith("MLflow run ") for line in lines)
    assert any("mlflow ui --backend-store-uri" in line for line in lines)
    # The MLflow process starts before the run's settings: it still inherits the quiet log
    # level (a fresh store would say "Creating initial MLflow database tables...").
    assert "INFO mlflow" not in result.stdout + result.stderr


# A second `python -m cluster` process (its imports, its tracking process): slow. In CI,
# tests/test_bad_input.py::test_the_real_command_exits_2_without_a_traceback runs the real
# command on a bad config (exit 2, the field named, nothing created), and
# test_bad_input_is_refused_before_any_work the catalogue in process.
@pytest.mark.slow
def test_cli_rejects_bad_config_before_any_work(tmp_path):
    result = _cli(
        "run",
        "configs/quickstart.yaml",
        "--set",
        "algorithm.noise_multiplier=-1",
        env_extra={"DPFL_STORE_ROOT": str(tmp_path / "never")},
    )
    assert result.returncode == 2
    assert "algorithm.noise_multiplier = -1.0" in result.stderr
    assert not (tmp_path / "never").exists()


def test_help_and_argument_errors_do_not_import_the_heavy_libraries():
    """`--help` of every subcommand, and the calculator's argument checks, run without torch,
    Ray or MLflow (seconds each to import): checked structurally, not timed."""
    probe = (
        "import sys, contextlib, io\n"
        "from cluster.cli.main import main\n"
        "for argv in ([], ['run'], ['resume'], ['privacy'], ['audit'], ['partition'], "
        "['compare']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([*argv, '--help'])\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    assert main(['privacy', '--sigma', '1', '--rounds', '5']) == 2  # no --q, --delta\n"
        "print(sorted(m for m in ('torch', 'ray', 'mlflow', 'opacus') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
