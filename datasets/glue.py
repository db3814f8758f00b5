"""GLUE sources (SST-2, QQP, MRPC, QNLI) from the benchmark's TSV files, tokenised for RoBERTa.

Layout under ROOT (``data.root``), as GLUE's download script leaves it::

    ROOT/SST-2/{train,dev}.tsv  sentence  label                                  (0/1)
    ROOT/QQP/{train,dev}.tsv    id  qid1  qid2  question1  question2  is_duplicate  (0/1)
    ROOT/MRPC/{train,dev}.tsv   Quality  #1 ID  #2 ID  #1 String  #2 String     (0/1)
    ROOT/QNLI/{train,dev}.tsv   index  question  sentence  label   (entailment = 0,
                                                                    not_entailment = 1)

Tab-separated UTF-8 with one header line (a leading byte-order mark is dropped: MRPC's carries
the one of Microsoft's original file) and no quoting; lines end at ``\\n`` only (a sentence may
hold other Unicode line breaks). A header other than the above, a row with another number of
fields or an unknown label is an error naming file and line. GLUE's test labels are not public:
``dev.tsv`` serves as the test split.

Rows are tokenised once, when the shard store is built (``datasets.tokenizer``): ``x`` holds
``max_length`` token ids per row as float32 (exact: vocabularies are far below 2²⁴), ``y`` the
labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datasets.arrays import LabeledArrays
from datasets.tokenizer import RobertaTokenizer


@dataclass(frozen=True)
class GlueTask:
    folder: str
    header: tuple[str, ...]
    text: str  # the column of the first text
    pair: str | None  # the column of the second text, if any
    label: str
    labels: tuple[str, ...]  # label strings in class order


GLUE_TASKS = {
    "sst2": GlueTask("SST-2", ("sentence", "label"), "sentence", None, "label", ("0", "1")),
    "qqp": GlueTask(
        "QQP",
        ("id", "qid1", "qid2", "question1", "question2", "is_duplicate"),
        "question1",
        "question2",
        "is_duplicate",
        ("0", "1"),
    ),
    "mrpc": GlueTask(
        "MRPC",
        ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"),
        "#1 String",
        "#2 String",
        "Quality",
        ("0", "1"),
    ),
    "qnli": GlueTask(
        "QNLI",
        ("index", "question", "sentence", "label"),
        "question",
        "sentence",
        "label",
        ("entailment", "not_entailment"),
    ),
}
GLUE_SOURCES = tuple(GLUE_TASKS)
GLUE_NUM_CLASSES = 2  # every one of these four is a binary task
SPLIT_FILES = {"train": "train.tsv", "test": "dev.tsv"}  # GLUE's test labels are hidden


class GlueFormatError(ValueError):
    """A GLUE file that is not in the benchmark's TSV layout (names the file and line)."""


class GlueFilesMissing(FileNotFoundError):
    """GLUE files absent under the data root."""


DEFAULT_MAX_LENGTH = 128


def folder_problem(relative: str) -> str | None:
    """Why ``relative`` cannot name a folder inside the data root (absolute, empty, or with a
    ``..`` part), else None."""
    path = Path(relative)
    if not relative or path.is_absolute() or ".." in path.parts:
        return "must be a folder inside data.root: relative, without '..' (e.g. roberta-base)"
    return None


def inside(root: Path, relative: str) -> Path:
    """``root / relative`` for a ``relative`` that stays inside ``root`` (``folder_problem``)."""
    problem = folder_problem(relative)
    if problem is not None:
        raise ValueError(f"{relative!r}: {problem}")
    return Path(root) / relative


def glue_files(name: str, root: Path) -> list[Path]:
    """The exact files source ``name`` reads under ``root``."""
    folder = Path(root) / GLUE_TASKS[name].folder
    return [folder / file for file in SPLIT_FILES.values()]


def read_glue_tsv(task: GlueTask, path: Path) -> tuple[list[str], list[str] | None, np.ndarray]:
    """(first texts, second texts or None, int64 labels) of one GLUE file."""
    lines = path.read_text(encoding="utf-8-sig").split("\n")
    rows = [line.removesuffix("\r").split("\t") for line in lines if line.removesuffix("\r")]
    if not rows or tuple(rows[0]) != task.header:
        found = repr("\t".join(rows[0])) if rows else "missing"
        expected = repr("\t".join(task.header))
        raise GlueFormatError(f"{path}: header is {found}, expected {expected}")
    columns = {name: i for i, name in enumerate(task.header)}
    texts, pairs, labels = [], [], []
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(task.header):
            raise GlueFormatError(
                f"{path}, line {number}: {len(row)} tab-separated fields, expected "
                f"{len(task.header)}"
            )
        label = row[columns[task.label]]
        if label not in task.labels:
            raise GlueFormatError(
                f"{path}, line {number}: label {label!r}, expected one of {task.labels}"
            )
        texts.append(row[columns[task.text]])
        if task.pair is not None:
            pairs.append(row[columns[task.pair]])
        labels.append(task.labels.index(label))
    return texts, (pairs if task.pair is not None else None), np.array(labels, dtype=np.int64)


def load_glue(
    name: str, root: Path, tokenizer: str, max_length: int = DEFAULT_MAX_LENGTH
) -> tuple[LabeledArrays, LabeledArrays]:
    """``(train, test)`` of GLUE source ``name``: ``train.tsv`` and ``dev.tsv`` under ``root``
    tokenised to ``max_length`` ids a row by the RoBERTa tokenizer in folder ``tokenizer``
    (relative to ``root``)."""
    tokenizer_folder = inside(root, tokenizer)
    files = glue_files(name, root)
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise GlueFilesMissing(
            f"GLUE source {name!r}: missing {', '.join(missing)}; put the benchmark's "
            f"{GLUE_TASKS[name].folder} folder (train.tsv, dev.tsv) from its download script there"
        )
    encoder = RobertaTokenizer(tokenizer_folder)

    def split(path: Path) -> LabeledArrays:
        texts, pairs, labels = read_glue_tsv(GLUE_TASKS[name], path)
        ids = encoder.encode(texts, pairs, max_length)
        return LabeledArrays(ids.astype(np.float32), labels)

    return split(files[0]), split(files[1])
