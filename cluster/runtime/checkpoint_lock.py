"""One run at a time per checkpoint: an exclusive lock held while a run or resume may write it.

Two commands writing one checkpoint lose work and misreport privacy: two resumes of one
checkpoint each log rounds into the same MLflow run and the later to end rewrites the checkpoint
and the run's summary with its own, possibly fewer, rounds (its ε below what the run released);
two untracked runs of the same experiment, preset and seed share a checkpoint name, and the
second overwrites the first's after both passed the overwrite check. So ``run_experiment``
holds the lock of the checkpoint it writes from when its name is known (the MLflow run open)
to its end; ``resume`` takes the locks of the checkpoint it reads and of the one it writes
before it reads it again, and an untracked ``run`` its own before checking the overwrite
again; a process takes a lock it holds without conflict.

The lock is ``flock`` on a hidden file beside the checkpoint, ``.<name>.lock`` (never the
checkpoint itself: it is replaced by a rename at every save). The kernel drops it when the
process ends, however it ends, so a killed run leaves nothing to clean up; the file stays. On
an object store (``s3://``) there is no such lock: nothing is taken there (docs/running.md).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from cluster.config import ConfigError
from datasets.locations import Location

# The lock files this process holds (resolved paths): a command holds a checkpoint's lock once,
# however many of its parts take it (the resume command, then ``run_experiment``).
_HELD: dict[Path, int] = {}
_HELD_GUARD = threading.Lock()


def lock_file(checkpoint: Path) -> Path:
    return checkpoint.with_name(f".{checkpoint.name}.lock")


@contextmanager
def checkpoint_locks(*checkpoints: Location) -> Iterator[None]:
    """Hold the lock of every local checkpoint path given for the block (each file once, by its
    resolved path; a directory this process cannot write is one it will not write a
    checkpoint to: no lock there); a ``ConfigError`` naming the checkpoint where another
    process holds one."""
    with ExitStack() as held:
        locks = {}
        for checkpoint in checkpoints:
            if isinstance(checkpoint, Path):
                checkpoint.parent.mkdir(parents=True, exist_ok=True)
                if os.access(checkpoint.parent, os.W_OK):
                    locks.setdefault(
                        lock_file(checkpoint.parent.resolve() / checkpoint.name), checkpoint
                    )
        for lock, checkpoint in locks.items():
            held.enter_context(_locked(lock, checkpoint))
        yield


@contextmanager
def _locked(lock: Path, checkpoint: Path) -> Iterator[None]:
    with _HELD_GUARD:
        if lock in _HELD:  # this process holds it already
            _HELD[lock] += 1
            descriptor = None
        else:
            descriptor = _take(lock, checkpoint)
            _HELD[lock] = 1
    try:
        yield
    finally:
        with _HELD_GUARD:
            _HELD[lock] -= 1
            if not _HELD[lock]:
                del _HELD[lock]
                if descriptor is not None:
                    os.close(descriptor)  # releases the lock


def _take(lock: Path, checkpoint: Path) -> int | None:
    """The descriptor holding ``lock`` (None where the filesystem has no ``flock``: nothing is
    held, as on an object store)."""
    # Read-only suffices for flock; others in a shared directory can open it too.
    flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(lock, flags, 0o644)
    except OSError as error:  # a link planted there
        raise ConfigError(
            "checkpoint.dir",
            str(checkpoint),
            f"its lock file {lock} cannot be opened ({error.strerror}): remove it if it is a "
            "link, or set checkpoint.dir to a directory of yours",
        ) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise ConfigError(
            "checkpoint.dir",
            str(checkpoint),
            "another run or resume is writing this checkpoint now (it holds its lock, "
            f"{lock.name}): wait for it to end, or give this run another checkpoint.dir",
        ) from None
    except OSError:  # ENOSYS, ENOLCK, EOPNOTSUPP: a filesystem without flock (Lustre, FUSE)
        os.close(descriptor)
        return None
    return descriptor
