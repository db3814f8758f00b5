"""Checks that a location a run reads or writes can serve: an object store answers to these
credentials, a local directory can be written and is no kernel pseudo-filesystem. Each failure
is a ``ConfigError`` naming the field, the value and the fix; nothing is created."""

from __future__ import annotations

import os
import re
from pathlib import Path

from cluster.config import ConfigError
from cluster.config.paths import location_error
from datasets import locations
from datasets.locations import Location, LocationError, ObjectLocation


def check_object_store(field: str, location: Location) -> None:
    """For an object-store ``location``: credentials, its endpoint and its bucket are there
    (``locations.check_access``); nothing to check for a local path."""
    if isinstance(location, ObjectLocation):
        try:
            locations.check_access(location)
        except LocationError as error:
            raise location_error(field, str(location), error) from None


def check_writable_location(field: str, location: Location) -> None:
    """A local directory that can be written (``check_writable_dir``), or an object-store
    prefix whose bucket can be reached (``check_object_store``) and under which these
    credentials may write and delete (``locations.check_writable``: a probe object, written
    and deleted with the same short timeouts)."""
    if not isinstance(location, ObjectLocation):
        check_writable_dir(field, location)
        return
    check_object_store(field, location)
    try:
        locations.check_writable(location)
    except LocationError as error:
        raise location_error(field, str(location), error) from None


def check_writable_dir(field: str, path: Path) -> None:
    """``path`` is, or can be created as, a directory this process may write (nothing created),
    on a filesystem that holds files (``refuse_pseudo_filesystem``)."""
    refuse_pseudo_filesystem(field, path)
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as error:  # e.g. a name longer than the filesystem allows
        raise unusable(field, path, error) from None
    if not existing.is_dir():
        raise ConfigError(
            field, str(path), f"{existing} is a file, not a directory; choose another directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(field, str(path), f"{existing} is not writable; choose another directory")


def unusable(field: str, path: Path, error: OSError) -> ConfigError:
    return ConfigError(field, str(path), f"unusable ({error.strerror}); choose another directory")


# Kernel pseudo-filesystems: os.access calls /proc writable for root, yet no file can be created
# there. The roots are refused by name too (where /proc/self/mounts does not exist, and /dev
# may be a tmpfs in a container).
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


PSEUDO_FILESYSTEMS = frozenset(
    {
        "autofs",
        "binfmt_misc",
        "bpf",
        "cgroup",
        "cgroup2",
        "configfs",
        "debugfs",
        "devpts",
        "devtmpfs",
        "efivarfs",
        "fusectl",
        "hugetlbfs",
        "mqueue",
        "nsfs",
        "proc",
        "pstore",
        "securityfs",
        "selinuxfs",
        "sysfs",
        "tracefs",
    }
)


def refuse_pseudo_filesystem(field: str, path: Path) -> None:
    """A ``ConfigError`` when ``path`` (symlinks resolved) lies under ``PSEUDO_ROOTS`` or on a
    mount of a type in ``PSEUDO_FILESYSTEMS``."""
    real = os.path.realpath(path)
    mount, kind = _mount_of(real)
    root = next((r for r in PSEUDO_ROOTS if _is_within(real, r)), None)
    if root is not None or kind in PSEUDO_FILESYSTEMS:
        where = root or f"{mount} ({kind})"
        raise ConfigError(
            field,
            str(path),
            f"{real} is in {where}, a kernel pseudo-filesystem, not storage; choose a "
            "directory on a disk",
        )


def _mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount ``path`` lies on, from /proc/self/mounts
    (the last of stacked mounts wins); ("", "") where that is unreadable."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "", ""
    found = ("", "")
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        if _is_within(path, point) and len(point) >= len(found[0]):
            found = (point, fields[2])
    return found


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
