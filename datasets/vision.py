"""Offline image-dataset sources: MNIST, EMNIST, CIFAR-10/100, an MNIST-test split and FEMNIST.

``load_source(name, root, download=False, **options)`` returns ``(train, test)`` as
:class:`~datasets.arrays.LabeledArrays`: ``x`` uint8 channel-first images (N, C, H, W) (1×28×28 for
the MNIST family, 3×32×32 for CIFAR), ``y`` int64 labels 0..K-1 (``num_classes(name, **options)``
gives K), ``group`` the writer index for ``femnist`` and None elsewhere. Before reading anything the
files are checked (existence first, without importing torch/torchvision/h5py, then checksums or
file structure); any missing or corrupt file raises :class:`SourceMissingError`, whose message
lists every such path and the command that prepares them. ``expected_files`` gives the exact paths.

On-disk layouts under ROOT (the ``root`` argument):

``mnist`` -- torchvision's ``MNIST`` layout; read by ``torchvision.datasets.MNIST``, which requires
all four uncompressed files whichever split is asked for::

    ROOT/MNIST/raw/train-images-idx3-ubyte   ROOT/MNIST/raw/train-labels-idx1-ubyte
    ROOT/MNIST/raw/t10k-images-idx3-ubyte    ROOT/MNIST/raw/t10k-labels-idx1-ubyte

  torchvision verifies no checksum on these; they are checked here as IDX files (magic, dims
  (n, 28, 28) / (n,), size, equal counts, labels 0..9). A missing one is decompressed from its
  ``ROOT/MNIST/raw/<name>.gz`` sibling (torchvision's download keeps the ``.gz`` files) once the
  ``.gz`` matches the md5 in ``torchvision.datasets.MNIST.resources`` -- the step torchvision's own
  ``download()`` would take, done offline.

``mnist_test_split`` -- only the original MNIST *test* set, split by row: images 0-7,999 are train,
8,000-9,999 test (this project's convention; read with a small IDX reader, no torchvision)::

    ROOT/MNIST/raw/t10k-images-idx3-ubyte.gz   md5 9fb629c4189551a2d022fa330f9573f3
    ROOT/MNIST/raw/t10k-labels-idx1-ubyte.gz   md5 ec29112dd5afa0611ce80d1b7f02629c

``emnist`` (option ``split``: ``byclass`` (default; 62 classes: digits, 'A'-'Z', 'a'-'z'),
``balanced`` (47) or ``letters`` (26)) -- torchvision's ``EMNIST`` layout (what its download leaves
after unpacking NIST's ``gzip.zip``)::

    ROOT/EMNIST/raw/emnist-<split>-train-images-idx3-ubyte
    ROOT/EMNIST/raw/emnist-<split>-train-labels-idx1-ubyte
    ROOT/EMNIST/raw/emnist-<split>-test-images-idx3-ubyte
    ROOT/EMNIST/raw/emnist-<split>-test-labels-idx1-ubyte

  checked as IDX files like MNIST's (torchvision has no checksum for them). A missing one is
  decompressed from, in this order, ``ROOT/EMNIST/raw/<name>.gz``,
  ``ROOT/EMNIST/raw/gzip/<name>.gz`` (NIST's zip unpacked) or the member ``gzip/<name>.gz`` of
  ``ROOT/EMNIST/raw/gzip.zip`` once the zip matches ``torchvision.datasets.EMNIST.md5``.
  Quirks handled: EMNIST's IDX images are stored transposed (column-major) relative to MNIST and
  torchvision's ``EMNIST`` returns them as stored, so each image is transposed back here (H and W
  swapped) to be upright like MNIST and FEMNIST; ``letters`` labels are 1..26 on disk and are
  returned as 0..25 ('a' = 0).

``cifar10`` / ``cifar100`` -- torchvision's layouts (the extracted official python tarballs), every
file md5-checked against torchvision's ``CIFAR10``/``CIFAR100`` ``train_list``, ``test_list`` and
``meta`` (torchvision checks all of them, for either split)::

    ROOT/cifar-10-batches-py/{data_batch_1, ..., data_batch_5, test_batch, batches.meta}
    ROOT/cifar-100-python/{train, test, meta}           (labels: the 100 fine labels)

  torchvision returns HWC images; they are transposed back to CHW (the files' own order).

``femnist`` (option ``only_digits``, default False) -- TFF's federated EMNIST HDF5 files, see
:mod:`datasets.femnist`::

    ROOT/fed_emnist_train.h5, ROOT/fed_emnist_test.h5                     (only_digits=False)
    ROOT/fed_emnist_digitsonly_train.h5, ROOT/fed_emnist_digitsonly_test.h5  (only_digits=True)

``download=True`` fetches what is missing (torchvision's downloaders for ``mnist``, ``emnist``,
``cifar10``, ``cifar100``; torchvision's MNIST mirrors for ``mnist_test_split``; TFF's archive for
``femnist``) and then applies the same checks; it needs internet access.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from datasets import femnist as _femnist
from datasets.arrays import LabeledArrays
from datasets.download import MD5, download_checked
from datasets.idx import MNIST_IMAGE, Inflate, check_idx_pair, inflate, md5, plan_idx, read_idx_gz

SOURCE_NAMES = ("mnist", "mnist_test_split", "emnist", "cifar10", "cifar100", "femnist")
EMNIST_SPLITS = ("byclass", "balanced", "letters")
EMNIST_NUM_CLASSES = {"byclass": 62, "balanced": 47, "letters": 26}
MNIST_TEST_SPLIT_TRAIN_ROWS = 8000
MNIST_TEST_ROWS = 10000
MNIST_TEST_MD5 = {
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
# torchvision.datasets.MNIST.mirrors, for fetching the two test files without torchvision.
MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)

_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# name -> (folder, batch files in train+test order, meta file, torchvision class, classes)
_CIFAR = {
    "cifar10": (
        "cifar-10-batches-py",
        ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"),
        ("test_batch",),
        "batches.meta",
        "CIFAR10",
        10,
    ),
    "cifar100": ("cifar-100-python", ("train",), ("test",), "meta", "CIFAR100", 100),
}
_DEFAULT_OPTIONS: dict[str, dict] = {
    "mnist": {},
    "mnist_test_split": {},
    "emnist": {"split": "byclass"},
    "cifar10": {},
    "cifar100": {},
    "femnist": {"only_digits": False},
}


class SourceMissingError(FileNotFoundError):
    """Files a source needs are missing or corrupt.

    ``problems`` is a list of ``(path, reason)``; ``paths`` the paths alone; ``command`` a shell
    command that prepares them (on a machine with internet access), ``hint`` what to do after it.
    The message names every path, its reason, the command and the hint.
    """

    def __init__(
        self,
        source: str,
        root: str | Path,
        problems: Sequence[tuple[Path, str]],
        command: str,
        hint: str = "",
        note: str = "",
    ) -> None:
        self.source = source
        self.root = Path(root)
        self.problems = [(Path(p), str(r)) for p, r in problems]
        self.paths = [p for p, _ in self.problems]
        self.command = command
        self.hint = hint
        self.note = note
        lines = [f"data source {source!r} under {self.root}: files missing or corrupt:"]
        lines += [f"  {path}  [{reason}]" for path, reason in self.problems]
        if note:
            lines.append(note)
        lines += ["Prepare them with:", f"  {command}"]
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))

    def __reduce__(self):
        args = (self.source, self.root, self.problems, self.command, self.hint, self.note)
        return (self.__class__, args, self.__dict__)


# ----------------------------------------------------------------------------- names and options


def _resolve(name: str, options: dict) -> dict:
    if name not in SOURCE_NAMES:
        raise ValueError(f"unknown image source {name!r}; known: {', '.join(SOURCE_NAMES)}")
    defaults = _DEFAULT_OPTIONS[name]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        allowed = ", ".join(defaults) or "none"
        raise TypeError(f"source {name!r} got unknown option(s) {unknown}; allowed: {allowed}")
    resolved = {**defaults, **options}
    if name == "emnist" and resolved["split"] not in EMNIST_SPLITS:
        raise ValueError(f"emnist split must be one of {EMNIST_SPLITS}, got {resolved['split']!r}")
    if name == "femnist" and not isinstance(resolved["only_digits"], bool | np.bool_):
        raise TypeError(f"femnist only_digits must be a bool, got {resolved['only_digits']!r}")
    if name == "femnist":
        resolved["only_digits"] = bool(resolved["only_digits"])
    return resolved


def _root(root: str | Path) -> Path:
    return Path(root).expanduser().absolute()


def num_classes(name: str, **options) -> int:
    """Number of label classes K of a source (labels are 0..K-1)."""
    opts = _resolve(name, options)
    if name == "emnist":
        return EMNIST_NUM_CLASSES[opts["split"]]
    if name == "femnist":
        return _femnist.NUM_CLASSES[opts["only_digits"]]
    if name in _CIFAR:
        return _CIFAR[name][5]
    return 10


def image_shape(name: str) -> tuple[int, int, int]:
    """(C, H, W) of source ``name``'s images (the ``x`` rows ``load_source`` returns)."""
    if name not in SOURCE_NAMES:
        raise ValueError(f"unknown image source {name!r}; known: {', '.join(SOURCE_NAMES)}")
    return (3, 32, 32) if name in _CIFAR else (1, *MNIST_IMAGE)


