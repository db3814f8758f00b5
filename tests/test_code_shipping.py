"""The project's code shipped to a running Ray's workers through its GCS
(``cluster.runtime.code_shipping``, ``actors.code_bootstrap``) instead of a job's working_dir."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import SMALL_DP_FEDAVG_ON_RAY, small_config

from actors.code_digest import read_sources
from actors.ray_actor import WARM_ACTOR_OPTIONS, WarmHostActor
from cluster.runtime.code_shipping import ray_methods, zipped
from cluster.runtime.experiment import run_experiment

REPO = Path(__file__).resolve().parents[1]


def test_the_package_holds_exactly_the_digested_sources_the_same_bytes_each_time():
    sources = read_sources()
    package = zipped(sources)
    assert package == zipped(read_sources())  # content-addressed: no timestamps of the files
    with zipfile.ZipFile(io.BytesIO(package)) as unpacked:
        assert {name: unpacked.read(name) for name in unpacked.namelist()} == sources
    assert "actors/ray_actor.py" in sources and "cluster/runtime/code_shipping.py" in sources
    assert not [path for path in sources if not path.endswith(".py")]


def test_a_stand_in_keeps_the_real_methods_ray_options():
    methods = ray_methods(WarmHostActor)
    lease_group = {"__ray_concurrency_group__": "lease"}
    assert methods["lease"] == methods["release"] == methods["retire_if_free"] == lease_group
    assert methods["open"] == methods["run_round"] == methods["info"] == {}
    assert not [name for name in methods if name.startswith("_")]
    assert WARM_ACTOR_OPTIONS == {"concurrency_groups": {"lease": 1}}


@pytest.mark.timeout(300)
def test_a_driver_outside_the_checkout_runs_on_a_head_whose_workers_lack_the_code(
    store_root, tmp_path
):
    """A run connected by address from a driver outside the checkout, on a head started
    outside it with no PYTHONPATH: its host actors import the shipped package (no runtime
    environment, no setup_worker), its result is the local executor's bit for bit, and so are the
    store optimum's task and a sweep's trial (a task whose run starts host actors in turn); a
    worker's digest of the package equals the driver's, a missing package is named, and the
    store keeps only the newest packages."""
    from benchmarks.workloads import running_ray

    overrides = [
        f"data.store_root={store_root}",
        "rounds=2",
        f"checkpoint.dir={tmp_path / 'checkpoints'}",
        *SMALL_DP_FEDAVG_ON_RAY,
    ]
    small_config(store_root, *overrides[1:])  # the shards exist before the driver runs
    outside = tmp_path / "outside"
    outside.mkdir()
    head_dir = Path(tempfile.mkdtemp(prefix="cs-"))  # Ray's socket paths: 108 bytes at most
    out = tmp_path / "report.pt"
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("PYTHONPATH", raising=False)  # the head's workers: no project on a path
            with running_ray(head_dir) as (address, head_env):
                request = {
                    "overrides": overrides,
                    "address": address[0].partition("=")[2],
                    "scratch": str(tmp_path / "scratch"),
                    "out": str(out),
                }
                done = subprocess.run(
                    [sys.executable, "-m", "tests.fixtures_code_shipping", json.dumps(request)],
                    cwd=outside, env={**head_env, "PYTHONPATH": str(REPO)}, capture_output=True,
                    text=True, timeout=240,
                )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
    finally:
        shutil.rmtree(head_dir, ignore_errors=True)
    report = torch.load(out, weights_only=False)
    assert report["session"].startswith("Ray cluster at 127.0.0.1:")
    assert report["published"] == report["driver_digest"] == report["worker_digest"]
    for host in report["hosts"]:
        assert host["real_class"] == "ClientHostActor"
        shipped = f"/dpfl_code/{report['published']}/actors/ray_actor.py"
        assert host["module_file"].endswith(shipped), host
        assert str(REPO) not in host["module_file"]
        assert host["runtime_env"] == {}
        assert not any("setup_worker" in arg for arg in host["argv"])
    assert "holds no package of the project's code 000000000000" in report["missing"]
    assert len(report["kept"]) == 1 and report["kept"][0] != report["published"]
    assert report["after_disconnect"] is None
    assert report["optimum"] == report["optimum_here"] and report["optimum"] is not None
    assert report["trial_error"] is None
    assert torch.equal(report["trial_params"], report["params"])
    local = run_experiment(small_config(store_root, *overrides[1:], "executor.kind=local"))
    assert torch.equal(report["params"], local.result.params)
    assert report["epsilons"] == [r.epsilon for r in local.result.history]
