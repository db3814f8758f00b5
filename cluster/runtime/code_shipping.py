"""The project's code shipped to a running Ray's workers through its GCS, instead of as a job's
``working_dir``.

Why: Ray starts every worker of a job that has a runtime environment twice — first as its
``setup_worker.py``, which imports Ray (≈ 0.9 s of CPU) after asking the node's runtime-env
agent for the environment, then ``exec``'d as the worker itself, which imports Ray again. A job
without one starts its workers directly (``benchmarks/NOTES.md``, sessions 46 and 47). So a
driver that connects to an address (``ray_runtime.connect``) joins with no runtime environment
and ``publish``es the code instead: the ``.py`` files of the project's packages
(``actors.code_digest.read_sources``), zipped into the GCS's key-value store under their
digest, once per version of the code. The remote entry points that run project code —
``actor_class`` (host actors, warm actors) and ``remote_function`` (the store optimum's task, a
sweep's trials) — then send stand-ins (``actors.code_bootstrap``) that install that package
on their node before importing the real code, with the real arguments pickled into one
``bytes``. Without a published package (an embedded Ray, whose workers find the project on
``PYTHONPATH``; inside ``ray job submit``, whose job carries the working_dir) they are Ray's
own ``ray.remote`` of the real class or function.

The package lives as long as the Ray cluster: a restarted actor finds it on any node, also one
that joined later, and so does a detached warm actor whose creator has ended. The store keeps
the newest versions and those still in use (``kept_entries``); each node keeps what it
unpacked in its temporary directory (``actors.code_bootstrap.unpack_root``).
"""

from __future__ import annotations

import inspect
import io
import json
import os
import time
import zipfile
from typing import Any

from actors import code_bootstrap
from actors.code_digest import PROJECT_ROOT, digest_of, read_sources

# Which packages stay in the GCS (``kept_entries``): the newest KEEP_PACKAGES versions; any whose
# publishing job is alive (a run's restarts and new nodes need it); and, up to MAX_PACKAGES in
# all, any last used within KEEP_S (used: published, or a job of it ended; a warm pool outlives
# its last run by keep_warm_s, at most a day).
KEEP_PACKAGES = 16
MAX_PACKAGES = 64
KEEP_S = 2 * 24 * 3600.0
# JSON: [{"digest", "published" (Unix s), "jobs" (hex ids)}, …], latest publication last. The
# key-value store has no transactions: each change reads the index and writes it back at once
# (``_change_index``), so two drivers publishing together may lose one's entry (its package is
# then never pruned); a driver prunes only entries it still finds unchanged just before, which
# leaves a window of milliseconds in which a package published again meanwhile can be deleted
# (its actors would then stop with ``CodePackageMissing`` on a node that never unpacked it).
INDEX_KEY = "index-v2"

_published: tuple[str, str] | None = None  # (GCS address, digest): this driver's package


def publish(root=PROJECT_ROOT) -> str:
    """Put the code under ``root`` in the connected Ray's GCS (unless there already) and ship
    it to the remote entry points made from now on; returns its digest. Its publication is
    recorded first, then packages no longer kept are deleted (``_prune``)."""
    global _published
    import ray
    from ray.experimental import internal_kv

    sources = read_sources(root)
    digest = digest_of(sources)
    context = ray.get_runtime_context()
    _change_index(lambda index: _with_publication(index, digest, context.get_job_id()))
    _prune()
    key = code_bootstrap.package_key(digest)
    namespace = code_bootstrap.NAMESPACE
    if not internal_kv._internal_kv_exists(key, namespace=namespace):
        internal_kv._internal_kv_put(key, zipped(sources), overwrite=False, namespace=namespace)
    _published = (context.gcs_address, digest)
    return digest