def expected_files(name: str, root: str | Path, **options) -> list[Path]:
    """The exact (absolute) paths source ``name`` reads under ``root``; see the module docstring."""
    opts = _resolve(name, options)
    root = _root(root)
    if name == "mnist":
        return [root / "MNIST" / "raw" / f for f in _MNIST_FILES]
    if name == "mnist_test_split":
        return [root / "MNIST" / "raw" / f for f in MNIST_TEST_MD5]
    if name == "emnist":
        raw = root / "EMNIST" / "raw"
        split = opts["split"]
        return [
            raw / f"emnist-{split}-{part}-{kind}-ubyte"
            for part in ("train", "test")
            for kind in ("images-idx3", "labels-idx1")
        ]
    if name in _CIFAR:
        folder, train, test, meta = _CIFAR[name][:4]
        return [root / folder / f for f in (*train, *test, meta)]
    return list(_femnist.femnist_files(root, opts["only_digits"]))


def check_present(name: str, root: str | Path, **options) -> None:
    """Fail fast when ``root`` holds no trace of source ``name``: none of its files, and none of
    the folders below ``root`` they live in (archives unpacked later count as a trace). Cheap:
    no file is read; ``load_source`` checks every file properly."""
    opts = _resolve(name, options)
    root = _root(root)
    expected = expected_files(name, root, **opts)

    def trace(path: Path) -> bool:
        folders = [p for p in path.parents if root in p.parents]
        return path.is_file() or any(folder.is_dir() for folder in folders)

    if not any(trace(path) for path in expected):
        raise _error(name, root, opts, _absent(expected))


