"""Federated EMNIST (FEMNIST) read from TensorFlow Federated's HDF5 files.

On-disk layout (what ``tff.simulation.datasets.emnist.load_data`` downloaded before TFF moved to
SQLite: ``https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2`` and
``fed_emnist_digitsonly.tar.bz2`` hold the two ``.h5`` files at the archive's top level)::

    ROOT/fed_emnist_train.h5                  only_digits=False (default): 3,400 writers, 62 classes
    ROOT/fed_emnist_test.h5                   671,585 train / 77,483 test examples
    ROOT/fed_emnist_digitsonly_train.h5       only_digits=True: 3,383 writers, 10 classes
    ROOT/fed_emnist_digitsonly_test.h5        341,873 train / 40,832 test examples

(with TFF's own cache, ROOT is ``<cache_dir>/datasets``). Each file has one HDF5 group per writer::

    /examples/<writer_id>/pixels   (n, 28, 28) float, in [0, 1], 1.0 = background (white)
    /examples/<writer_id>/label    (n,) integer: 0-9 digits, 10-35 'A'-'Z', 36-61 'a'-'z'

which is TFF's ``HDF5ClientData`` layout (client ids = the sorted keys of ``/examples``; writer
ids look like ``f0000_14``). Every writer has examples in both files (TFF splits each writer's
examples into train and test).

What this module returns:

* ``x``: uint8 (N, 1, 28, 28), ``round(255 * pixels)`` -- a quarter of float32's memory, lossless
  when the pixels are k/255 (8-bit source images), else off by at most 1/510. TFF's polarity is
  kept (255 = background, 0 = ink), the *inverse* of MNIST/EMNIST as torchvision reads them;
  invert (``255 - x``) in a transform if a model expects MNIST's polarity.
* ``y``: int64 labels as stored.
* ``group``: int64 writer index: the sorted union of the writer ids of both files, so one writer
  has the same index in train and test (with TFF's files both files hold the same 3,400 ids).
"""

from __future__ import annotations

import os
import shutil
import tarfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from datasets.arrays import LabeledArrays
from datasets.download import download_checked, file_digest

URL_BASE = "https://storage.googleapis.com/tff-datasets-public/"
# SHA-256 of the archives, as TFF's (HDF5-era) ``emnist.load_data`` checks them.
ARCHIVE_SHA256 = {
    False: "fe1ed5a502cea3a952eb105920bff8cffb32836b5173cb18a57a32c3606f3ea0",
    True: "55333deb8546765427c385710ca5e7301e16f4ed8b60c1dc5ae224b42bd5b14b",
}
NUM_WRITERS = {False: 3400, True: 3383}
NUM_CLASSES = {False: 62, True: 10}
IMAGE_SHAPE = (28, 28)
EXAMPLES_GROUP = "examples"


