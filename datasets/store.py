"""The shard store: client data as uncompressed Arrow IPC files, on the local disk or in an
object store.

Layout of a store directory (or key prefix)::

    manifest.json       source/partition parameters, seed, shapes, dtypes, checksums and the
                        column layout (O(1) in the number of clients); written last, it commits
                        the store
    train.arrow         columns client_id:int32, x:fixed_size_list<uint8|float32>[prod(shape)],
                        y:int64; rows sorted by client_id (images stay uint8: 4× smaller)
    train_offsets.npy   int64[num_clients + 1]; client i owns rows offsets[i]:offsets[i+1]
    train_class_counts.npy  int64[num_clients, num_classes]: each client's class histogram
    test.arrow          the same columns; client_id is the natural owner, or -1 for a global
                        test set
    validation.arrow    (only in a store derived with ``data.validation``,
                        ``datasets.validation``) the same columns: rows held out of training
                        to select hyperparameters by; the manifest's ``num_validation`` counts
                        them

Each table is one uncompressed record batch of fixed-width columns, so a local store is read
through ``pa.memory_map`` zero-copy: opening it costs the manifest and the offsets index only
(no Python object per client), and one client's rows are a slice of the map. The same property
makes a store in an object store (``s3://bucket/prefix``, ``datasets.locations``) readable by
byte ranges: the manifest's ``layout`` records where each table's x and y value buffers start
in its file (found from the buffers' addresses when the store is written), so rows a:b of a
column are bytes ``start + a·width : start + b·width``. A remote reader fetches only the rows
it is asked for, neighbouring ranges coalesced into one request (``read_ranges``); nothing
reads a whole table unless asked for every row.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from datasets import locations
from datasets.arrays import LabeledArrays
from datasets.download import file_digest
from datasets.locations import Location, LocationError, ObjectLocation, first_line
from datasets.partition import client_class_counts, matched_test_split

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
CLASS_COUNTS = "train_class_counts.npy"
# Ranged reads: a gap of at most HOLE_BYTES between two wanted ranges is read too, so that they
# are one request (a request costs about what this many bytes take to transfer); no merged
# request grows past SPAN_BYTES; FETCH_THREADS requests are in flight at once.
HOLE_BYTES = 64 * 1024
SPAN_BYTES = 32 * 1024 * 1024
FETCH_THREADS = 16


def _table(data: LabeledArrays, client_id: np.ndarray) -> pa.Table:
    dtype = np.uint8 if data.x.dtype == np.uint8 else np.float32
    flat = np.ascontiguousarray(data.x.reshape(len(data), -1), dtype=dtype)
    x = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
    return pa.table(
        {
            "client_id": pa.array(client_id.astype(np.int32)),
            "x": x,
            "y": pa.array(data.y.astype(np.int64)),
        }
    )


def _write_ipc(table: pa.Table, path: Path) -> tuple[str, dict]:
    """Write ``table`` as one uncompressed record batch (a client's rows are then one
    contiguous slice); returns the file's SHA-256 and its column layout (``_column_layout``)."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max(len(table), 1))
    return file_digest(path, "sha256"), _column_layout(path)


def _column_layout(path: Path) -> dict:
    """``{"x": [start, bytes], "y": [start, bytes]}``: where the x values and y values of the
    IPC file at ``path`` lie in it, read off the addresses of its zero-copy buffers."""
    with pa.memory_map(str(path), "r") as source:
        whole = source.read_buffer()
        table = pa.ipc.open_file(pa.BufferReader(whole)).read_all()
        layout = {}
        for name in ("x", "y"):
            column = _one_chunk(table.column(name))
            values = column.values if name == "x" else column
            buffer = values.buffers()[1]
            if buffer is None:  # an empty table
                layout[name] = [0, 0]
                continue
            start = buffer.address - whole.address + values.offset * _width(values.type)
            layout[name] = [start, len(values) * _width(values.type)]
    return layout


def _width(value_type: pa.DataType) -> int:
    return value_type.bit_width // 8


def write_store(
    location: Location,
    train: LabeledArrays,
    test: LabeledArrays,
    clients: list[np.ndarray],
    num_classes: int,
    description: dict,
    validation: LabeledArrays | None = None,
) -> ShardStore:
    """Write a store and open it. Locally atomically (a temporary sibling, then renamed over
    any store there); in an object store built in a local temporary directory and uploaded,
    the manifest last (``locations.write_folder``). ``validation``: held-out rows, written as
    they are given (``validation.arrow``)."""

    def fill(directory: Path) -> None:
        _write_files(directory, train, test, clients, num_classes, description, validation)

    locations.write_folder(location, fill, last=MANIFEST)
    return ShardStore.open(location)


