"""Per-client algorithm state (SCAFFOLD's c_i) kept on disk, d floats per client that has any.

A host of thousands of clients must not hold every c_i as a tensor: at FEMNIST scale (3,400
clients, the 36,895-parameter logistic regression) that is 0.5 GB per actor, and for a CNN far
more. ``ClientStateStore`` keeps each named state (``"control"``) as rows of one memory-mapped
float file, a row allocated the first time a client stores a state; the capacity doubles as
clients appear. Resident memory is the pages in use (the cohort's rows), not the file; a client
without state costs nothing, and a store no client puts a state in opens no file.

Each file is anonymous: ``tempfile.TemporaryFile`` in ``$DPFL_STATE_DIR`` (or the system's
temporary directory) is unlinked from the start (``O_TMPFILE`` on Linux), so it has no path and
the kernel frees its blocks when the process exits, however it exits: Ray kills actors
(``ray.kill``, a lost node) without running finalizers, and a named file would stay behind.

``state_dict`` / ``load_state_dict`` move the rows in and out of checkpoints as one array per
name plus the client ids (bit-identical: the same dtype and bytes).
"""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO

import numpy as np
import torch


class ClientStateStore:
    def __init__(self, device: torch.device | str = "cpu", directory: str | None = None):
        self.device = torch.device(device)
        self._root = _writable_directory(directory or os.environ.get("DPFL_STATE_DIR") or None)
        self._rows: dict[int, int] = {}  # client id → row
        self._handles: dict[str, BinaryIO] = {}  # name → its anonymous file, opened on first put
        self._files: dict[str, np.memmap] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, client_id: int) -> bool:
        return int(client_id) in self._rows

    @property
    def allocated_bytes(self) -> int:
        """The bytes the state files hold on disk (every allocated row, used or not)."""
        return sum(rows.nbytes for rows in self._files.values())

    def get(self, client_id: int) -> dict[str, torch.Tensor]:
        """The client's state as tensors on the host's device ({} if it has none yet)."""
        row = self._rows.get(int(client_id))
        if row is None:
            return {}
        return {
            name: torch.from_numpy(np.array(rows[row])).to(self.device)
            for name, rows in self._files.items()
        }

    def put(self, client_id: int, state: dict[str, torch.Tensor]) -> None:
        if not state:
            return
        row = self._rows.get(int(client_id), len(self._rows))
        for name, value in state.items():
            array = value.detach().cpu().numpy().reshape(-1)
            self._file(name, array.dtype, array.size, row + 1)[row] = array
        self._rows[int(client_id)] = row  # only once every state has its row

    def _file(self, name: str, dtype: np.dtype, width: int, rows: int) -> np.memmap:
        """The memory map of ``name`` with at least ``rows`` rows (doubling when it grows)."""
        current = self._files.get(name)
        if current is not None and current.shape[0] >= rows:
            return current
        capacity = max(rows, 2 * (0 if current is None else current.shape[0]), 16)
        if current is None:  # open for the store's life, closed by load_state_dict
            self._handles[name] = tempfile.TemporaryFile(dir=self._root)  # noqa: SIM115
        else:
            current.flush()
        handle = self._handles[name]
        handle.truncate(capacity * width * np.dtype(dtype).itemsize)  # rows keep their bytes
        self._files[name] = np.memmap(handle, dtype=dtype, mode="r+", shape=(capacity, width))
        return self._files[name]

    def state_dict(self) -> dict:
        """{"client_ids": (n,), name: (n, d) array per state}, rows in client-id order."""
        ids = np.array(sorted(self._rows), dtype=np.int64)
        rows = np.array([self._rows[c] for c in ids], dtype=np.int64)
        return {"client_ids": ids, **{n: np.array(f[rows]) for n, f in self._files.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._rows.clear()
        self._files.clear()
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        for index, client_id in enumerate(state["client_ids"].tolist()):
            self.put(client_id, {n: torch.from_numpy(a[index]) for n, a in _named(state)})

    @staticmethod
    def merge(parts: list[dict]) -> dict:
        """One state dict from several hosts' (disjoint clients)."""
        parts = [p for p in parts if len(p.get("client_ids", ()))]
        if not parts:
            return {"client_ids": np.zeros(0, dtype=np.int64)}
        merged = {"client_ids": np.concatenate([p["client_ids"] for p in parts])}
        for name, _ in _named(parts[0]):
            merged[name] = np.concatenate([p[name] for p in parts])
        return merged

    @staticmethod
    def select(state: dict, keep: np.ndarray) -> dict:
        """The rows of ``state`` whose client ids are in the boolean ``keep`` (by client id)."""
        ids = state["client_ids"]
        mask = keep[ids] if len(ids) else np.zeros(0, dtype=bool)
        return {"client_ids": ids[mask], **{n: a[mask] for n, a in _named(state)}}


def _named(state: dict):
    return [(n, a) for n, a in state.items() if n != "client_ids"]


def _writable_directory(root: str | None) -> str | None:
    """``root`` where the state files can be created in it (None: the system's temporary
    directory); checked when the host starts, not at the first SCAFFOLD round's end."""
    if root is not None and not (os.path.isdir(root) and os.access(root, os.W_OK | os.X_OK)):
        raise ValueError(
            f"DPFL_STATE_DIR = {root!r}: not a writable directory, so the clients' states "
            "(SCAFFOLD's c_i) have nowhere to go; point it at an existing directory this "
            "process may write in, or unset it for the system's temporary directory"
        )
    return root