class FemnistFormatError(ValueError):
    """A FEMNIST file exists but is not in TFF's layout (unreadable, wrong group/dataset shapes)."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")

    def __reduce__(self):
        return (self.__class__, (self.path, self.reason), self.__dict__)


def file_prefix(only_digits: bool = False) -> str:
    return "fed_emnist_digitsonly" if only_digits else "fed_emnist"


def archive_name(only_digits: bool = False) -> str:
    return f"{file_prefix(only_digits)}.tar.bz2"


def femnist_files(root: str | Path, only_digits: bool = False) -> tuple[Path, Path]:
    """``(ROOT/<prefix>_train.h5, ROOT/<prefix>_test.h5)``."""
    root = Path(root)
    prefix = file_prefix(only_digits)
    return root / f"{prefix}_train.h5", root / f"{prefix}_test.h5"


def _open(path: Path):
    import h5py  # imported here so that importing this module stays cheap

    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        raise FemnistFormatError(path, f"not a readable HDF5 file ({exc})") from exc
    examples = handle.get(EXAMPLES_GROUP)
    if not isinstance(examples, h5py.Group):
        handle.close()
        raise FemnistFormatError(path, f"no top-level group '/{EXAMPLES_GROUP}'")
    return handle, examples


def read_writer_ids(path: str | Path) -> list[str]:
    """The writer ids (keys of ``/examples``) of one file, sorted."""
    handle, examples = _open(Path(path))
    with handle:
        return sorted(examples.keys())


def read_femnist_file(
    path: str | Path, writer_index: Mapping[str, int], num_classes: int = 62
) -> LabeledArrays:
    """Read one TFF FEMNIST ``.h5`` file; rows are ordered by writer index, then as stored."""
    import h5py

    path = Path(path)
    handle, examples = _open(path)
    with handle:
        writers = sorted(examples.keys(), key=lambda w: writer_index[w])
        counts = []
        for writer in writers:
            group = examples[writer]
            pixels, labels = group.get("pixels"), group.get("label")
            if not isinstance(pixels, h5py.Dataset) or not isinstance(labels, h5py.Dataset):
                raise FemnistFormatError(path, f"writer {writer!r} lacks 'pixels' or 'label'")
            n = labels.shape[0] if labels.ndim == 1 else -1
            if n < 0 or pixels.shape != (n, *IMAGE_SHAPE):
                raise FemnistFormatError(
                    path,
                    f"writer {writer!r}: pixels {pixels.shape} and label {labels.shape} "
                    f"do not match (n, 28, 28) and (n,)",
                )
            if not np.issubdtype(pixels.dtype, np.floating):
                raise FemnistFormatError(path, f"writer {writer!r}: pixels are {pixels.dtype}")
            if not np.issubdtype(labels.dtype, np.integer):
                raise FemnistFormatError(path, f"writer {writer!r}: labels are {labels.dtype}")
            counts.append(n)

        total = int(sum(counts))
        x = np.empty((total, 1, *IMAGE_SHAPE), dtype=np.uint8)
        y = np.empty(total, dtype=np.int64)
        group_ids = np.empty(total, dtype=np.int64)
        start = 0
        for writer, n in zip(writers, counts, strict=True):
            if n == 0:
                continue
            pixels = np.asarray(examples[writer]["pixels"][()], dtype=np.float32)
            labels = np.asarray(examples[writer]["label"][()])
            if not (np.isfinite(pixels).all() and pixels.min() >= 0.0 and pixels.max() <= 1.0):
                raise FemnistFormatError(path, f"writer {writer!r}: pixels outside [0, 1]")
            if labels.min() < 0 or labels.max() >= num_classes:
                raise FemnistFormatError(
                    path, f"writer {writer!r}: labels outside 0..{num_classes - 1}"
                )
            stop = start + n
            x[start:stop, 0] = np.rint(pixels * 255.0).astype(np.uint8)
            y[start:stop] = labels
            group_ids[start:stop] = writer_index[writer]
            start = stop
    return LabeledArrays(x, y, group_ids)


def femnist_writer_ids(root: str | Path, only_digits: bool = False) -> list[str]:
    """Writer id of every group index: ``femnist_writer_ids(...)[g]`` wrote rows with group g."""
    train_path, test_path = femnist_files(root, only_digits)
    return sorted(set(read_writer_ids(train_path)) | set(read_writer_ids(test_path)))


def load_femnist(
    root: str | Path, only_digits: bool = False
) -> tuple[LabeledArrays, LabeledArrays]:
    """(train, test) from ``ROOT/<prefix>_{train,test}.h5``; see the module docstring.

    Raises FileNotFoundError when a file is absent and FemnistFormatError when one is malformed
    (``datasets.vision.load_source("femnist", ...)`` turns both into a SourceMissingError).
    """
    train_path, test_path = femnist_files(root, only_digits)
    for path in (train_path, test_path):
        if not path.is_file():
            raise FileNotFoundError(path)
    writers = femnist_writer_ids(root, only_digits)
    index = {writer: i for i, writer in enumerate(writers)}
    classes = NUM_CLASSES[bool(only_digits)]
    return (
        read_femnist_file(train_path, index, classes),
        read_femnist_file(test_path, index, classes),
    )


def download_femnist(root: str | Path, only_digits: bool = False) -> None:
    """Fetch ``URL_BASE + <prefix>.tar.bz2`` into ROOT, check its SHA-256, extract the two files.

    Files already present are kept; a verified archive already in ROOT is reused offline.
    """
    root = Path(root)
    targets = femnist_files(root, only_digits)
    if all(path.is_file() for path in targets):
        return
    archive = root / archive_name(only_digits)
    expected = ARCHIVE_SHA256[bool(only_digits)]
    if not (archive.is_file() and file_digest(archive, "sha256") == expected):
        download_checked(URL_BASE + archive.name, archive, "sha256", expected)
    wanted = {path.name: path for path in targets}
    with tarfile.open(archive, "r:bz2") as tar:
        for member in tar:
            target = wanted.pop(Path(member.name).name, None)
            if target is None or not member.isfile():
                continue
            partial = target.with_name(target.name + ".part")
            with tar.extractfile(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(partial, target)
    if wanted:
        raise OSError(f"{archive} does not contain {', '.join(sorted(wanted))}")