def _write_files(
    directory: Path,
    train: LabeledArrays,
    test: LabeledArrays,
    clients: list[np.ndarray],
    num_classes: int,
    description: dict,
    validation: LabeledArrays | None = None,
) -> None:
    order = np.concatenate(clients) if clients else np.empty(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(clients)), [len(c) for c in clients])
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in clients])]).astype(np.int64)
    # Already in client order (natural partitions of generated data): no 0.8 GB copy at 100k.
    in_order = np.array_equal(order, np.arange(len(train)))
    train_sorted = train if in_order else train.take(order)
    train_sha, train_layout = _write_ipc(_table(train_sorted, owner), directory / "train.arrow")
    test_owner = test.group if test.group is not None else np.full(len(test), -1)
    test_order = np.argsort(test_owner, kind="stable")
    test_sha, test_layout = _write_ipc(
        _table(test.take(test_order), test_owner[test_order]), directory / "test.arrow"
    )
    checksums = {"train.arrow": train_sha, "test.arrow": test_sha}
    layout = {"train.arrow": train_layout, "test.arrow": test_layout}
    held_out = {}
    if validation is not None:
        owner = validation.group if validation.group is not None else np.full(len(validation), -1)
        name = "validation.arrow"
        checksums[name], layout[name] = _write_ipc(_table(validation, owner), directory / name)
        held_out = {"num_validation": int(len(validation))}
    np.save(directory / "train_offsets.npy", offsets)
    np.save(directory / CLASS_COUNTS, client_class_counts(train_sorted.y, offsets, num_classes))
    manifest = {
        "format_version": FORMAT_VERSION,
        **description,
        "num_clients": len(clients),
        "num_classes": int(num_classes),
        "x_shape": list(train.x.shape[1:]),
        "x_dtype": "uint8" if train.x.dtype == np.uint8 else "float32",
        "num_train": int(len(train)),
        "num_test": int(len(test)),
        **held_out,
        "checksums": checksums,
        "layout": layout,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


# Arrow's names of the floating-point types that NumPy names otherwise.
_ARROW_FLOATS = {"halffloat": "float16", "float": "float32", "double": "float64"}


def numpy_view(array: pa.Array) -> np.ndarray:
    """What ``array.to_numpy(zero_copy_only=True)`` returns for a store's null-free integer or
    float column — a read-only NumPy view of its buffer — without the import of pandas that
    pyarrow's ``to_numpy`` makes on its first call (0.5 s of CPU in every actor's start)."""
    kind = array.type
    if array.null_count or not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise ValueError(f"a store column is null-free integers or floats, not {kind}")
    dtype = np.dtype(_ARROW_FLOATS.get(str(kind), str(kind)))
    view = np.frombuffer(
        array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize
    )
    view.flags.writeable = False  # as pyarrow's: Arrow's buffers are immutable
    return view


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    # Stores are written as a single record batch, so this is the zero-copy path.
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


@dataclass
class ClientArrays:
    """NumPy arrays of some rows: zero-copy, read-only views of a local store's map where they
    are one slice of it; otherwise arrays of their own."""

    x: np.ndarray
    y: np.ndarray


class StoreReadFailed(RuntimeError):
    """Rows of an object-store store that could not be fetched once a run began (the endpoint
    went away, or kept failing past ``locations.ATTEMPTS`` tries): not a damaged store, and no
    reason to rebuild it."""

    def __init__(self, location: str, reason: str):
        self.location, self.reason = location, reason
        super().__init__(
            f"shard store {location}: rows could not be read ({reason}); the run stopped: "
            "resume it from its last checkpoint (python -m cluster resume) once the store "
            "answers"
        )

    def __reduce__(self):  # as Ray sends it from an actor: fields, then later state
        return (self.__class__, (self.location, self.reason), self.__dict__)


class StoreError(ValueError):
    """A store that cannot be read as written: missing, corrupt, truncated or of another format,
    or (``denied``) in an object store that refused these credentials.

    The message names the file and says to rebuild the store (its content is a function of the
    manifest's parameters, so rebuilding loses nothing).
    """

    def __init__(self, location: str, problem: str, denied: bool = False):
        self.location, self.problem = location, problem
        self.denied = denied  # an object store refused these credentials
        super().__init__(
            f"shard store {location}: {problem}; rebuild it (delete the directory and run again, "
            "or `uv run python -m cluster partition ...`)"
        )

    def __reduce__(self):  # as Ray sends it from an actor: fields, then later state
        return (self.__class__, (self.location, self.problem, self.denied), self.__dict__)


# What ``check`` expects of each table's schema (the value type of x follows the manifest).
_COLUMNS = ("client_id", "x", "y")
RowRanges = Sequence[tuple[int, int]]


class ShardStore:
    """A read-only view of a store; cheap to open, safe to open in every actor."""

    def __init__(self, location: str, manifest: dict, offsets: np.ndarray):
        self.location = location  # an absolute path or a URI: what actors are sent
        self.manifest = manifest
        self.offsets = offsets
        self.client_sizes = np.diff(offsets)  # once: hosts ask for it per client per round
        self.client_sizes.flags.writeable = False
        where = locations.parse_location(location)
        self._splits = (
            _MappedSplits(where, manifest)
            if isinstance(where, Path)
            else _RangedSplits(where, manifest)
        )

    @property
    def path(self) -> Location:
        """The store's directory, or its key prefix in an object store."""
        return locations.parse_location(self.location)

    @classmethod
    def open(cls, location: str | Location) -> ShardStore:
        """Read the manifest and the offsets index; raises ``StoreError`` when either is
        missing, unreadable or of another format. A relative path is made absolute here, so
        that every actor, wherever its working directory, opens this store."""
        text = str(location)
        try:
            where = locations.parse_location(location)
        except LocationError as error:
            raise StoreError(text, error.problem) from None
        if isinstance(where, Path):
            where = where.absolute()
            text = str(where)
        try:
            manifest = json.loads(locations.read_bytes(where / MANIFEST))
        except (OSError, ValueError) as error:  # missing, unreadable or not JSON
            if isinstance(where, ObjectLocation) and locations.unreachable(error):
                raise StoreReadFailed(text, first_line(error)) from None  # not damaged
            problem = f"{MANIFEST} unreadable ({first_line(error)})"
            raise StoreError(text, problem, locations.denies_access(error)) from None
        if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
            version = manifest.get("format_version") if isinstance(manifest, dict) else None
            raise StoreError(
                text, f"format {version} unsupported (this version reads {FORMAT_VERSION})"
            )
        needed = {"num_clients", "x_shape", "num_test", "source", "checksums"}
        if isinstance(where, ObjectLocation):
            needed.add("layout")  # written since object stores are read by byte ranges
        missing = needed - set(manifest)
        if missing:
            raise StoreError(text, f"{MANIFEST} lacks {', '.join(sorted(missing))}")
        try:
            offsets = np.load(io.BytesIO(locations.read_bytes(where / "train_offsets.npy")))
        except (OSError, ValueError) as error:
            raise StoreError(text, f"train_offsets.npy unreadable ({first_line(error)})") from None
        if offsets.ndim != 1 or len(offsets) != manifest["num_clients"] + 1:
            raise StoreError(text, "train_offsets.npy does not index the manifest's clients")
        return cls(text, manifest, offsets)

    def check(self) -> None:
        """Structural check, O(1) in the data: each table opens (its Arrow footer is intact, so
        the file is not truncated), has the store's columns and as many rows as the index says.
        ``verify`` recomputes the checksums (reads everything)."""
        expected_rows = {"train": int(self.offsets[-1]), "test": int(self.manifest["num_test"])}
        if self.num_validation:
            expected_rows["validation"] = self.num_validation
        for split, rows in expected_rows.items():
            try:
                columns, found = self._splits.shape(split)
            except (OSError, pa.ArrowInvalid) as error:
                raise StoreError(self.location, f"{split}.arrow unreadable ({error})") from None
            except (KeyError, TypeError, ValueError) as error:  # a layout not of this format
                raise StoreError(
                    self.location, f"{MANIFEST}'s layout of {split}.arrow malformed ({error!r})"
                ) from None
            if tuple(columns) != _COLUMNS:
                raise StoreError(
                    self.location,
                    f"{split}.arrow has columns {columns}, expected {list(_COLUMNS)}",
                )
            if found != rows:
                raise StoreError(self.location, f"{split}.arrow has {found} rows, the index {rows}")

    def class_counts(self) -> np.ndarray:
        """int64[num_clients, num_classes]: each client's training class histogram."""
        return np.load(io.BytesIO(locations.read_bytes(self.path / CLASS_COUNTS)))

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    def _client_range(self, client_id: int) -> tuple[int, int]:
        return int(self.offsets[client_id]), int(self.offsets[client_id + 1])

    def client(self, client_id: int) -> ClientArrays:
        """The training rows of one client."""
        return self._splits.span("train", *self._client_range(client_id))

    def clients(self, client_ids: Sequence[int]) -> ClientArrays:
        """The training rows of these clients, one after the other (a host's preload: from an
        object store in few requests, not one per client)."""
        return self._splits.rows("train", [self._client_range(c) for c in client_ids])

    def train_rows(self) -> ClientArrays:
        """Every client's training rows, in client order (client i's are ``offsets[i]:``)."""
        return self._splits.span("train", 0, int(self.offsets[-1]))

    def test_rows(self, start: int = 0, stop: int | None = None) -> ClientArrays:
        """A slice of the (pooled) test set."""
        stop = self.manifest["num_test"] if stop is None else stop
        return self._splits.span("test", start, stop)

    @property
    def num_validation(self) -> int:
        """Rows held out for validation (0: none, the store has no ``validation.arrow``)."""
        return int(self.manifest.get("num_validation", 0))

    def held_out_rows(self, split: str, start: int, stop: int) -> ClientArrays:
        """Rows ``start:stop`` of the ``test`` or ``validation`` split (pooled)."""
        return self._splits.span(split, start, stop)

    def test_take(self, index: np.ndarray) -> ClientArrays:
        """Test rows at ``index`` (a copy, gathered from the map or fetched by ranges)."""
        return self._splits.take("test", np.asarray(index, dtype=np.int64))

    def matched_test_sets(self, per_client: int, seed: int) -> list[np.ndarray]:
        """Each client's test rows, ``per_client`` of them in its training label mix.

        DP-FedSAM's per-client evaluation (``datasets.partition.matched_test_split``), drawn from
        ``SeedSequence([seed, 0x7E57])`` so every host computes the same sets.
        """
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x7E57]))
        labels = self._splits.labels("test", int(self.manifest["num_test"]))
        return matched_test_split(labels, self.class_counts(), per_client, rng)

    def verify(self) -> None:
        """Recompute the checksums; raises if a file changed since it was written."""
        for name, expected in self.manifest["checksums"].items():
            with locations.open_input_stream(self.path / name) as stream:
                digest = hashlib.file_digest(stream, "sha256").hexdigest()
            if digest != expected:
                raise StoreError(self.location, f"{name}: checksum mismatch")


