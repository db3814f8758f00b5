"""Warm actors (``executor.keep_warm_s``, ``cluster/runtime/warm_pool.py``): a run on a running
Ray (``ray start --head``) reuses the actor processes an earlier run left, with the same result
as fresh actors, and the lease, code and idle rules hold."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import SMALL_DP_FEDAVG_ON_RAY, small_config

from actors.code_digest import code_digest
from cluster.config import ConfigError
from cluster.runtime.experiment import run_experiment
from cluster.runtime.warm_pool import actors_that_fit, pool_key

REPO = Path(__file__).resolve().parents[1]
OPTIONS = {"num_cpus": 1.0, "num_gpus": 0.0, "max_restarts": 3}


def test_pool_key_follows_the_code_options_and_environment_not_the_working_dir():
    key = pool_key("a" * 64, OPTIONS, {"working_dir": "gcs://_ray_pkg_1.zip", "env_vars": {}})
    assert key == pool_key(
        "a" * 64, OPTIONS, {"working_dir": "gcs://_ray_pkg_2.zip", "env_vars": {}}
    )
    assert key != pool_key("b" * 64, OPTIONS, {"env_vars": {}})
    assert key != pool_key("a" * 64, {**OPTIONS, "num_cpus": 0.5}, {"env_vars": {}})
    assert key != pool_key("a" * 64, OPTIONS, {"env_vars": {"DPFL_STATE_DIR": "/x"}})


def test_code_digest_changes_with_a_file_of_the_packages(tmp_path):
    (tmp_path / "actors").mkdir()
    module = tmp_path / "actors" / "host.py"
    module.write_text("A = 1\n")
    before = code_digest(tmp_path)
    assert code_digest(tmp_path) == before
    module.write_text("A = 2\n")
    assert code_digest(tmp_path) != before
    (tmp_path / "notes.txt").write_text("not code")  # outside the packages: no change
    assert code_digest(tmp_path) == code_digest(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["executor.kind=ray", "executor.keep_warm_s=60"], "an embedded Ray ends with this run"),
        (["executor.kind=local", "executor.keep_warm_s=60"], "set executor.kind=ray"),
        (["executor.kind=ray", "executor.keep_warm_s=-1"], "0 (none) or in [1, 86400]"),
        (["executor.kind=ray", "executor.keep_warm_s=0.001"], "0 (none) or in [1, 86400]"),
    ],
)
def test_keep_warm_needs_a_running_ray(store_root, monkeypatch, overrides, names):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *overrides)
    message = str(error.value)
    assert "executor.keep_warm_s" in message and names in message


@pytest.mark.timeout(300)
def test_a_second_run_reuses_the_warm_actors_with_the_same_result(store_root, tmp_path):
    """Two drivers, one Ray job each, on a running head: the second run's actors are the
    first's processes (it takes the lease over from the first job, which exited holding it);
    its actor 1 is killed after round 1, restarted by Ray and opened again; both runs' weights
    and ε equal the same run's on the local executor, bit for bit."""
    from benchmarks.workloads import running_ray

    overrides = [f"data.store_root={store_root}", "rounds=3", *SMALL_DP_FEDAVG_ON_RAY]
    small_config(store_root, *overrides[1:])  # the shards exist before the drivers run
    # Short: Ray's unix sockets live under the head's directory (108 bytes at most)
    head_dir = Path(tempfile.mkdtemp(prefix="wp-"))
    with running_ray(head_dir) as (address, env):
        reports = {}
        for phase in ("first", "second"):
            out = tmp_path / f"{phase}.pt"
            request = {
                "phase": phase,
                "overrides": [*overrides, *address, f"checkpoint.dir={tmp_path / phase}"],
                "out": str(out),
            }
            done = subprocess.run(
                [sys.executable, "-m", "tests.fixtures_warm_pool", json.dumps(request)],
                cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                timeout=240,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-4000:]
            reports[phase] = torch.load(out, weights_only=True)
    shutil.rmtree(head_dir, ignore_errors=True)
    first, second = reports["first"], reports["second"]
    assert first["warm"]["placement"].startswith("warm actors")
    assert second["warm"]["placement"].startswith("warm actors")
    assert second["warm"]["pids"] == first["warm"]["pids"]  # the same processes
    assert first["warm"]["recoveries"] == 0 and second["warm"]["recoveries"] == 1
    assert len(second["after_restarted_release"]) == 1  # the restarted actor 1 ended
    # Ray's actors and the local executor's host threads agree bit for bit (same hosts)
    local_run = [*overrides[1:], "executor.kind=local", f"checkpoint.dir={tmp_path / 'local'}"]
    local = run_experiment(small_config(store_root, *local_run))
    for run in (first["warm"], second["warm"]):
        assert torch.equal(run["params"], local.result.params)
        assert run["epsilons"] == [r.epsilon for r in local.result.history]
    assert "another run (Ray job" in second["refused"]
    assert "other code" in second["other_code"]
    assert len(second["after_room_for_half"]) == 2
    assert second["after_room_for_more"] == []
    assert len(second["short_names"]) == 1
    assert second["after_idle"] == []  # kept 1 s, then ended by itself


def test_room_for_actors_is_counted_node_by_node():
    two_half_free = [{"CPU": 1.0}, {"CPU": 1.0}]
    assert actors_that_fit(two_half_free, 2.0, 0.0) == 0  # 2 CPUs in total, on no one node
    assert actors_that_fit(two_half_free, 0.5, 0.0) == 4
    gpu_node = {"CPU": 4.0, "GPU": 0.75}
    assert actors_that_fit([gpu_node], 1.0, 0.25) == 3  # fractional shares, GPU-bound
    assert actors_that_fit([gpu_node, {"CPU": 8.0}], 1.0, 0.25) == 3  # no GPU on the second
    assert actors_that_fit([{}], 0.0, 0.0) == float("inf")
