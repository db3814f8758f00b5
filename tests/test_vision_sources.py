"""Image sources: tiny files in each dataset's exact on-disk format, read through load_source.

torchvision md5-checks the CIFAR batch files, and this module md5-checks the MNIST ``.gz`` files
and NIST's EMNIST ``gzip.zip`` against torchvision's own tables; tiny stand-ins cannot match the
real checksums, so those tests monkeypatch torchvision's class attributes (``CIFAR10.train_list``,
``.test_list``, ``.meta``, ``CIFAR100`` likewise, ``MNIST.resources``, ``EMNIST.md5``) with the
stand-ins' md5s. Everything else runs the same code as real files.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from datasets import femnist, vision
from datasets.vision import (
    SOURCE_NAMES,
    SourceMissingError,
    expected_files,
    load_source,
    num_classes,
    prepare_command,
)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SHARED_MNIST = SHARED_DATA / "mnist"
MNIST_TEST_CLASS_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
needs_shared_mnist = pytest.mark.skipif(
    not (SHARED_MNIST / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").is_file(),
    reason=f"real MNIST test files not present under {SHARED_MNIST} (no /work/shared checkout)",
)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes, as LeCun's / NIST's files are written."""
    array = np.asarray(array, dtype=np.uint8)
    header = bytes((0, 0, 0x08, array.ndim)) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def random_images(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)


# ----------------------------------------------------------------------------- API basics


def test_options_and_names_are_validated():
    assert SOURCE_NAMES == ("mnist", "mnist_test_split", "emnist", "cifar10", "cifar100", "femnist")
    with pytest.raises(ValueError, match="unknown image source"):
        load_source("svhn", "/nowhere")
    with pytest.raises(TypeError, match="unknown option"):
        expected_files("cifar10", "/nowhere", split="byclass")
    with pytest.raises(ValueError, match="split"):
        expected_files("emnist", "/nowhere", split="digits")
    with pytest.raises(TypeError, match="only_digits"):
        expected_files("femnist", "/nowhere", only_digits="yes")
    assert [num_classes(n) for n in SOURCE_NAMES] == [10, 10, 62, 10, 100, 62]
    assert num_classes("emnist", split="balanced") == 47
    assert num_classes("emnist", split="letters") == 26
    assert num_classes("femnist", only_digits=True) == 10


