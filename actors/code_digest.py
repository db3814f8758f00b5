"""What a host process runs: a digest of the project's code and of the libraries it imported.

A warm host (``actors.ray_actor.WarmHostActor``) outlives the run that started it; the next run
may use it only if it would run the same code, which this digest says: the driver and the
actor each compute it, from the files and the versions in their own process. It also names the
package of the code shipped to Ray's workers (``cluster.runtime.code_shipping``).
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "algorithms", "cluster", "datasets", "models", "privacy")
LIBRARIES = ("numpy", "pyarrow", "ray", "torch")


def read_sources(root: Path = PROJECT_ROOT) -> dict[str, bytes]:
    """Every module file of the project's packages under ``root``: its path relative to
    ``root`` (POSIX) → its bytes, in path order. Only regular files named as Python modules
    (``name.py``, ``name`` an identifier): an editor's lock file (``.#module.py``, a dangling
    link) or backup is no module and is left out."""
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for package in PACKAGES
        for path in sorted((root / package).rglob("*.py"))
        if path.stem.isidentifier() and path.is_file() and not path.is_symlink()
    }


def code_digest(root: Path = PROJECT_ROOT) -> str:
    """``digest_of(read_sources(root))``."""
    return digest_of(read_sources(root))


def digest_of(sources: dict[str, bytes]) -> str:
    """SHA-256 of ``sources`` (path and bytes, in order), the Python version and the installed
    versions of ``LIBRARIES``."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for path, text in sources.items():
        digest.update(path.encode() + b"\0")
        digest.update(text + b"\0")
    digest.update(platform.python_version().encode())
    for library in LIBRARIES:
        try:
            installed = version(library)
        except PackageNotFoundError:
            installed = "absent"
        digest.update(f"\0{library}={installed}".encode())
    return digest.hexdigest()
