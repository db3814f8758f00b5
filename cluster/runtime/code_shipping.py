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
the newest ``KEEP_PACKAGES`` versions (``_prune``); each node keeps what it unpacked in Ray's
session directory.
"""

from __future__ import annotations

import inspect
import io
import json
import time
import zipfile
from typing import Any

from actors import code_bootstrap
from actors.code_digest import PROJECT_ROOT, digest_of, read_sources

KEEP_PACKAGES = 16
INDEX_KEY = "index"  # JSON: [[digest, published at (Unix s)], …], newest last

_published: str | None = None  # this driver's package, while connected


def publish(root=PROJECT_ROOT) -> str:
    """Put the code under ``root`` in the connected Ray's GCS (unless there already) and ship
    it to the remote entry points made from now on; returns its digest."""
    global _published
    from ray.experimental import internal_kv

    sources = read_sources(root)
    digest = digest_of(sources)
    key = code_bootstrap.package_key(digest)
    namespace = code_bootstrap.NAMESPACE
    if not internal_kv._internal_kv_exists(key, namespace=namespace):
        internal_kv._internal_kv_put(key, zipped(sources), overwrite=False, namespace=namespace)
    _prune(digest)
    _published = digest
    return digest


def zipped(sources: dict[str, bytes]) -> bytes:
    """``sources`` (relative path → bytes) as a deflated zip, the same bytes for the same
    sources (fixed timestamps)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as package:
        for path, text in sources.items():
            package.writestr(zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0)), text)
    return buffer.getvalue()


def _prune(digest: str) -> None:
    """Record ``digest`` as the newest package and delete those beyond the newest
    ``KEEP_PACKAGES`` (a run still using one that old would find it gone only when an actor
    of it restarts on a node that never unpacked it: ``CodePackageMissing``)."""
    from ray.experimental import internal_kv

    namespace = code_bootstrap.NAMESPACE
    raw = internal_kv._internal_kv_get(INDEX_KEY, namespace=namespace)
    index = [entry for entry in json.loads(raw or b"[]") if entry[0] != digest]
    index.append([digest, time.time()])
    for old, _ in index[:-KEEP_PACKAGES]:
        internal_kv._internal_kv_del(code_bootstrap.package_key(old), namespace=namespace)
    index = index[-KEEP_PACKAGES:]
    internal_kv._internal_kv_put(INDEX_KEY, json.dumps(index), namespace=namespace)


def kept_packages() -> list[str]:
    """The digests of the packages the connected Ray's GCS holds, oldest first."""
    from ray.experimental import internal_kv

    namespace = code_bootstrap.NAMESPACE
    raw = internal_kv._internal_kv_get(INDEX_KEY, namespace=namespace)
    return [
        digest
        for digest, _ in json.loads(raw or b"[]")
        if internal_kv._internal_kv_exists(code_bootstrap.package_key(digest), namespace=namespace)
    ]


def forget() -> None:
    """This driver left Ray: remote entry points made from now on are Ray's own again."""
    global _published
    _published = None


def shipped_digest() -> str | None:
    """The package that remote entry points made now ship: this driver's, or in a worker the
    one it installed (so that a trial's host actors get the trial's code)."""
    import os

    return _published or os.environ.get(code_bootstrap.SHIPPED_VARIABLE)


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
    digest = shipped_digest()
    made = (cls, digest, repr(sorted(decorator_options.items())))
    if made not in _made:
        if digest is None:
            _made[made] = _remote(cls, decorator_options)
        else:
            stand_in = code_bootstrap.actor_stand_in(
                digest, cls.__module__, cls.__qualname__, ray_methods(cls)
            )
            _made[made] = Shipped(_remote(stand_in, decorator_options))
    return _made[made]


def ray_methods(cls: type) -> dict[str, dict]:
    """``cls``'s public methods → the Ray options ``ray.method`` gave each (``__ray_…__``)."""
    return {
        name: {key: value for key, value in vars(method).items() if key.startswith("__ray_")}
        for name, method in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def _remote(target, decorator_options: dict):
    import ray

    return ray.remote(**decorator_options)(target) if decorator_options else ray.remote(target)


def remote_function(function):
    """``ray.remote(function)``, or where code is shipped its stand-in's."""
    digest = shipped_digest()
    made = (function, digest, "")
    if made not in _made:
        if digest is None:
            _made[made] = _remote(function, {})
        else:
            stand_in = code_bootstrap.function_stand_in(
                digest, function.__module__, function.__qualname__
            )
            _made[made] = Shipped(_remote(stand_in, {}))
    return _made[made]