def prepare_command(name: str, root: str | Path, **options) -> tuple[str, str]:
    """``(command, hint)``: a shell command that fetches the files, and what to do after it."""
    opts = _resolve(name, options)
    root = _root(root)
    online = (
        f"or call datasets.vision.load_source({name!r}, {str(root)!r}, download=True) "
        "where the internet is reachable"
    )

    def torchvision_line(call: str) -> str:
        return f'python -c "import torchvision; torchvision.datasets.{call}"'

    def copy_hint(folder: Path) -> str:
        return (
            f"Run it on a machine with internet access, then copy {folder} from there to the "
            f"same path here ({online})."
        )

    if name == "mnist":
        command = torchvision_line(f"MNIST({str(root)!r}, download=True)")
        return command, copy_hint(root / "MNIST" / "raw")
    if name == "emnist":
        command = torchvision_line(f"EMNIST({str(root)!r}, split={opts['split']!r}, download=True)")
        return command, copy_hint(root / "EMNIST" / "raw") + (
            f" Only the emnist-{opts['split']}-* files are needed."
        )
    if name in _CIFAR:
        folder, cls = _CIFAR[name][0], _CIFAR[name][4]
        command = torchvision_line(f"{cls}({str(root)!r}, download=True)")
        return command, copy_hint(root / folder)
    if name == "mnist_test_split":
        raw = root / "MNIST" / "raw"
        fetch = " && ".join(f"curl -fLO {MNIST_MIRRORS[0]}{f}" for f in MNIST_TEST_MD5)
        sums = "\\n".join(f"{md5}  {f}" for f, md5 in MNIST_TEST_MD5.items())
        command = (
            f"mkdir -p {shlex.quote(str(raw))} && cd {shlex.quote(str(raw))} && {fetch} "
            f"&& printf '{sums}\\n' | md5sum -c -"
        )
        return command, copy_hint(raw)
    only_digits = opts["only_digits"]
    archive = _femnist.archive_name(only_digits)
    sha = _femnist.ARCHIVE_SHA256[only_digits]
    command = (
        f"mkdir -p {shlex.quote(str(root))} && cd {shlex.quote(str(root))} && "
        f"curl -fLO {_femnist.URL_BASE}{archive} && "
        f"echo '{sha}  {archive}' | sha256sum -c - && tar -xjf {archive}"
    )
    return command, copy_hint(root)


def _error(
    name: str, root: Path, options: dict, problems: Sequence[tuple[Path, str]], note: str = ""
) -> SourceMissingError:
    command, hint = prepare_command(name, root, **options)
    return SourceMissingError(name, root, problems, command, hint, note)


