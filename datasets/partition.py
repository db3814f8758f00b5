"""Partitioners: split a pooled labelled dataset into client shards.

One interface, ``Partitioner.split(data, num_clients, rng) -> list of row-index arrays``; every
partitioner is deterministic given ``rng`` and never repeats a row. ``describe()`` is what the
shard manifest records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import numpy as np

from datasets.arrays import LabeledArrays


class Partitioner(ABC):
    method: str

    @abstractmethod
    def split(
        self, data: LabeledArrays, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Row indices of each client, disjoint."""

    def describe(self) -> dict:
        return {"method": self.method, **asdict(self)}


@dataclass(frozen=True)
class NaturalPartitioner(Partitioner):
    """Client i owns the rows whose natural ``group`` (user, writer) is i."""

    method = "natural"

    def split(self, data, num_clients, rng):
        if data.group is None:
            raise ValueError("the natural partition needs a source with per-row owners (group)")
        found = int(data.group.max()) + 1
        if found != num_clients:
            raise ValueError(f"the source has {found} natural users but num_clients={num_clients}")
        order = np.argsort(data.group, kind="stable")
        bounds = np.searchsorted(data.group[order], np.arange(num_clients + 1))
        return [order[bounds[i] : bounds[i + 1]] for i in range(num_clients)]


@dataclass(frozen=True)
class IIDPartitioner(Partitioner):
    """A uniformly random permutation cut into ``num_clients`` near-equal parts."""

    method = "iid"

    def split(self, data, num_clients, rng):
        return [np.sort(part) for part in np.array_split(rng.permutation(len(data)), num_clients)]


@dataclass(frozen=True)
class DirichletClientPrior(Partitioner):
    """Per-client class prior (Hsu et al. 2019), equal client sizes, as in DP-FedSAM's CIFAR code.

    Client i draws a class prior q_i ~ Dir(α·1_K), then fills ⌊n/M⌋ (+1 for the first n mod M)
    slots one sample at a time: a class is drawn from q_i restricted to the classes that still
    have samples (renormalised, so an exhausted class never yields NaN), and a sample of that class
    is taken without replacement. Small α gives few classes per client.
    """

    alpha: float
    method = "dirichlet"

    def split(self, data, num_clients, rng):
        classes, labels = np.unique(data.y, return_inverse=True)
        pools = [rng.permutation(np.flatnonzero(labels == c)).tolist() for c in range(len(classes))]
        remaining = np.array([len(p) for p in pools], dtype=np.float64)
        sizes = np.full(num_clients, len(data) // num_clients)
        sizes[: len(data) % num_clients] += 1
        priors = rng.dirichlet(np.full(len(classes), self.alpha), size=num_clients)
        clients = []
        for prior, size in zip(priors, sizes, strict=True):
            rows = np.empty(size, dtype=np.int64)
            for slot in range(size):
                weights = prior * (remaining > 0)
                total = weights.sum()
                # The prior may put all its mass on exhausted classes: fall back to what is left.
                probs = weights / total if total > 0 else remaining / remaining.sum()
                c = rng.choice(len(classes), p=probs)
                rows[slot] = pools[c].pop()
                remaining[c] -= 1
            clients.append(np.sort(rows))
        return clients


def make_partitioner(method: str, alpha: float | None = None) -> Partitioner:
    if method == "natural":
        return NaturalPartitioner()
    if method == "iid":
        return IIDPartitioner()
    if method == "dirichlet":
        return DirichletClientPrior(alpha=float(alpha))
    raise ValueError(f"unknown partition method {method!r}")


PARTITION_METHODS = ("natural", "iid", "dirichlet")
