"""A host's client data: read from the memory-mapped shard store when a client is sampled, and
kept as model-ready tensors up to a byte budget (least recently used out first).

A host's memory is bounded by the budget, not by the number of clients it hosts: hosted clients
that fit in it are converted at start (``preload``) and stay resident; beyond it they are
converted when sampled and the least recently used are dropped. Evicted clients are read
again from the map (a slice, no copy) and converted again: the same tensors, so results do not
depend on the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from datasets.store import ClientArrays, ShardStore

DEFAULT_CACHE_BYTES = 1 << 30  # 1 GiB of model-ready tensors per host


class ClientDataCache:
    def __init__(
        self,
        store: ShardStore,
        to_tensors: Callable[[ClientArrays], tuple[torch.Tensor, torch.Tensor]],
        max_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        self.store, self.to_tensors, self.max_bytes = store, to_tensors, max_bytes
        self._cached: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0

    def __getitem__(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if client_id in self._cached:
            self._cached.move_to_end(client_id)
            return self._cached[client_id]
        tensors = self.to_tensors(self.store.client(client_id))
        self._cached[client_id] = tensors
        self.bytes += _nbytes(tensors)
        while self.bytes > self.max_bytes and len(self._cached) > 1:
            _, evicted = self._cached.popitem(last=False)
            self.bytes -= _nbytes(evicted)
        return tensors

    def preload(self, client_ids: list[int]) -> None:
        """Convert every client now if all of them fit in the budget (estimated from the first
        one's bytes per record), so that the rounds start with warm data; else leave it to the
        rounds."""
        if not client_ids:
            return
        first = self[client_ids[0]]
        per_record = _nbytes(first) / max(len(first[1]), 1)
        total = per_record * sum(self.num_records(cid) for cid in client_ids)
        if total <= self.max_bytes:
            for cid in client_ids:
                self[cid]

    def num_records(self, client_id: int) -> int:
        """The client's number of training records, from the store's index (nothing loaded)."""
        return int(self.store.client_sizes[client_id])

    def __len__(self) -> int:
        return len(self._cached)


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.element_size() * t.numel() for t in tensors)