def _absent(paths: Sequence[Path]) -> list[tuple[Path, str]]:
    return [(p, "missing") for p in paths if not p.is_file()]


# ----------------------------------------------------------------------------- entry point


def load_source(
    name: str, root: str | Path, download: bool = False, **options
) -> tuple[LabeledArrays, LabeledArrays]:
    """``(train, test)`` of image source ``name`` (one of SOURCE_NAMES) read from ``root``.

    Options: ``emnist``: ``split`` in EMNIST_SPLITS (default ``"byclass"``); ``femnist``:
    ``only_digits`` (default False). Layouts, checks and conventions: see the module docstring.
    Raises SourceMissingError (a FileNotFoundError) when a needed file is missing or corrupt.
    """
    opts = _resolve(name, options)
    root = _root(root)
    if name == "mnist_test_split":
        return _load_mnist_test_split(root, download)
    if name == "femnist":
        return _load_femnist(root, download, opts["only_digits"])
    if download:
        _torchvision_download(name, root, opts)
    if name == "mnist":
        return _load_mnist(root)
    if name == "emnist":
        return _load_emnist(root, opts["split"])
    return _load_cifar(name, root)


def _torchvision_download(name: str, root: Path, opts: dict) -> None:
    import torchvision.datasets as tvd

    try:
        if name == "mnist":
            tvd.MNIST(str(root), train=True, download=True)
        elif name == "emnist":
            # Downloads and unpacks gzip.zip (all splits) unless this split's train files exist.
            tvd.EMNIST(str(root), split=opts["split"], train=True, download=True)
            tvd.EMNIST(str(root), split=opts["split"], train=False, download=True)
        else:
            getattr(tvd, _CIFAR[name][4])(str(root), train=True, download=True)
    except (RuntimeError, OSError) as exc:
        problems = _absent(expected_files(name, root, **opts)) or [(root, "download failed")]
        raise _error(name, root, opts, problems, f"download=True failed: {exc}") from exc


# ----------------------------------------------------------------------------- IDX files


def _prepare_idx(name: str, root: Path, opts: dict, steps: list[Inflate], problems: list) -> None:
    if problems:
        raise _error(name, root, opts, problems)
    for step in steps:
        problems += inflate(step)
    if problems:
        raise _error(name, root, opts, problems)


# ----------------------------------------------------------------------------- MNIST / EMNIST


def _channel_first(images: np.ndarray, transpose: bool = False) -> np.ndarray:
    """(N, H, W) -> contiguous (N, 1, H, W) uint8; ``transpose`` swaps H and W first."""
    if transpose:
        images = images.transpose(0, 2, 1)
    return np.ascontiguousarray(images, dtype=np.uint8)[:, None]


def _load_mnist(root: Path) -> tuple[LabeledArrays, LabeledArrays]:
    files = expected_files("mnist", root)

    def gz_md5(path: Path) -> str | None:  # imports torchvision only when a .gz must be used
        from torchvision.datasets import MNIST

        return dict(MNIST.resources).get(path.name)

    steps, problems = plan_idx(files, lambda p: [p.with_name(p.name + ".gz")], gz_md5)
    _prepare_idx("mnist", root, {}, steps, problems)
    problems = check_idx_pair(files[0], files[1], 0, 9) + check_idx_pair(files[2], files[3], 0, 9)
    if problems:
        raise _error("mnist", root, {}, problems)

    from torchvision.datasets import MNIST

    def read(train: bool) -> LabeledArrays:
        ds = MNIST(str(root), train=train, download=False)
        return LabeledArrays(_channel_first(ds.data.numpy()), ds.targets.numpy().astype(np.int64))

    return read(True), read(False)


def _load_emnist(root: Path, split: str) -> tuple[LabeledArrays, LabeledArrays]:
    opts = {"split": split}
    files = expected_files("emnist", root, split=split)
    raw = root / "EMNIST" / "raw"

    def candidates(path: Path) -> list[Path]:
        return [raw / f"{path.name}.gz", raw / "gzip" / f"{path.name}.gz"]

    zip_path = raw / "gzip.zip"

    def zip_md5() -> str:
        from torchvision.datasets import EMNIST

        return EMNIST.md5

    steps, problems = plan_idx(files, candidates, lambda _: None, zip_path, zip_md5)
    _prepare_idx("emnist", root, opts, steps, problems)
    lo, hi = (1, 26) if split == "letters" else (0, EMNIST_NUM_CLASSES[split] - 1)
    problems = check_idx_pair(files[0], files[1], lo, hi) + check_idx_pair(
        files[2], files[3], lo, hi
    )
    if problems:
        raise _error("emnist", root, opts, problems)

    from torchvision.datasets import EMNIST

    def read(train: bool) -> LabeledArrays:
        ds = EMNIST(str(root), split=split, train=train, download=False)
        labels = ds.targets.numpy().astype(np.int64)
        if split == "letters":
            labels -= 1  # on disk 1..26 ('a'..'z'); torchvision keeps them, class 0 is "N/A"
        # EMNIST stores images transposed; torchvision's EMNIST does not undo it.
        return LabeledArrays(_channel_first(ds.data.numpy(), transpose=True), labels)

    return read(True), read(False)


