"""One run at a time per checkpoint: an exclusive lock held while a run or resume may write it.

Two commands writing one checkpoint lose work and misreport privacy: two resumes of one
checkpoint each log rounds into the same MLflow run and the later to end rewrites the checkpoint
and the run's summary with its own, possibly fewer, rounds (its ε below what the run released);
two untracked runs of the same experiment, preset and seed share a checkpoint name, and the
second overwrites the first's after both passed the overwrite check. So ``run`` takes the lock
of its checkpoint before that check, ``resume`` the locks of the checkpoint it reads and of the
one it writes before reading, and both hold them until they end.

The lock is ``flock`` on a hidden file beside the checkpoint, ``.<name>.lock`` (never the
checkpoint itself: it is replaced by a rename at every save). The kernel drops it when the
process ends, however it ends, so a killed run leaves nothing to clean up; the file stays. On
an object store (``s3://``) there is no such lock: nothing is taken there (docs/running.md).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from cluster.config import ConfigError
from datasets.locations import Location


def lock_file(checkpoint: Path) -> Path:
    return checkpoint.with_name(f".{checkpoint.name}.lock")


@contextmanager
def checkpoint_locks(*checkpoints: Location) -> Iterator[None]:
    """Hold the lock of every local checkpoint path given (each once) for the block; a
    ``ConfigError`` naming the checkpoint where another process holds one."""
    with ExitStack() as held:
        for checkpoint in dict.fromkeys(checkpoints):
            if isinstance(checkpoint, Path):
                held.enter_context(_locked(checkpoint))
        yield


@contextmanager
def _locked(checkpoint: Path) -> Iterator[None]:
    lock = lock_file(checkpoint)
    lock.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(lock, flags, 0o600)
    except OSError as error:  # a link planted there, or no permission
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
    try:
        yield
    finally:
        os.close(descriptor)  # releases the lock