def zipped(sources: dict[str, bytes]) -> bytes:
    """``sources`` (relative path → bytes) as a deflated zip, the same bytes for the same
    sources (fixed timestamps)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as package:
        for path, text in sources.items():
            package.writestr(zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0)), text)
    return buffer.getvalue()


def _with_publication(index: list[dict], digest: str, job_id: str) -> list[dict]:
    """``index`` with ``digest`` published now by job ``job_id`` (moved to the end)."""
    entry = next((e for e in index if e["digest"] == digest), {"jobs": []})
    others = [e for e in index if e["digest"] != digest]
    jobs = [*(job for job in entry["jobs"] if job != job_id), job_id]
    return [*others, {"digest": digest, "published": time.time(), "jobs": jobs}]


def _prune() -> None:
    """Delete the packages no longer kept (``kept_entries``), each only where its entry is
    still the one decided on, and their entries."""
    from ray.experimental import internal_kv

    decided = _index()
    _, dropped = kept_entries(decided, time.time(), _job_ends())
    fresh = {entry["digest"]: entry for entry in _index()}
    gone = [entry["digest"] for entry in dropped if fresh.get(entry["digest"]) == entry]
    for digest in gone:
        internal_kv._internal_kv_del(
            code_bootstrap.package_key(digest), namespace=code_bootstrap.NAMESPACE
        )
    if gone:
        _change_index(lambda index: [e for e in index if e["digest"] not in gone])


def kept_entries(
    index: list[dict], now: float, job_ends: dict[str, float | None]
) -> tuple[list[dict], list[dict]]:
    """``index``'s entries split into those kept and those dropped. ``job_ends``: the jobs the
    GCS knows, each's end (Unix s; None: alive). Kept: the newest ``KEEP_PACKAGES``, those of a
    live job, and among the newest ``MAX_PACKAGES`` those last used (published, or a job of
    theirs ended) within ``KEEP_S`` of ``now``."""
    kept, dropped = [], []
    for position, entry in enumerate(index):
        from_newest = len(index) - position
        jobs = [job for job in entry["jobs"] if job in job_ends]
        alive = any(job_ends[job] is None for job in jobs)
        ends = [job_ends[job] for job in jobs if job_ends[job] is not None]
        recent = now - max([entry["published"], *ends]) <= KEEP_S
        if from_newest <= KEEP_PACKAGES or alive or (recent and from_newest <= MAX_PACKAGES):
            kept.append(entry)
        else:
            dropped.append(entry)
    return kept, dropped


def _index() -> list[dict]:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(INDEX_KEY, namespace=code_bootstrap.NAMESPACE)
    fields = {"digest", "published", "jobs"}
    return [e for e in json.loads(raw or b"[]") if isinstance(e, dict) and fields <= e.keys()]


def _change_index(change) -> None:
    """Write ``change(index)`` back at once (no transactions: see ``INDEX_KEY``)."""
    from ray.experimental import internal_kv

    index = change(_index())
    internal_kv._internal_kv_put(INDEX_KEY, json.dumps(index), namespace=code_bootstrap.NAMESPACE)


def _job_ends() -> dict[str, float | None]:
    """Every job the GCS knows: its end (Unix s), None while it runs."""
    from ray._private.state import jobs  # the GCS job table; no public API outside the jobs SDK

    return {job["JobID"]: job["EndTime"] / 1000 if job["IsDead"] else None for job in jobs()}


def kept_packages() -> list[str]:
    """The digests of the packages the connected Ray's GCS holds, in order of publication."""
    from ray.experimental import internal_kv

    namespace = code_bootstrap.NAMESPACE
    return [
        entry["digest"]
        for entry in _index()
        if internal_kv._internal_kv_exists(
            code_bootstrap.package_key(entry["digest"]), namespace=namespace
        )
    ]


def forget() -> None:
    """This driver left Ray: remote entry points made from now on are Ray's own again."""
    global _published
    _published = None


def shipped_digest() -> str | None:
    """The package that remote entry points made now ship: this driver's, while it is
    connected to the Ray it published it to, or in a worker the one it installed (so that a
    trial's host actors get the trial's code)."""
    import ray

    if _published is not None and ray.is_initialized():
        address, digest = _published
        if ray.get_runtime_context().gcs_address == address:
            return digest
    return os.environ.get(code_bootstrap.SHIPPED_VARIABLE)


class Shipped:
    """A stand-in's ``ray.remote`` (``actors.code_bootstrap``) with the real one's calling
    convention: ``options(...)`` as Ray's, ``remote(*args, **kwargs)`` pickles the arguments
    for the stand-in to unpickle once the code is installed."""

    def __init__(self, remote):
        self._remote = remote

    def options(self, **options) -> Shipped:
        return Shipped(self._remote.options(**options))

    def remote(self, *args, **kwargs):
        from ray import cloudpickle

        return self._remote.remote(cloudpickle.dumps((args, kwargs)))


_made: dict[tuple, Any] = {}  # (real, digest, its decorator options' repr) → its ray.remote


def actor_class(cls: type, **decorator_options):
    """``ray.remote(**decorator_options)(cls)``, or where code is shipped its stand-in's."""
    return _made_remote(
        cls,
        decorator_options,
        lambda digest: code_bootstrap.actor_stand_in(
            digest, cls.__module__, cls.__qualname__, ray_methods(cls)
        ),
    )


def remote_function(function):
    """``ray.remote(function)``, or where code is shipped its stand-in's."""
    return _made_remote(
        function,
        {},
        lambda digest: code_bootstrap.function_stand_in(
            digest, function.__module__, function.__qualname__
        ),
    )


def _made_remote(real, decorator_options: dict, stand_in):
    """``real``'s ``ray.remote``, or where code is shipped (``shipped_digest``) that of
    ``stand_in(digest)`` wrapped in ``Shipped``; made once per digest and options."""
    digest = shipped_digest()
    made = (real, digest, repr(sorted(decorator_options.items())))
    if made not in _made:
        if digest is None:
            _made[made] = _remote(real, decorator_options)
        else:
            _made[made] = Shipped(_remote(stand_in(digest), decorator_options))
    return _made[made]


def ray_methods(cls: type) -> dict[str, dict]:
    """``cls``'s public methods → the Ray options ``ray.method`` gave each (``__ray_…__``).
    The stand-in forwards calls as plain functions: an async or generator method would need
    its own, and is refused."""
    methods = dict(inspect.getmembers(cls, inspect.isfunction))
    unforwardable = [
        name
        for name, method in methods.items()
        if inspect.iscoroutinefunction(method)
        or inspect.isgeneratorfunction(method)
        or inspect.isasyncgenfunction(method)
    ]
    if unforwardable:
        raise TypeError(f"{cls.__qualname__}: a stand-in cannot forward {unforwardable}")
    return {
        name: {key: value for key, value in vars(method).items() if key.startswith("__ray_")}
        for name, method in methods.items()
        if not name.startswith("_")
    }


def _remote(target, decorator_options: dict):
    import ray

    return ray.remote(**decorator_options)(target) if decorator_options else ray.remote(target)
