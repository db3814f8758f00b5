"""A Ray worker's side of the project's code shipped through Ray's GCS
(``cluster.runtime.code_shipping`` is the driver's side).

A worker started without the project's code runs the stand-ins made here: an actor class
(``actor_stand_in``) or a function (``function_stand_in``) that first makes the code package
importable (``install``), then imports the real class or function by name and runs it on its
arguments, which the driver pickled into one ``bytes`` (Ray would otherwise unpickle them before
the code that defines their classes is importable). This module imports only the standard
library and Ray, and cloudpickle sends it by value (``register_pickle_by_value`` below), so that
such a worker can run it.
"""

from __future__ import annotations

import fcntl
import importlib
import io
import os
import pickle
import shutil
import stat
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ray import cloudpickle

NAMESPACE = "dpfl-code"  # in the GCS's key-value store
# In a worker that installed a package: its digest, so that the actors and tasks it starts in
# turn (a sweep's trial starts its run's host actors) are shipped the same code.
SHIPPED_VARIABLE = "DPFL_SHIPPED_CODE"
# In each unpacked package: every process that runs it holds a shared lock (flock) on this file
# until it exits, so that a package is deleted from a node only while no process runs it.
IN_USE = ".in-use"
UNUSED_S = 2 * 24 * 3600  # an unpacked package no process runs, last installed before: deleted
STALE_S = 3600  # a leftover of a worker killed while it unpacked or deleted a package: deleted


class CodePackageMissing(RuntimeError):
    """The GCS holds no package of the digest a worker was told to install."""


def package_key(digest: str) -> str:
    return f"package/{digest}"


def install(digest: str) -> None:
    """Make the code package ``digest`` importable in this process: unpacked once per node
    (``unpack_root``), under its digest (a directory that exists holds the whole
    package: ``_unpacked``), held by this process while it lives (``_held``), and put first on
    ``sys.path`` (and on ``PYTHONPATH``, for the processes it starts: a trial's tracking
    process). A process runs one package: asked for another, it refuses (its modules are
    imported already)."""
    installed = os.environ.get(SHIPPED_VARIABLE)
    if installed == digest:
        return
    if installed:
        raise RuntimeError(
            f"this Ray worker runs the project's code {installed[:12]}, not {digest[:12]}"
        )
    root = str(_held(unpack_root(), digest))
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.environ[SHIPPED_VARIABLE] = digest


def unpack_root() -> Path:
    """Where this node's workers unpack packages: ``dpfl-code-<uid>`` in the temporary
    directory (``private_directory``). Not Ray's session directory, which every local user may
    write to without the sticky bit, so that another user could rename this directory away
    and plant code the workers import."""
    return private_directory(Path(tempfile.gettempdir()) / f"dpfl-code-{os.getuid()}")


def private_directory(path: Path) -> Path:
    """``path``, created if missing, once it is a directory of this user's that no one else may
    write to (not a link), in a directory whose other entries other users cannot rename (theirs
    alone, or sticky like ``/tmp``)."""
    path.mkdir(mode=0o700, exist_ok=True)
    status, parent = path.lstat(), path.parent.stat()
    own = stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid()
    parent_safe = parent.st_mode & stat.S_ISVTX or (
        parent.st_uid in (0, os.getuid()) and not parent.st_mode & 0o022
    )
    if not own or status.st_mode & 0o022 or not parent_safe:
        raise PermissionError(
            f"{path}: not a directory of this user's that only it may write to, in a directory "
            "where no other user can replace it; remove it, or set TMPDIR to a private directory"
        )
    return path


