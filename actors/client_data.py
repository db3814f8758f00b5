"""A host's client data: read from the memory-mapped shard store when a client is sampled, and
kept as model-ready tensors up to a byte budget (least recently used out first).

A host's memory is bounded by the budget, not by the number of clients it hosts: when all its
clients fit in it they are converted at start (``preload``), as one block of rows converted in
one call (a 50,000-client host: one copy instead of 50,000), and stay resident; beyond it they
are converted when sampled and the least recently used are dropped. Clients a host trains
without hosting them (rounds evened out over hosts) share what the block leaves of the budget.
Evicted clients are read again from the map (a slice, no copy) and converted again: the same
tensors (conversion is row by row), so results do not depend on the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from algorithms.vectorized import ClientRows
from datasets.store import ClientArrays, ShardStore

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB of model-ready tensors per host

Tensors = tuple[torch.Tensor, torch.Tensor]


class ClientDataCache:
    def __init__(
        self,
        store: ShardStore,
        to_tensors: Callable[[ClientArrays], Tensors],
        max_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        """``to_tensors`` must convert row by row (a block's rows convert as each client's)."""
        self.store, self.to_tensors, self.max_bytes = store, to_tensors, max_bytes
        self._resident: dict[int, Tensors] = {}  # preloaded: views of one block, never evicted
        self._block: Tensors | None = None  # the preloaded block
        self._block_starts: dict[int, int] = {}  # each preloaded client's first row in it
        self._cached: OrderedDict[int, Tensors] = OrderedDict()
        self.resident_bytes = 0
        self.bytes = 0  # of the evictable clients

    def __getitem__(self, client_id: int) -> Tensors:
        if client_id in self._resident:
            return self._resident[client_id]
        if client_id in self._cached:
            self._cached.move_to_end(client_id)
            return self._cached[client_id]
        tensors = self.to_tensors(self.store.client(client_id))
        self._cached[client_id] = tensors
        self.bytes += _nbytes(tensors)
        while self.resident_bytes + self.bytes > self.max_bytes and len(self._cached) > 1:
            _, evicted = self._cached.popitem(last=False)
            self.bytes -= _nbytes(evicted)
        return tensors

    def preload(self, client_ids: list[int]) -> None:
        """Convert every client now, as one block, if all of them fit in the budget (estimated
        from the first one's bytes per record), so that the rounds start with warm data; else
        leave it to the rounds."""
        if not client_ids:
            return
        sizes = self.store.client_sizes[client_ids]
        first = self.to_tensors(self.store.client(client_ids[0]))
        per_record = _nbytes(first) / max(len(first[1]), 1)
        if per_record * sizes.sum() > self.max_bytes:
            return
        x, y = self.to_tensors(self.store.clients(client_ids))  # few requests from S3
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        for cid, start, stop in zip(client_ids, bounds[:-1], bounds[1:], strict=True):
            self._resident[cid] = (x[start:stop], y[start:stop])
            self._block_starts[cid] = start
        self._block = (x, y)
        self.resident_bytes = _nbytes((x, y))

    def rows(self, client_ids: list[int]) -> ClientRows:
        """The clients' records as rows (``algorithms.vectorized``): read in place from the
        preloaded block where all of them are in it, else concatenated (one copy)."""
        starts = self._block_starts
        if self._block is None or not all(cid in starts for cid in client_ids):
            return ClientRows.concatenated([self[cid] for cid in client_ids])
        sizes = self.store.client_sizes[client_ids].tolist()
        return ClientRows(*self._block, [starts[cid] for cid in client_ids], sizes)

    def num_records(self, client_id: int) -> int:
        """The client's number of training records, from the store's index (nothing loaded)."""
        return int(self.store.client_sizes[client_id])

    def __len__(self) -> int:
        return len(self._resident) + len(self._cached)


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.element_size() * t.numel() for t in tensors)
