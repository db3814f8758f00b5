"""IDX files (the MNIST/EMNIST format): their header, checks of a file against the rows and
labels it should hold, reading one, and inflating one from its .gz or its member of a .zip
(``datasets.vision`` plans which and reports what is missing or corrupt)."""

from __future__ import annotations

import gzip
import os
import shutil
import struct
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datasets.download import MD5, file_digest

MNIST_IMAGE = (28, 28)  # the rows of an MNIST/EMNIST images file


def _idx_dims(header: bytes, ndim: int) -> tuple[int, ...] | str:
    """Dims from an IDX header of unsigned bytes with ``ndim`` dims, or the reason it is not."""
    if len(header) < 4 + 4 * ndim:
        return "corrupt: shorter than an IDX header"
    if header[:4] != bytes((0, 0, 0x08, ndim)):
        return f"corrupt: IDX magic {header[:4].hex()}, expected 000008{ndim:02x}"
    return struct.unpack(f">{ndim}I", header[4 : 4 + 4 * ndim])


def _check_idx(path: Path, ndim: int) -> tuple[int, ...] | str:
    """Dims of an uncompressed IDX file whose size matches its header, or the reason it does not."""
    with open(path, "rb") as f:
        dims = _idx_dims(f.read(4 + 4 * ndim), ndim)
    if isinstance(dims, str):
        return dims
    expected = 4 + 4 * ndim + int(np.prod(dims, dtype=np.int64))
    size = path.stat().st_size
    if size != expected:
        return f"corrupt: {size} bytes, its IDX header implies {expected}"
    return dims


def check_idx_pair(images: Path, labels: Path, lo: int, hi: int) -> list[tuple[Path, str]]:
    """Problems of an (images, labels) pair of uncompressed IDX files with labels in lo..hi."""
    image_dims = _check_idx(images, 3)
    label_dims = _check_idx(labels, 1)
    problems = []
    if isinstance(image_dims, str):
        problems.append((images, image_dims))
    elif image_dims[1:] != MNIST_IMAGE:
        problems.append((images, f"corrupt: images are {image_dims[1:]}, expected 28x28"))
    if isinstance(label_dims, str):
        problems.append((labels, label_dims))
    else:
        values = np.fromfile(labels, dtype=np.uint8, offset=8)
        if len(values) and (values.min() < lo or values.max() > hi):
            problems.append((labels, f"corrupt: labels outside {lo}..{hi}"))
    if not problems and image_dims[0] != label_dims[0]:
        problems.append((labels, f"corrupt: {label_dims[0]} labels for {image_dims[0]} images"))
    return problems


def read_idx_gz(path: str | Path, ndim: int) -> np.ndarray:
    """A gzip-compressed IDX file of unsigned bytes with ``ndim`` dims, as a uint8 array."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = _idx_dims(data, ndim)
    if isinstance(dims, str):
        raise ValueError(f"{path}: {dims}")
    offset = 4 + 4 * ndim
    count = int(np.prod(dims, dtype=np.int64))
    if len(data) != offset + count:
        raise ValueError(f"{path}: {len(data)} bytes decompressed, header implies {offset + count}")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims)


@dataclass(frozen=True)
class Inflate:
    """Decompress ``source`` (a .gz file, or the .gz member ``member`` of zip ``source``)."""

    target: Path
    source: Path
    member: str | None = None


def plan_idx(
    targets: Sequence[Path],
    gz_candidates: Callable[[Path], list[Path]],
    gz_md5: Callable[[Path], str | None],
    zip_path: Path | None = None,
    zip_md5: Callable[[], str] | None = None,
) -> tuple[list[Inflate], list[tuple[Path, str]]]:
    """How to make every missing uncompressed IDX target, or the problems that prevent it."""
    steps: list[Inflate] = []
    problems: list[tuple[Path, str]] = []
    zip_state: str | list[str] | None = None  # reason it is unusable, or its member names
    for target in targets:
        if target.is_file():
            continue
        source = next((c for c in gz_candidates(target) if c.is_file()), None)
        if source is not None:
            want = gz_md5(source)
            actual = md5(source) if want else None
            if want and actual != want:
                problems.append((source, f"corrupt: md5 {actual}, expected {want}"))
                problems.append((target, "missing"))
            else:
                steps.append(Inflate(target, source))
            continue
        if zip_path is not None and zip_path.is_file():
            if zip_state is None:
                want = zip_md5() if zip_md5 else None
                actual = md5(zip_path) if want else None
                if want and actual != want:
                    zip_state = f"corrupt: md5 {actual}, expected {want}"
                    problems.append((zip_path, zip_state))
                else:
                    try:
                        with zipfile.ZipFile(zip_path) as archive:
                            zip_state = archive.namelist()
                    except (OSError, zipfile.BadZipFile) as exc:
                        zip_state = f"corrupt: {exc}"
                        problems.append((zip_path, zip_state))
            member = f"gzip/{target.name}.gz"
            if isinstance(zip_state, list) and member in zip_state:
                steps.append(Inflate(target, zip_path, member))
                continue
        problems.append((target, "missing"))
    return steps, problems


def inflate(step: Inflate) -> list[tuple[Path, str]]:
    partial = step.target.with_name(f"{step.target.name}.{os.getpid()}.part")
    try:
        if step.member is None:
            with gzip.open(step.source, "rb") as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        else:
            with (
                zipfile.ZipFile(step.source) as archive,
                archive.open(step.member) as raw,
                gzip.GzipFile(fileobj=raw) as src,
                open(partial, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, step.target)
    except PermissionError as exc:
        return [(step.target, f"missing; cannot write it from {step.source}: {exc}")]
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        partial.unlink(missing_ok=True)
        where = step.source if step.member is None else f"{step.source}:{step.member}"
        return [(step.source, f"corrupt: cannot decompress {where}: {exc}")]
    return []


def md5(path: Path) -> str:
    return file_digest(path, MD5)