class _MappedSplits:
    """A local store's tables, memory-mapped; their columns as NumPy views of the map."""

    def __init__(self, directory: Path, manifest: dict):
        self.directory, self.x_shape = directory, tuple(manifest["x_shape"])
        self._tables: dict[str, pa.Table] = {}
        self._columns: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def _table(self, split: str) -> pa.Table:
        if split not in self._tables:
            source = pa.memory_map(str(self.directory / f"{split}.arrow"), "r")
            self._tables[split] = pa.ipc.open_file(source).read_all()
        return self._tables[split]

    def shape(self, split: str) -> tuple[list[str], int]:
        """The table's column names and rows (opening it reads its footer)."""
        table = self._table(split)
        return table.column_names, table.num_rows

    def _arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of a whole split as NumPy views of the map (zero-copy), made once: a client's
        rows are then a slice, not an Arrow slice and conversion per read (50,000 clients'
        preload: 2.5 s of the host's 6.8 s start)."""
        if split not in self._columns:
            table = self._table(split)
            x = numpy_view(_one_chunk(table.column("x")).flatten())
            y = numpy_view(_one_chunk(table.column("y")))
            self._columns[split] = (x.reshape(table.num_rows, *self.x_shape), y)
        return self._columns[split]

    def span(self, split: str, start: int, stop: int) -> ClientArrays:
        """Rows ``start:stop``: a view of the map (zero-copy)."""
        x, y = self._arrays(split)
        return ClientArrays(x[start:stop], y[start:stop])

    def rows(self, split: str, ranges: RowRanges) -> ClientArrays:
        """Rows of ``ranges`` in order (a copy)."""
        x, y = self._arrays(split)
        return ClientArrays(
            np.concatenate([x[a:b] for a, b in ranges]), np.concatenate([y[a:b] for a, b in ranges])
        )

    def take(self, split: str, index: np.ndarray) -> ClientArrays:
        x, y = self._arrays(split)
        return ClientArrays(x[index], y[index])

    def labels(self, split: str, num_rows: int) -> np.ndarray:
        return self._arrays(split)[1][:num_rows]


class _RangedSplits:
    """A store in an object store: rows fetched by byte ranges of the column buffers that the
    manifest's layout locates, never a whole table unless every row is asked for."""

    def __init__(self, location: ObjectLocation, manifest: dict):
        self.location, self.layout = location, manifest["layout"]
        self.x_shape = tuple(manifest["x_shape"])
        self.x_dtype = np.dtype(manifest.get("x_dtype", "float32"))
        self.x_width = math.prod(self.x_shape) * self.x_dtype.itemsize
        self._files: dict[str, pa.NativeFile] = {}

    def _file(self, split: str) -> pa.NativeFile:
        if split not in self._files:
            self._files[split] = locations.open_input_file(self.location / f"{split}.arrow")
        return self._files[split]

    def shape(self, split: str) -> tuple[list[str], int]:
        """The table's column names (from its footer, a few small requests) and the rows its
        layout holds; the layout must lie inside the file."""
        file = self._file(split)
        names = pa.ipc.open_file(file).schema.names
        layout = self.layout[f"{split}.arrow"]
        (x_start, x_bytes), (y_start, y_bytes) = layout["x"], layout["y"]
        rows, remainder = divmod(x_bytes, self.x_width)
        end = max(x_start + x_bytes, y_start + y_bytes)
        negative = min(x_start, x_bytes, y_start, y_bytes) < 0
        if negative or remainder or y_bytes != 8 * rows or end > file.size():
            raise pa.ArrowInvalid(f"the manifest's layout {layout} does not fit the file")
        return names, rows

    def span(self, split: str, start: int, stop: int) -> ClientArrays:
        return self.rows(split, [(start, stop)])

    def rows(self, split: str, ranges: RowRanges) -> ClientArrays:
        """Rows of ``ranges`` in order, x and y fetched together (``read_ranges``)."""
        layout = self.layout[f"{split}.arrow"]
        x_start, y_start = layout["x"][0], layout["y"][0]
        byte_ranges = [(x_start + a * self.x_width, x_start + b * self.x_width) for a, b in ranges]
        byte_ranges += [(y_start + a * 8, y_start + b * 8) for a, b in ranges]
        data = self._read(split, byte_ranges)
        x_bytes = sum(b - a for a, b in ranges) * self.x_width
        x = data[:x_bytes].view(self.x_dtype).reshape(-1, *self.x_shape)
        return ClientArrays(x, data[x_bytes:].view(np.int64))

    def take(self, split: str, index: np.ndarray) -> ClientArrays:
        """Rows at ``index``: each distinct row fetched once (neighbours in one request)."""
        wanted, position = np.unique(index, return_inverse=True)
        fetched = self.rows(split, [(int(i), int(i) + 1) for i in wanted])
        return ClientArrays(fetched.x[position], fetched.y[position])

    def labels(self, split: str, num_rows: int) -> np.ndarray:
        """The y column alone (8 bytes a row, in one request)."""
        start = self.layout[f"{split}.arrow"]["y"][0]
        return self._read(split, [(start, start + 8 * num_rows)]).view(np.int64)

    def _read(self, split: str, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """``read_ranges`` of the split's file; a ``StoreReadFailed`` where the object store
        did not answer (pyarrow has retried each request)."""
        try:
            return read_ranges(self._file(split), ranges)
        except OSError as error:
            raise StoreReadFailed(str(self.location), first_line(error)) from None


def read_ranges(file: pa.NativeFile, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The bytes of ``ranges`` of ``file``, one after the other, as uint8.

    Ranges are sorted by start and merged where the gap to the next is at most
    ``HOLE_BYTES`` (the gap is read and dropped) and the merged span stays within
    ``SPAN_BYTES``; each span is one ``read_at`` (one ranged GET on S3), ``FETCH_THREADS`` at a
    time. Empty ranges cost nothing."""
    sizes = np.array([b - a for a, b in ranges], dtype=np.int64)
    destinations = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out = np.empty(int(destinations[-1]), dtype=np.uint8)
    spans: list[list] = []  # [start, stop, members]
    for i in sorted((i for i in range(len(ranges)) if sizes[i]), key=lambda i: ranges[i][0]):
        start, stop = ranges[i]
        if spans and start - spans[-1][1] <= HOLE_BYTES and stop - spans[-1][0] <= SPAN_BYTES:
            spans[-1][1] = max(spans[-1][1], stop)
            spans[-1][2].append(i)
        else:
            spans.append([start, stop, [i]])

    def fetch(span: list) -> None:
        start, stop, members = span
        data = np.frombuffer(file.read_at(stop - start, start), dtype=np.uint8)
        if len(data) != stop - start:
            raise OSError(f"bytes {start}:{stop} asked for, {len(data)} read: the file is short")
        for i in members:
            a, b = ranges[i]
            out[destinations[i] : destinations[i] + sizes[i]] = data[a - start : b - start]

    if len(spans) == 1:
        fetch(spans[0])
    elif spans:
        with ThreadPoolExecutor(min(FETCH_THREADS, len(spans))) as pool:
            list(pool.map(fetch, spans))
    return out
