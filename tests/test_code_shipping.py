"""The project's code shipped to a running Ray's workers through its GCS
(``cluster.runtime.code_shipping``, ``actors.code_bootstrap``) instead of a job's working_dir."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import SMALL_DP_FEDAVG_ON_RAY, small_config

from actors import code_bootstrap
from actors.code_bootstrap import IN_USE, STALE_S, UNUSED_S, private_directory
from actors.code_digest import read_sources
from actors.ray_actor import WARM_ACTOR_OPTIONS, WarmHostActor
from cluster.config.checks import MAX_KEEP_WARM_S
from cluster.runtime import code_shipping
from cluster.runtime.code_shipping import (
    KEEP_PACKAGES,
    KEEP_S,
    MAX_PACKAGES,
    kept_entries,
    ray_methods,
    zipped,
)
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


def test_editor_lock_files_and_other_non_modules_are_neither_digested_nor_shipped(tmp_path):
    (tmp_path / "actors").mkdir()
    (tmp_path / "actors" / "host.py").write_text("X = 1\n")
    (tmp_path / "actors" / ".#host.py").symlink_to("user@machine.1234:1700000000")  # dangling
    (tmp_path / "actors" / "host-copy.py").write_text("X = 2\n")
    (tmp_path / "actors" / "linked.py").symlink_to(tmp_path / "actors" / "host.py")
    assert read_sources(tmp_path) == {"actors/host.py": b"X = 1\n"}


def test_packages_are_kept_while_new_recently_used_or_of_a_live_job():
    day = 24 * 3600.0
    now = 100 * day

    def entry(name: str, age_days: float, jobs=()):
        return {"digest": name, "published": now - age_days * day, "jobs": list(jobs)}

    # 80 versions published 90 to 11 days ago, then three more: one job of "pool" ended a day
    # ago (a warm pool's run), "live"'s runs, "recent" published a day ago
    index = [entry(f"v{i}", 90 - i, ["gone"]) for i in range(80)]
    index[:0] = [entry("pool", 60, ["a", "b"]), entry("live", 70, ["c", "d"])]
    index.append(entry("recent", 1))
    ends = {"a": now - 50 * day, "b": now - 1 * day, "c": now - 69 * day, "d": None}
    kept, dropped = kept_entries(index, now, ends)
    names = [e["digest"] for e in kept]
    # the newest 16 (v65..v79, recent) and the live job's; "pool", used a day ago, is the
    # 83rd newest: beyond MAX_PACKAGES, recency alone does not keep it
    assert names == ["live", *(f"v{i}" for i in range(65, 80)), "recent"]
    assert "pool" in [e["digest"] for e in dropped]
    # among the newest 64, a package last used within KEEP_S stays
    kept, _ = kept_entries([entry("pool", 60, ["a", "b"]), *index[-20:]], now, ends)
    assert kept[0]["digest"] == "pool"
    # used 3 days ago: gone
    kept, _ = kept_entries([entry("pool", 60, ["a"]), *index[-20:]], now, ends)
    assert kept[0]["digest"] != "pool"
    assert KEEP_S >= MAX_KEEP_WARM_S  # a warm pool's package outlives its idle time
    assert KEEP_PACKAGES <= MAX_PACKAGES


def test_the_published_digest_ships_only_to_the_ray_it_was_published_to(monkeypatch):
    ray = pytest.importorskip("ray")

    class Context:
        gcs_address = "10.0.0.1:6379"

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    monkeypatch.delenv("DPFL_SHIPPED_CODE", raising=False)
    monkeypatch.setattr(code_shipping, "_published", ("10.0.0.1:6379", "d1"))
    assert code_shipping.shipped_digest() == "d1"
    Context.gcs_address = "10.0.0.2:6379"  # another Ray, joined without publishing
    assert code_shipping.shipped_digest() is None
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("DPFL_SHIPPED_CODE", "d2")  # a worker that installed a package
    assert code_shipping.shipped_digest() == "d2"
    code_shipping.forget()
    assert code_shipping._published is None


def test_the_unpack_directory_must_be_private(tmp_path):
    assert private_directory(tmp_path / "new") == tmp_path / "new"
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="only it may write"):
        private_directory(shared)
    (tmp_path / "link").symlink_to(tmp_path / "new")
    with pytest.raises(PermissionError):
        private_directory(tmp_path / "link")
    # in a directory every user may write to without the sticky bit: another user could
    # rename it away and put theirs in its place
    with pytest.raises(PermissionError, match="replace it"):
        private_directory(shared / "code")


def _aged(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def _unpacked_package(base: Path, digest: str, old_s: float = 0) -> Path:
    """A package as a worker leaves it unpacked, last installed ``old_s`` ago."""
    (base / digest / "actors").mkdir(parents=True)
    (base / digest / IN_USE).touch()
    return _aged(base / digest, old_s)


def test_a_node_deletes_the_packages_no_process_runs_and_no_run_used_lately(tmp_path):
    """``_tidy`` (run where a worker unpacked a new version) keeps the new package, any that a
    live process holds (``_held``: here a process that installed it, then sleeps) however old,
    any installed within ``UNUSED_S``, any unpacked by an older version of the module (no
    ``IN_USE``: its workers take no lock), and leftovers younger than ``STALE_S``; it deletes
    the rest, and a held package once its process has exited. A lock file that is a link is
    not followed."""
    base = tmp_path / "code"
    held, unused, recent, new, older, linked = (c * 64 for c in "abcdef")
    for digest, old in ((held, 0), (unused, UNUSED_S + 60), (recent, UNUSED_S - 3600), (new, 0)):
        _unpacked_package(base, digest, old)
    _aged(base / new, UNUSED_S * 2)  # kept as the new one whatever its time
    (base / older / "actors").mkdir(parents=True)
    _aged(base / older, UNUSED_S * 2)
    (base / linked / "actors").mkdir(parents=True)
    (base / linked / IN_USE).symlink_to(tmp_path / "outside")
    _aged(base / linked, UNUSED_S * 2)
    (base / ".aaaaaaaaaaaa-killed").mkdir()  # a worker killed while unpacking
    _aged(base / ".aaaaaaaaaaaa-killed", STALE_S + 60)
    (base / ".bbbbbbbbbbbb-busy").mkdir()  # one unpacking now
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from actors.code_bootstrap import _held; "
         "from pathlib import Path; _held(Path(sys.argv[1]), sys.argv[2]); print('held', "
         "flush=True); time.sleep(120)", str(base), held],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        _aged(base / held, UNUSED_S + 60)  # held, and installed long ago
        code_bootstrap._tidy(base, keep=new)
        kept = [".bbbbbbbbbbbb-busy", held, recent, new, older, linked]
        assert sorted(p.name for p in base.iterdir()) == kept
        assert (base / held / "actors").is_dir()
    finally:
        holder.kill()
        holder.wait()
    code_bootstrap._tidy(base, keep=new)
    kept = [".bbbbbbbbbbbb-busy", recent, new, older, linked]
    assert sorted(p.name for p in base.iterdir()) == kept
    assert not (tmp_path / "outside").exists()


def test_a_tidy_deletes_a_package_only_through_the_lock_file_it_took(tmp_path, monkeypatch):
    """Between a tidy's opening of a package's ``IN_USE`` and its lock, another tidy deleted
    the package and a worker unpacked it again: the lock taken is on a file no one uses any
    more, and the package now there is not deleted."""
    import fcntl

    base = tmp_path / "code"
    digest = "f" * 64
    _unpacked_package(base, digest, UNUSED_S + 60)
    lock = fcntl.flock

    def racing(descriptor, operation):
        if operation & fcntl.LOCK_EX:
            shutil.rmtree(base / digest)
            _unpacked_package(base, digest, UNUSED_S + 60)
        return lock(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", racing)
    code_bootstrap._delete_unless_held(base / digest)
    assert (base / digest / "actors").is_dir()


def test_a_package_whose_lock_file_is_a_link_is_refused_naming_it(tmp_path, monkeypatch):
    base = tmp_path / "code"
    digest = "9" * 64
    (base / digest).mkdir(parents=True)
    (base / digest / IN_USE).symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr(code_bootstrap, "_unpacked", lambda b, d: b / d)
    with pytest.raises(PermissionError, match=f"not a file this module made.*remove {base}"):
        code_bootstrap._held(base, digest)
    assert not (tmp_path / "elsewhere").exists()


def test_a_worker_holds_its_package_and_unpacks_it_again_if_deleted_meanwhile(
    tmp_path, monkeypatch
):
    """``_held`` on a package unpacked before ``IN_USE`` existed creates the file and holds
    it; where the package it found is deleted before its lock (a ``_tidy`` of another worker),
    it unpacks the package again and holds that one."""
    base = tmp_path / "code"
    digest = "e" * 64
    (base / digest / "actors").mkdir(parents=True)  # no IN_USE: an older unpacking
    found = iter([base / "gone", base / digest])  # the first deleted before the lock
    monkeypatch.setattr(code_bootstrap, "_unpacked", lambda b, d: next(found))
    _aged(base / digest, UNUSED_S * 2)
    assert code_bootstrap._held(base, digest) == base / digest
    assert time.time() - (base / digest).stat().st_mtime < 60  # last installed: now
    # another process's exclusive lock fails while this one holds it shared
    probe = subprocess.run(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)"
         "\ntry:\n fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n "
         "print('held')", str(base / digest / IN_USE)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert probe.stdout == "held\n", probe.stderr


def test_a_stand_in_cannot_forward_an_async_method():
    class Host:
        async def call(self):
            return 1

    with pytest.raises(TypeError, match="cannot forward"):
        ray_methods(Host)


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
    """A run connected by address (``RAY_ADDRESS``, as ``ray start --head`` suggests exporting,
    and no ``executor.address``: shipped as ``--address`` is) from a driver outside the
    checkout, on a head started outside it with no PYTHONPATH: its host actors import the
    shipped package (no runtime environment, no setup_worker), its result is the local
    executor's bit for bit, and so are the store optimum's task and a sweep's trial (a task
    whose run starts host actors in turn); a worker's digest of the package equals the
    driver's, a missing package is named, and the store keeps only the newest packages."""
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
            with running_ray(head_dir, cwd=outside) as (address, head_env):
                request = {
                    "overrides": overrides,
                    "scratch": str(tmp_path / "scratch"),
                    "out": str(out),
                }
                env = {**head_env, "PYTHONPATH": str(REPO)}
                env["RAY_ADDRESS"] = address[0].partition("=")[2]
                done = subprocess.run(
                    [sys.executable, "-m", "tests.fixtures_code_shipping", json.dumps(request)],
                    cwd=outside, env=env, capture_output=True, text=True, timeout=240,
                )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
    finally:
        shutil.rmtree(head_dir, ignore_errors=True)
    report = torch.load(out, weights_only=False)
    assert report["session"].startswith("Ray cluster at 127.0.0.1:")
    assert report["published"] == report["driver_digest"] == report["worker_digest"]
    for host in report["hosts"]:
        assert host["real_class"] == "ClientHostActor"
        shipped = f"/dpfl-code-{os.getuid()}/{report['published']}/actors/ray_actor.py"
        assert host["module_file"].endswith(shipped), host
        assert str(REPO) not in host["module_file"]
        assert host["runtime_env"] == {}  # no job runtime environment: no setup_worker
    assert report["plain_task_finds_the_project"] is False  # the control: only the package
    assert "holds no package of the project's code 000000000000" in report["missing"]
    assert report["index"][-1]["digest"] == report["published"]
    assert report["index"][-1]["jobs"] == [report["job"]] and report["job_alive"]
    assert len(report["kept"]) == 1 and report["kept"][0] != report["published"]
    assert report["after_disconnect"] is None
    assert report["optimum"] == report["optimum_here"] and report["optimum"] is not None
    assert report["trial_error"] is None
    assert torch.equal(report["trial_params"], report["params"])
    local = run_experiment(small_config(store_root, *overrides[1:], "executor.kind=local"))
    assert torch.equal(report["params"], local.result.params)
    assert report["epsilons"] == [r.epsilon for r in local.result.history]
