"""Pinning clients to hosts: longest-first to the least-loaded host (as pfl-research does)."""

from __future__ import annotations

import heapq

import numpy as np


def pin_clients(client_sizes: np.ndarray, num_hosts: int) -> list[list[int]]:
    """Assign every client to one host, balancing total samples; each host's list is sorted."""
    heap = [(0, host) for host in range(num_hosts)]
    assignment: list[list[int]] = [[] for _ in range(num_hosts)]
    for cid in np.argsort(-np.asarray(client_sizes), kind="stable"):
        load, host = heapq.heappop(heap)
        assignment[host].append(int(cid))
        heapq.heappush(heap, (load + int(client_sizes[cid]), host))
    return [sorted(a) for a in assignment]
