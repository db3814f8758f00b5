"""The CLI as a user runs it: progress lines, a summary, and clean errors for bad input."""

import subprocess
import sys


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
    progress = [line for line in lines if line.startswith("round")]
    assert len(progress) == 3 and "ε" in progress[0] and "acc" in progress[0]
    assert any(line.startswith("MLflow run ") for line in lines)
    assert any("mlflow ui --backend-store-uri" in line for line in lines)


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
