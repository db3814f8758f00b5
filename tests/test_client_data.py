"""Hosts read their clients from the memory-mapped store when sampled and keep them up to a byte
budget: nothing is converted at start, memory stays under the budget, results do not change."""

import torch
from helpers import small_config

from actors.client_data import ClientDataCache
from actors.client_host import Broadcast, ClientHost
from cluster.runtime.initial_state import initial_params
from cluster.runtime.store import open_store


def test_cache_loads_on_demand_and_evicts_least_recently_used(store_root):
    store, _ = open_store(small_config(store_root))
    loads = []

    def to_tensors(rows):
        loads.append(len(rows.y))
        return torch.tensor(rows.x), torch.tensor(rows.y)

    one_client = sum(t.element_size() * t.numel() for t in to_tensors(store.client(0)))
    loads.clear()
    cache = ClientDataCache(store, to_tensors, max_bytes=2 * one_client)
    assert len(cache) == 0 and cache.num_records(3) == len(store.client(3).y) and not loads
    first = cache[0]
    cache[1], cache[0], cache[2]  # 1 is now the least recently used: evicted
    assert len(cache) == 2 and cache.bytes <= 2 * one_client and len(loads) == 3
    assert cache[0] is first  # still cached
    again = cache[1]  # read again from the map: the same values
    assert len(loads) == 4 and torch.equal(again[0], torch.tensor(store.client(1).x))


def test_a_tiny_cache_changes_no_result(store_root):
    config = small_config(store_root, "algorithm.name=dp_fedavg", "algorithm.clip_norm=1",
                          "algorithm.noise_multiplier=0.5")  # fmt: skip
    store, _ = open_store(config)
    _, params = initial_params(config, store)
    clients = list(range(store.num_clients))
    hosts = [
        ClientHost(
            str(store.path), config.task, config.build_algorithm(), 0, clients, cache_bytes=b
        )
        for b in (1, 1 << 30)
    ]
    broadcast = Broadcast(params.numpy(), {})
    for round_index in range(2):
        sums = [h.run_round(round_index, broadcast, [3, 7, 3 + round_index], 3.0) for h in hosts]
        assert sums[0].sums.keys() == sums[1].sums.keys()
        for name in sums[0].sums:
            assert torch.equal(sums[0].sums[name], sums[1].sums[name])
    assert len(hosts[0].data) == 1  # over budget: one client at a time
    assert len(hosts[1].data) == store.num_clients  # all fit: converted at start


def test_preload_converts_one_block_equal_to_each_client(store_root):
    store, _ = open_store(small_config(store_root))
    loads = []

    def to_tensors(rows):
        loads.append(len(rows.y))
        return torch.tensor(rows.x) * 2, torch.tensor(rows.y)  # row by row, as a task's are

    clients = [5, 2, 9, 0]
    block = sum(len(store.client(c).y) for c in clients)
    one = max(t.element_size() * t.numel() for t in to_tensors(store.client(3)))
    per_record = sum(t.element_size() * t.numel() for t in to_tensors(store.client(3))) / len(
        store.client(3).y
    )
    loads.clear()
    # Room for the block and about one more client.
    cache = ClientDataCache(store, to_tensors, max_bytes=int(per_record * block) + 2 * one)
    cache.preload(clients)
    assert loads == [len(store.client(5).y), block]  # the estimate, then one conversion
    resident = {c: cache[c] for c in clients}
    for c, (x, y) in resident.items():
        assert torch.equal(x, torch.tensor(store.client(c).x) * 2)
        assert torch.equal(y, torch.tensor(store.client(c).y))
    # Clients from elsewhere share what the block leaves; the block itself is never evicted.
    for c in (1, 3, 4, 1):
        cache[c]
    assert len(cache) == len(clients) + 1
    assert all(cache[c] is tensors for c, tensors in resident.items())
    assert cache.resident_bytes + cache.bytes <= cache.max_bytes
    assert len(loads) == 2 + 4  # 1, 3 and 4, then 1 again (evicted by 4)


def test_rows_are_read_in_place_from_the_block_else_concatenated(store_root):
    """``rows``: the preloaded block itself where every client asked for is in it (no copy),
    else a concatenation; either way client i's rows are its own tensors."""
    store, _ = open_store(small_config(store_root))
    cache = ClientDataCache(store, lambda rows: (torch.tensor(rows.x), torch.tensor(rows.y)))
    cache.preload([5, 2, 9, 0])
    for asked in ([9, 0, 2], [9, 1, 2]):  # 1 is not in the block
        rows = cache.rows(asked)
        assert (rows.x is cache._block[0]) == (asked == [9, 0, 2])
        for cid, start, size in zip(asked, rows.starts, rows.sizes, strict=True):
            x, y = cache[cid]
            assert size == cache.num_records(cid)
            assert torch.equal(rows.x[start : start + size], x)
            assert torch.equal(rows.y[start : start + size], y)