def test_file_names_match_installed_torchvision(tmp_path):
    """The names checked without importing torchvision are the ones torchvision reads."""
    from torchvision.datasets import CIFAR10, CIFAR100, EMNIST, MNIST

    raw = tmp_path / "MNIST" / "raw"
    gz_names = [name for name, _ in MNIST.resources]
    assert expected_files("mnist", tmp_path) == [raw / n.removesuffix(".gz") for n in gz_names]
    assert {n: m for n, m in MNIST.resources if n.startswith("t10k")} == vision.MNIST_TEST_MD5
    assert list(vision.MNIST_MIRRORS) == MNIST.mirrors
    for split in vision.EMNIST_SPLITS:
        paths = []
        for train in (True, False):
            ds = EMNIST.__new__(EMNIST)  # only the path properties, no loading
            ds.root, ds.split, ds.train = str(tmp_path), split, train
            paths += [Path(ds.images_file), Path(ds.labels_file)]
        assert expected_files("emnist", tmp_path, split=split) == paths
    for name, cls in (("cifar10", CIFAR10), ("cifar100", CIFAR100)):
        names = [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        assert expected_files(name, tmp_path) == [tmp_path / cls.base_folder / f for f in names]


# ----------------------------------------------------------------------------- missing data


@pytest.mark.parametrize(
    "name,options",
    [
        ("mnist", {}),
        ("mnist_test_split", {}),
        ("emnist", {"split": "letters"}),
        ("cifar10", {}),
        ("cifar100", {}),
        ("femnist", {}),
        ("femnist", {"only_digits": True}),
    ],
)
def test_missing_root_lists_paths_and_command(tmp_path, name, options):
    root = tmp_path / "no-such-root"
    with pytest.raises(SourceMissingError) as info:
        load_source(name, root, **options)
    err = info.value
    paths = expected_files(name, root, **options)
    assert isinstance(err, FileNotFoundError)
    assert err.paths == paths and all(str(root) in str(p) for p in paths)
    command, hint = prepare_command(name, root, **options)
    message = str(err)
    for path in paths:
        assert f"  {path}  [missing]" in message
    assert command in message and hint in message and str(root) in command
    clone = pickle.loads(pickle.dumps(err))  # survives Ray's exception transport
    assert str(clone) == message and clone.paths == paths


def test_missing_root_imports_nothing_slow(tmp_path):
    code = f"""
import sys
from datasets.vision import SOURCE_NAMES, SourceMissingError, load_source
for name in SOURCE_NAMES:
    try:
        load_source(name, {str(tmp_path / "absent")!r})
    except SourceMissingError as err:
        assert "Prepare them with:" in str(err)
    else:
        raise AssertionError(name)
slow = sorted(m for m in ("torch", "torchvision", "h5py") if m in sys.modules)
assert not slow, slow
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_expected_command_texts(tmp_path):
    command, hint = prepare_command("cifar10", tmp_path)
    assert command == (
        f"python -c \"import torchvision; torchvision.datasets.CIFAR10('{tmp_path}', "
        'download=True)"'
    )
    assert str(tmp_path / "cifar-10-batches-py") in hint
    command, _ = prepare_command("emnist", tmp_path, split="balanced")
    assert f"EMNIST('{tmp_path}', split='balanced', download=True)" in command
    command, _ = prepare_command("femnist", tmp_path)
    assert "https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2" in command
    assert femnist.ARCHIVE_SHA256[False] in command and "tar -xjf fed_emnist.tar.bz2" in command
    command, _ = prepare_command("mnist_test_split", tmp_path)
    assert "9fb629c4189551a2d022fa330f9573f3  t10k-images-idx3-ubyte.gz" in command


# ----------------------------------------------------------------------------- MNIST


def write_mnist(root: Path, rng, sizes=(("train", 5), ("t10k", 3)), gz=True):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    data = {}
    for prefix, n in sizes:
        images, labels = random_images(rng, n), rng.integers(0, 10, size=n).astype(np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"{prefix}-{kind}-ubyte"
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress(idx_bytes(array)))
            else:
                (raw / name).write_bytes(idx_bytes(array))
        data[prefix] = (images, labels)
    return raw, data


def patch_mnist_md5(monkeypatch, raw: Path):
    from torchvision.datasets import MNIST

    resources = [(name, md5(raw / name)) for name, _ in MNIST.resources]
    monkeypatch.setattr(MNIST, "resources", resources)


def test_mnist_from_gzip_idx(tmp_path, monkeypatch):
    raw, data = write_mnist(tmp_path, np.random.default_rng(0))
    patch_mnist_md5(monkeypatch, raw)
    train, test = load_source("mnist", tmp_path)
    for part, (images, labels) in ((train, data["train"]), (test, data["t10k"])):
        assert part.x.shape == (len(labels), 1, 28, 28) and part.x.dtype == np.uint8
        assert part.x.flags.c_contiguous
        np.testing.assert_array_equal(part.x[:, 0], images)  # MNIST is not transposed
        assert part.y.dtype == np.int64
        np.testing.assert_array_equal(part.y, labels)
        assert part.group is None
    # decompressed next to the .gz, as torchvision's download does; a second load reuses them
    assert all(p.is_file() for p in expected_files("mnist", tmp_path))
    again, _ = load_source("mnist", tmp_path)
    np.testing.assert_array_equal(again.x, train.x)


def test_mnist_uncompressed_idx_needs_no_checksum(tmp_path):
    _, data = write_mnist(tmp_path, np.random.default_rng(1), gz=False)
    train, test = load_source("mnist", tmp_path)
    assert len(train) == 5 and len(test) == 3
    np.testing.assert_array_equal(test.y, data["t10k"][1])


def test_mnist_corrupt_files_are_reported(tmp_path):
    raw, _ = write_mnist(tmp_path, np.random.default_rng(2))
    # tiny .gz files do not match torchvision's md5 of the real ones
    with pytest.raises(SourceMissingError) as info:
        load_source("mnist", tmp_path)
    message = str(info.value)
    for name in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert f"  {raw / (name + '.gz')}  [corrupt: md5 " in message
        assert f"  {raw / name}  [missing]" in message
    assert not (raw / "train-images-idx3-ubyte").exists()  # nothing written on failure

    other = tmp_path / "truncated"
    raw, _ = write_mnist(other, np.random.default_rng(3), gz=False)
    with open(raw / "t10k-images-idx3-ubyte", "r+b") as f:
        f.truncate(100)
    (raw / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.array([1, 2, 3, 4, 12])))
    with pytest.raises(SourceMissingError) as info:
        load_source("mnist", other)
    assert info.value.paths == [raw / "train-labels-idx1-ubyte", raw / "t10k-images-idx3-ubyte"]
    assert "labels outside 0..9" in str(info.value) and "header implies" in str(info.value)


# ----------------------------------------------------------------------------- EMNIST


def emnist_arrays(rng, split, n):
    labels = (
        rng.integers(1, 27, size=n) if split == "letters" else rng.integers(0, 62, size=n)
    ).astype(np.uint8)
    return random_images(rng, n), labels


@pytest.mark.parametrize(
    "layout,split",
    [("raw", "byclass"), ("raw_gz", "letters"), ("gzip_dir", "balanced"), ("zip", "letters")],
)
def test_emnist_layouts(tmp_path, monkeypatch, layout, split):
    rng = np.random.default_rng(4)
    raw = tmp_path / "EMNIST" / "raw"
    (raw / "gzip").mkdir(parents=True)
    sizes = {"train": 6, "test": 4}
    data = {}
    members = {}
    for part, n in sizes.items():
        images, labels = emnist_arrays(rng, split, n)
        if split == "balanced":
            labels %= 47
        data[part] = (images, labels)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"emnist-{split}-{part}-{kind}-ubyte"
            payload = idx_bytes(array)
            if layout == "raw":
                (raw / name).write_bytes(payload)
            elif layout == "raw_gz":
                (raw / f"{name}.gz").write_bytes(gzip.compress(payload))
            elif layout == "gzip_dir":
                (raw / "gzip" / f"{name}.gz").write_bytes(gzip.compress(payload))
            else:
                members[f"gzip/{name}.gz"] = gzip.compress(payload)
    if layout == "zip":
        from torchvision.datasets import EMNIST

        with zipfile.ZipFile(raw / "gzip.zip", "w") as archive:
            for member, payload in members.items():
                archive.writestr(member, payload)
            archive.writestr("gzip/emnist-digits-train-images-idx3-ubyte.gz", b"other split")
        monkeypatch.setattr(EMNIST, "md5", md5(raw / "gzip.zip"))

    train, test = load_source("emnist", tmp_path, split=split)
    for part, (images, labels) in ((train, data["train"]), (test, data["test"])):
        assert part.x.shape == (len(labels), 1, 28, 28) and part.x.dtype == np.uint8
        assert part.x.flags.c_contiguous
        # stored transposed on disk; returned upright (H and W swapped back)
        np.testing.assert_array_equal(part.x[:, 0], images.transpose(0, 2, 1))
        expected = labels.astype(np.int64) - (1 if split == "letters" else 0)
        assert part.y.dtype == np.int64
        np.testing.assert_array_equal(part.y, expected)
        assert part.group is None
    if split == "letters":
        assert train.y.min() >= 0 and train.y.max() <= 25
    assert all(p.is_file() for p in expected_files("emnist", tmp_path, split=split))


def test_emnist_zip_with_wrong_md5_is_reported(tmp_path):
    raw = tmp_path / "EMNIST" / "raw"
    raw.mkdir(parents=True)
    with zipfile.ZipFile(raw / "gzip.zip", "w") as archive:
        archive.writestr("gzip/readme.txt", b"not NIST's zip")
    with pytest.raises(SourceMissingError) as info:
        load_source("emnist", tmp_path)
    message = str(info.value)
    assert f"  {raw / 'gzip.zip'}  [corrupt: md5 " in message
    assert f"  {raw / 'emnist-byclass-test-labels-idx1-ubyte'}  [missing]" in message


# ----------------------------------------------------------------------------- CIFAR


def write_cifar(root: Path, name: str, rng) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Tiny python-pickle batches in the layout of the official python tarballs."""
    if name == "cifar10":
        folder, batches = root / "cifar-10-batches-py", {f"data_batch_{i}": 2 for i in range(1, 6)}
        batches["test_batch"] = 3
        label_key, classes = "labels", 10
        meta_name, meta = "batches.meta", {"label_names": [f"c{i}" for i in range(10)]}
        meta |= {"num_cases_per_batch": 2, "num_vis": 3072}
    else:
        folder, batches = root / "cifar-100-python", {"train": 4, "test": 3}
        label_key, classes = "fine_labels", 100
        meta_name = "meta"
        meta = {
            "fine_label_names": [f"f{i}" for i in range(100)],
            "coarse_label_names": [f"k{i}" for i in range(20)],
        }
    folder.mkdir(parents=True)
    written = {}
    for batch, n in batches.items():
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)  # R plane, G plane, B plane
        labels = [int(v) for v in rng.integers(0, classes, size=n)]
        entry = {
            "batch_label": f"batch {batch}",
            label_key: labels,
            "data": data,
            "filenames": [f"img_{batch}_{i}.png" for i in range(n)],
        }
        if name == "cifar100":
            entry["coarse_labels"] = [v // 5 for v in labels]
        (folder / batch).write_bytes(pickle.dumps(entry, protocol=2))
        written[batch] = (data, labels)
    (folder / meta_name).write_bytes(pickle.dumps(meta, protocol=2))
    return written


def patch_cifar_md5(monkeypatch, name: str, root: Path):
    import torchvision.datasets as tvd

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    folder = root / cls.base_folder
    for attr in ("train_list", "test_list"):
        monkeypatch.setattr(cls, attr, [[f, md5(folder / f)] for f, _ in getattr(cls, attr)])
    meta = {**cls.meta, "md5": md5(folder / cls.meta["filename"])}
    monkeypatch.setattr(cls, "meta", meta)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar(tmp_path, monkeypatch, name):
    written = write_cifar(tmp_path, name, np.random.default_rng(5))
    patch_cifar_md5(monkeypatch, name, tmp_path)
    train, test = load_source(name, tmp_path)
    test_batches = ["test_batch"] if name == "cifar10" else ["test"]
    for part, batches in (
        (train, [b for b in written if b not in test_batches]),
        (test, test_batches),
    ):
        data = np.concatenate([written[b][0] for b in batches])
        labels = sum((written[b][1] for b in batches), [])
        assert part.x.shape == (len(labels), 3, 32, 32) and part.x.dtype == np.uint8
        assert part.x.flags.c_contiguous
        np.testing.assert_array_equal(part.x, data.reshape(-1, 3, 32, 32))  # channel-first
        assert part.y.dtype == np.int64
        np.testing.assert_array_equal(part.y, labels)
        assert part.group is None
    assert len(train) == (10 if name == "cifar10" else 4)


def test_cifar_md5_mismatch_lists_every_corrupt_file(tmp_path):
    write_cifar(tmp_path, "cifar10", np.random.default_rng(6))
    with pytest.raises(SourceMissingError) as info:
        load_source("cifar10", tmp_path)
    assert info.value.paths == expected_files("cifar10", tmp_path)
    assert all(reason.startswith("corrupt: md5 ") for _, reason in info.value.problems)


# ----------------------------------------------------------------------------- FEMNIST


def write_femnist_file(path: Path, writers: dict[str, tuple[np.ndarray, np.ndarray]]):
    """TFF's HDF5ClientData layout: /examples/<writer>/{label, pixels}."""
    with h5py.File(path, "w") as f:
        examples = f.create_group("examples")
        for writer, (pixels, labels) in writers.items():
            group = examples.create_group(writer)
            group.create_dataset("label", data=labels.astype(np.int32))
            group.create_dataset("pixels", data=pixels.astype(np.float32))


def femnist_writers(rng, counts: dict[str, int], classes: int):
    out = {}
    for writer, n in counts.items():
        pixels = rng.integers(0, 256, size=(n, 28, 28)) / 255.0
        out[writer] = (pixels.astype(np.float32), rng.integers(0, classes, size=n))
    return out


@pytest.mark.parametrize("only_digits", [False, True])
def test_femnist(tmp_path, only_digits):
    rng = np.random.default_rng(7)
    classes = 10 if only_digits else 62
    # inserted out of order: the group index follows the sorted writer id
    train_w = femnist_writers(rng, {"f0002_11": 3, "f0000_14": 2, "f0001_41": 4}, classes)
    test_w = femnist_writers(rng, {"f0001_41": 1, "f0002_11": 2, "f0000_14": 1}, classes)
    train_w["f0000_14"][0][0, 0, :3] = [0.0, 1.0, 0.5]  # 0.5 -> round(127.5) = 128
    prefix = "fed_emnist_digitsonly" if only_digits else "fed_emnist"
    write_femnist_file(tmp_path / f"{prefix}_train.h5", train_w)
    write_femnist_file(tmp_path / f"{prefix}_test.h5", test_w)
    assert expected_files("femnist", tmp_path, only_digits=only_digits) == [
        tmp_path / f"{prefix}_train.h5",
        tmp_path / f"{prefix}_test.h5",
    ]

    train, test = load_source("femnist", tmp_path, only_digits=only_digits)
    order = ["f0000_14", "f0001_41", "f0002_11"]
    assert femnist.femnist_writer_ids(tmp_path, only_digits) == order
    for part, writers in ((train, train_w), (test, test_w)):
        pixels = np.concatenate([writers[w][0] for w in order])
        labels = np.concatenate([writers[w][1] for w in order])
        groups = np.concatenate([np.full(len(writers[w][1]), i) for i, w in enumerate(order)])
        assert part.x.shape == (len(labels), 1, 28, 28) and part.x.dtype == np.uint8
        np.testing.assert_array_equal(part.x[:, 0], np.rint(pixels * 255).astype(np.uint8))
        assert part.y.dtype == np.int64 and part.group.dtype == np.int64
        np.testing.assert_array_equal(part.y, labels)
        np.testing.assert_array_equal(part.group, groups)
    assert list(train.x[0, 0, 0, :3]) == [0, 255, 128]
    assert num_classes("femnist", only_digits=only_digits) == classes


def test_femnist_malformed_file_is_reported(tmp_path):
    (tmp_path / "fed_emnist_train.h5").write_bytes(b"not hdf5")
    write_femnist_file(tmp_path / "fed_emnist_test.h5", {})
    with pytest.raises(SourceMissingError) as info:
        load_source("femnist", tmp_path)
    assert info.value.paths == [tmp_path / "fed_emnist_train.h5"]
    assert "not a readable HDF5 file" in str(info.value)

    bad = tmp_path / "bad"
    bad.mkdir()
    rng = np.random.default_rng(8)
    writers = femnist_writers(rng, {"f0": 2}, 62)
    write_femnist_file(bad / "fed_emnist_test.h5", writers)
    writers["f0"] = (writers["f0"][0] * 255.0, writers["f0"][1])  # 0..255 floats, not [0, 1]
    write_femnist_file(bad / "fed_emnist_train.h5", writers)
    with pytest.raises(SourceMissingError, match=r"pixels outside \[0, 1\]"):
        load_source("femnist", bad)


def test_femnist_download_checks_sha256_and_extracts(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    rng = np.random.default_rng(9)
    staging = tmp_path / "staging"
    staging.mkdir()
    write_femnist_file(staging / "fed_emnist_train.h5", femnist_writers(rng, {"a": 2}, 62))
    write_femnist_file(staging / "fed_emnist_test.h5", femnist_writers(rng, {"a": 1}, 62))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("fed_emnist_train.h5", "fed_emnist_test.h5"):
            tar.add(staging / name, arcname=name)
    (site / "fed_emnist.tar.bz2").write_bytes(bz2.compress(buffer.getvalue()))
    monkeypatch.setattr(femnist, "URL_BASE", site.as_uri() + "/")

    root = tmp_path / "root"
    with pytest.raises(SourceMissingError, match="sha256"):
        load_source("femnist", root, download=True)
    sha = hashlib.sha256((site / "fed_emnist.tar.bz2").read_bytes()).hexdigest()
    monkeypatch.setitem(femnist.ARCHIVE_SHA256, False, sha)
    train, test = load_source("femnist", root, download=True)
    assert (len(train), len(test)) == (2, 1) and set(train.group) == {0}


# ----------------------------------------------------------------------------- real MNIST test set


@needs_shared_mnist
def test_mnist_test_split_on_the_real_files(tmp_path):
    train, test = load_source("mnist_test_split", SHARED_MNIST)
    assert train.x.shape == (8000, 1, 28, 28) and test.x.shape == (2000, 1, 28, 28)
    assert train.x.dtype == np.uint8 and train.y.dtype == np.int64
    assert train.group is None and test.group is None
    counts = np.bincount(np.concatenate([train.y, test.y]), minlength=10)
    assert counts.tolist() == MNIST_TEST_CLASS_COUNTS
    assert train.y[:3].tolist() == [7, 2, 1]  # the well-known first three test digits
    assert 0 < train.x.mean() < 128 and train.x.max() == 255  # ink is bright, MNIST polarity

    # the small reader agrees with torchvision's on the decompressed files
    from torchvision.datasets.mnist import read_image_file, read_label_file

    raw = SHARED_MNIST / "MNIST" / "raw"
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (tmp_path / name).write_bytes(gzip.decompress((raw / f"{name}.gz").read_bytes()))
    images = read_image_file(str(tmp_path / "t10k-images-idx3-ubyte")).numpy()
    labels = read_label_file(str(tmp_path / "t10k-labels-idx1-ubyte")).numpy()
    np.testing.assert_array_equal(np.concatenate([train.x, test.x])[:, 0], images)
    np.testing.assert_array_equal(np.concatenate([train.y, test.y]), labels)


@needs_shared_mnist
def test_mnist_test_split_download_from_a_mirror(tmp_path, monkeypatch):
    mirror = (SHARED_MNIST / "MNIST" / "raw").as_uri() + "/"
    monkeypatch.setattr(vision, "MNIST_MIRRORS", ("file:///no/such/mirror/", mirror))
    train, test = load_source("mnist_test_split", tmp_path, download=True)
    assert (len(train), len(test)) == (8000, 2000)


def test_mnist_test_split_rejects_other_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros((2, 28, 28)))))
    with pytest.raises(SourceMissingError) as info:
        load_source("mnist_test_split", tmp_path)
    assert info.value.problems == [(raw / "t10k-labels-idx1-ubyte.gz", "missing")]
    (raw / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros(2))))
    with pytest.raises(SourceMissingError) as info:
        load_source("mnist_test_split", tmp_path)
    assert info.value.paths == expected_files("mnist_test_split", tmp_path)
    assert "expected 9fb629c4189551a2d022fa330f9573f3" in str(info.value)