def _held(base: Path, digest: str) -> Path:
    """Package ``digest`` unpacked in ``base``, with this process's shared lock on its
    ``IN_USE`` file (the descriptor is never closed: the lock ends with the process) and its
    time of last use set to now. Should ``_tidy`` delete it between the unpacking and the lock,
    it is unpacked again."""
    for _ in range(3):
        target = _unpacked(base, digest)
        try:  # created here where a package was unpacked by an older version of this module
            held = os.open(target / IN_USE, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:  # deleted meanwhile
            continue
        except OSError as error:  # a link: not ours
            raise PermissionError(
                f"{target / IN_USE}: not a file this module made ({error.strerror}); remove "
                f"{target}"
            ) from None
        fcntl.flock(held, fcntl.LOCK_SH)  # waits while a ``_tidy`` decides on it
        if _is_current_lock(target, held):
            os.utime(target)
            return target
        os.close(held)
    raise RuntimeError(f"{base / digest}: deleted each time this worker unpacked it")


def _is_current_lock(package: Path, descriptor: int) -> bool:
    """Whether ``descriptor`` is ``package``'s ``IN_USE`` file now (not one of a copy of the
    package deleted meanwhile)."""
    try:
        return os.lstat(package / IN_USE).st_ino == os.fstat(descriptor).st_ino
    except FileNotFoundError:
        return False


def _unpacked(base: Path, digest: str) -> Path:
    from ray.experimental import internal_kv

    target = base / digest
    if target.is_dir():
        return target
    data = internal_kv._internal_kv_get(package_key(digest), namespace=NAMESPACE)
    if data is None:
        raise CodePackageMissing(
            f"Ray's GCS holds no package of the project's code {digest[:12]}: a driver pruned "
            "it (cluster.runtime.code_shipping.kept_entries) or the head was restarted; start "
            "the run again from its checkpoint"
        )
    staging = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=base))
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as package:
            package.extractall(staging)  # names are checked: none leaves ``staging``
        (staging / IN_USE).touch(0o600)
        try:
            os.rename(staging, target)  # atomic: whole or absent
        except OSError:  # another worker of this node unpacked it first
            if not target.is_dir():
                raise
        else:  # a new version on this node: the time to delete what no one runs any more
            _tidy(base, keep=digest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _tidy(base: Path, keep: str) -> None:
    """Delete from ``base`` the packages besides ``keep`` that no process holds (``_held``) and
    none installed within ``UNUSED_S``, and the leftovers (names starting with ``.``: a staging
    or deleted directory whose worker was killed) older than ``STALE_S``."""
    for entry in base.iterdir():
        if entry.name.startswith("."):
            if _older_than(entry, STALE_S):
                shutil.rmtree(entry, ignore_errors=True)
        elif entry.name != keep:
            _delete_unless_held(entry)


def _older_than(directory: Path, seconds: float) -> bool:
    """Whether ``directory`` (not a link) was last changed more than ``seconds`` ago."""
    try:
        status = directory.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(status.st_mode) and time.time() - status.st_mtime > seconds


def _delete_unless_held(package: Path) -> None:
    """Delete ``package`` unless a process holds it or one installed it within ``UNUSED_S``:
    renamed away while its ``IN_USE`` lock is taken exclusively (a worker that opened the lock
    file meanwhile sees it gone, and unpacks the package again), then removed. A package
    without ``IN_USE`` was unpacked by an older version of this module, whose workers take no
    lock: kept."""
    try:
        lock = os.open(package / IN_USE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return
    doomed = package.with_name(f".{package.name[:12]}-deleted-{os.getpid()}-{time.time_ns()}")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: a process runs it
        # Decided under the lock: another tidy may have deleted this package since it was
        # opened, and a worker unpacked and holds it again: only the same lock file counts.
        if not (_is_current_lock(package, lock) and _older_than(package, UNUSED_S)):
            return
        os.rename(package, doomed)
    except OSError:
        return
    finally:
        os.close(lock)
    shutil.rmtree(doomed, ignore_errors=True)


def load(digest: str, module: str, qualname: str):
    """``module.qualname`` from code package ``digest`` (installed first)."""
    install(digest)
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def actor_stand_in(digest: str, module: str, qualname: str, methods: dict[str, dict]) -> type:
    """A class for ``ray.remote`` standing for ``module.qualname``: its constructor takes the
    real one's arguments pickled (``(args, kwargs)``), installs package ``digest``, and builds
    the real object; each of ``methods`` (name → the Ray method options of the real one,
    ``__ray_…__`` attributes such as a concurrency group) calls the real object's. It keeps
    the real class's name (``ray::ClientHostActor`` in process lists and Ray's state)."""

    class StandIn:
        def __init__(self, arguments: bytes):
            real = load(digest, module, qualname)
            args, kwargs = pickle.loads(arguments)  # the driver's, in Ray's task spec
            self._real = real(*args, **kwargs)

    for name, options in methods.items():
        setattr(StandIn, name, _forwarding(name, options))
    StandIn.__name__ = StandIn.__qualname__ = qualname.rsplit(".", 1)[-1]
    return StandIn


def _forwarding(name: str, options: dict):
    def forward(self, *args, **kwargs):
        return getattr(self._real, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    for key, value in options.items():
        setattr(forward, key, value)
    return forward


def function_stand_in(digest: str, module: str, qualname: str):
    """A function for ``ray.remote`` standing for ``module.qualname``: it takes the real
    one's arguments pickled, installs package ``digest`` and calls it."""

    def call(arguments: bytes):
        real = load(digest, module, qualname)
        args, kwargs = pickle.loads(arguments)
        return real(*args, **kwargs)

    call.__name__ = call.__qualname__ = qualname.rsplit(".", 1)[-1]
    return call


cloudpickle.register_pickle_by_value(sys.modules[__name__])
