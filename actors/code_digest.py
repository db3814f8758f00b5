"""What a host process runs: a digest of the project's code and of the libraries it imported.

A warm host (``actors.ray_actor.WarmHostActor``) outlives the run that started it; the next run
may use it only if it would run the same code, which this digest says: the driver and the
actor each compute it, from the files and the versions in their own process.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "algorithms", "cluster", "datasets", "models", "privacy")
LIBRARIES = ("numpy", "pyarrow", "ray", "torch")


def code_digest(root: Path = PROJECT_ROOT) -> str:
    """SHA-256 of every ``.py`` file of the project's packages under ``root`` (path and bytes,
    in path order), the Python version and the installed versions of ``LIBRARIES``."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    digest.update(platform.python_version().encode())
    for library in LIBRARIES:
        try:
            installed = version(library)
        except PackageNotFoundError:
            installed = "absent"
        digest.update(f"\0{library}={installed}".encode())
    return digest.hexdigest()