def _load_mnist_test_split(root: Path, download: bool) -> tuple[LabeledArrays, LabeledArrays]:
    files = expected_files("mnist_test_split", root)
    if download:
        _download_mnist_test(root, files)
    problems = _absent(files)
    if problems:
        raise _error("mnist_test_split", root, {}, problems)
    for path in files:
        actual = md5(path)
        if actual != MNIST_TEST_MD5[path.name]:
            problems.append((path, f"corrupt: md5 {actual}, expected {MNIST_TEST_MD5[path.name]}"))
    if problems:
        raise _error("mnist_test_split", root, {}, problems)
    images = read_idx_gz(files[0], 3)
    labels = read_idx_gz(files[1], 1).astype(np.int64)
    if images.shape != (MNIST_TEST_ROWS, *MNIST_IMAGE) or labels.shape != (MNIST_TEST_ROWS,):
        raise ValueError(f"unexpected MNIST test shapes {images.shape}, {labels.shape}")
    x = _channel_first(images)
    cut = MNIST_TEST_SPLIT_TRAIN_ROWS
    return LabeledArrays(x[:cut], labels[:cut]), LabeledArrays(x[cut:], labels[cut:])


def _download_mnist_test(root: Path, files: list[Path]) -> None:
    errors = []
    for path in files:
        if path.is_file() and md5(path) == MNIST_TEST_MD5[path.name]:
            continue
        for mirror in MNIST_MIRRORS:
            try:
                download_checked(mirror + path.name, path, MD5, MNIST_TEST_MD5[path.name])
                break
            except OSError as exc:
                errors.append(str(exc))
    if errors and _absent(files):
        raise _error(
            "mnist_test_split", root, {}, _absent(files), "download failed: " + "; ".join(errors)
        )


# ----------------------------------------------------------------------------- CIFAR


def _load_cifar(name: str, root: Path) -> tuple[LabeledArrays, LabeledArrays]:
    files = expected_files(name, root)
    problems = _absent(files)
    if problems:
        raise _error(name, root, {}, problems)

    import torchvision.datasets as tvd

    cls = getattr(tvd, _CIFAR[name][4])
    md5s = {f: m for f, m in cls.train_list + cls.test_list}
    md5s[cls.meta["filename"]] = cls.meta["md5"]
    for path in files:
        if path.name not in md5s:  # a torchvision release that renamed its files
            raise RuntimeError(f"torchvision {cls.__name__} does not list {path.name}")
        actual = md5(path)
        if actual != md5s[path.name]:
            problems.append((path, f"corrupt: md5 {actual}, expected {md5s[path.name]}"))
    if problems:
        raise _error(name, root, {}, problems)

    def read(train: bool) -> LabeledArrays:
        ds = cls(str(root), train=train, download=False)
        x = np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2), dtype=np.uint8)  # HWC -> CHW
        return LabeledArrays(x, np.asarray(ds.targets, dtype=np.int64))

    return read(True), read(False)


# ----------------------------------------------------------------------------- FEMNIST


def _load_femnist(
    root: Path, download: bool, only_digits: bool
) -> tuple[LabeledArrays, LabeledArrays]:
    opts = {"only_digits": only_digits}
    files = expected_files("femnist", root, **opts)
    if download:
        try:
            _femnist.download_femnist(root, only_digits)
        except (OSError, EOFError) as exc:
            problems = _absent(files) or [(root, "download failed")]
            raise _error("femnist", root, opts, problems, f"download failed: {exc}") from exc
    problems = _absent(files)
    if problems:
        raise _error("femnist", root, opts, problems)
    try:
        return _femnist.load_femnist(root, only_digits)
    except _femnist.FemnistFormatError as exc:
        raise _error("femnist", root, opts, [(exc.path, f"corrupt: {exc.reason}")]) from exc
