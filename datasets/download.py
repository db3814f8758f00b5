"""File digests and checked downloads for the raw dataset files."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path

# MD5 only identifies files here (torchvision's checksums), never secures anything.
MD5 = functools.partial(hashlib.md5, usedforsecurity=False)


def file_digest(path: str | Path, digest: str | Callable = "sha256") -> str:
    """Hex digest of a file; ``digest`` is a hashlib name or constructor (e.g. ``MD5``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, digest).hexdigest()


def download_checked(url: str, target: Path, digest: str | Callable, expected: str) -> None:
    """Fetch ``url`` to ``target.part``, check its digest, then move it onto ``target``.

    Raises OSError naming ``url`` when the download fails or the digest differs; ``target`` is
    then untouched and no partial file is left behind.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    try:
        try:
            with urllib.request.urlopen(url) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except OSError as exc:
            raise OSError(f"{url}: {exc}") from exc
        with open(partial, "rb") as f:
            hashed = hashlib.file_digest(f, digest)
        if hashed.hexdigest() != expected:
            raise OSError(f"{url}: {hashed.name} {hashed.hexdigest()}, expected {expected}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
