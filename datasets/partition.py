"""Partitioners: split a pooled labelled dataset into client shards.

One interface, ``Partitioner.split(data, num_clients, rng) -> list of row-index arrays``; every
partitioner is deterministic given ``rng`` and never repeats a row, except ``dirichlet`` with
``samples_per_client`` (DP-FedPGN's code: class pools are refilled, so clients may share rows).
``describe()`` is what the shard manifest records.

Methods (``make_partitioner``): ``natural`` (the source's own users), ``iid``, ``dirichlet``
(per-client class prior, equal sizes), ``dirichlet_class`` (per-class Dirichlet/LDA split,
unequal sizes, ``min_size``), ``shards`` (McMahan et al.'s label-sorted shards,
``classes_per_client``) and ``label_skew`` (DP-SCAFFOLD's γ i.i.d. + one label per user,
``iid_fraction``, ``samples_per_client``). ``matched_test_split`` builds per-client test sets
with each client's training label mix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import numpy as np

from datasets.arrays import LabeledArrays


class PartitionError(ValueError):
    """The data cannot be partitioned as configured (too few rows or users for the clients asked
    for): bad input, found only once the data is read. ``field`` is the config field to change
    (under ``data.``)."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field

    def __reduce__(self):  # as Ray sends it from an actor: fields, then later state
        return (self.__class__, (self.field, self.args[0]), self.__dict__)


class Partitioner(ABC):
    method: str

    @abstractmethod
    def split(
        self, data: LabeledArrays, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Row indices of each client, disjoint (``dirichlet`` with ``samples_per_client``: not)."""

    def describe(self) -> dict:
        return {"method": self.method, **{k: v for k, v in asdict(self).items() if v is not None}}


@dataclass(frozen=True)
class NaturalPartitioner(Partitioner):
    """Client i owns the rows whose natural ``group`` (user, writer) is i."""

    method = "natural"

    def split(self, data, num_clients, rng):
        if data.group is None:
            raise ValueError("the natural partition needs a source with per-row owners (group)")
        found = int(data.group.max()) + 1
        if found != num_clients:
            raise PartitionError(
                "num_clients", f"the source has {found} natural users but num_clients={num_clients}"
            )
        order = np.argsort(data.group, kind="stable")
        bounds = np.searchsorted(data.group[order], np.arange(num_clients + 1))
        return [order[bounds[i] : bounds[i + 1]] for i in range(num_clients)]


@dataclass(frozen=True)
class IIDPartitioner(Partitioner):
    """A uniformly random permutation cut into ``num_clients`` near-equal parts."""

    method = "iid"

    def split(self, data, num_clients, rng):
        _check_clients(num_clients, len(data), self.method)
        return [np.sort(part) for part in np.array_split(rng.permutation(len(data)), num_clients)]


@dataclass(frozen=True)
class DirichletClientPrior(Partitioner):
    """Per-client class prior (Hsu et al. 2019), equal client sizes, as in DP-FedSAM's CIFAR code.

    Client i draws a class prior q_i ~ Dir(α·1_K), then fills ⌊n/M⌋ (+1 for the first n mod M)
    slots one sample at a time: a class is drawn from q_i restricted to the classes that still
    have samples (renormalised, so an exhausted class never yields NaN), and a sample of that class
    is taken without replacement. Small α gives few classes per client.

    With ``samples_per_client`` n every client draws exactly n slots from its prior and an
    exhausted class pool is refilled with a fresh permutation of the class, so rows repeat across
    clients (DP-FedPGN's code: 500 clients × 500 draws from CIFAR-10's 50,000 images).
    """

    alpha: float
    samples_per_client: int | None = None
    method = "dirichlet"

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)
        if self.samples_per_client is not None and self.samples_per_client < 1:
            raise ValueError(f"samples_per_client must be >= 1, got {self.samples_per_client}")

    def split(self, data, num_clients, rng):
        if self.samples_per_client is None:
            _check_clients(num_clients, len(data), self.method)
        elif self.samples_per_client > len(data):
            raise PartitionError(
                "partition.samples_per_client",
                f"dirichlet: {self.samples_per_client} draws per client, more than the "
                f"dataset's {len(data)} rows (DP-FedPGN: 500 of 50,000); lower it to at most "
                f"{len(data)}",
            )
        classes, labels = np.unique(data.y, return_inverse=True)
        members = [np.flatnonzero(labels == c) for c in range(len(classes))]
        pools = [rng.permutation(rows).tolist() for rows in members]
        remaining = np.array([len(p) for p in pools], dtype=np.float64)
        if self.samples_per_client is None:
            sizes = np.full(num_clients, len(data) // num_clients)
            sizes[: len(data) % num_clients] += 1
        else:
            sizes = np.full(num_clients, self.samples_per_client)
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
                if not pools[c] and self.samples_per_client is not None:
                    pools[c] = rng.permutation(members[c]).tolist()
                    remaining[c] = len(pools[c])
            clients.append(np.sort(rows))
        return clients


def _check_alpha(alpha: float) -> None:
    if not (np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"the Dirichlet concentration α must be a finite number > 0, got {alpha}")


def _check_clients(num_clients: int, n: int, method: str) -> None:
    """At least one client, and a row for each (a client without rows cannot train)."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if n == 0:
        raise ValueError("cannot partition an empty dataset")
    if num_clients > n:
        raise PartitionError(
            "num_clients",
            f"{method}: {num_clients} clients but the dataset has {n} rows, so some client "
            f"would get none; lower data.num_clients to at most {n}",
        )


@dataclass(frozen=True)
class DirichletPerClass(Partitioner):
    """Per-class Dirichlet ("LDA") split, unequal client sizes (Yurochkin et al. 2019, Wang et al.
    2020; flwr's ``DirichletPartitioner`` without self-balancing).

    For each class c independently, p_c ~ Dir(α·1_M) over the M clients and the class's rows
    (shuffled) are cut at ⌊n_c·cumsum(p_c)⌋, so client i gets about p_c[i]·n_c of them. Small α
    gives each class to few clients, so clients see few classes and their sizes vary a lot.

    The whole draw (every class) is repeated while some client has fewer than ``min_size`` rows,
    at most ``max_retries`` times; then a ValueError says which knob to turn. Infeasible requests
    (``min_size·num_clients > n``) fail before any draw. Every row goes to exactly one client (the
    cuts partition each class), and a draw whose weights are not finite (a Dirichlet with tiny α
    can underflow on old NumPy) is replaced by its α → 0 limit, a whole class to one client, so
    no NaN ever reaches the cut points.
    """

    alpha: float
    min_size: int = 10
    max_retries: int = 100
    method = "dirichlet_class"

    def __post_init__(self) -> None:
        _check_alpha(self.alpha)
        if self.min_size < 0:
            raise ValueError(f"min_size must be >= 0, got {self.min_size}")
        if self.max_retries < 1:
            raise ValueError(f"max_retries must be >= 1, got {self.max_retries}")

    def split(self, data, num_clients, rng):
        n = len(data)
        _check_clients(num_clients, n, self.method)
        if self.min_size * num_clients > n:
            raise PartitionError(
                "partition.min_size",
                f"dirichlet_class: min_size={self.min_size} × num_clients={num_clients} = "
                f"{self.min_size * num_clients} rows needed but the dataset has only {n}; "
                f"lower min_size (at most {n // num_clients}) or use fewer clients",
            )
        classes, labels = np.unique(data.y, return_inverse=True)
        by_class = [np.flatnonzero(labels == c) for c in range(len(classes))]
        smallest = 0
        for _ in range(self.max_retries):
            shuffled, owners = [], []
            for rows in by_class:
                rows = rng.permutation(rows)
                weights = rng.dirichlet(np.full(num_clients, self.alpha))
                if not (np.all(np.isfinite(weights)) and weights.sum() > 0):
                    weights = np.zeros(num_clients)
                    weights[rng.integers(num_clients)] = 1.0
                cuts = np.floor(np.cumsum(weights)[:-1] * len(rows)).astype(np.int64)
                cuts = np.clip(cuts, 0, len(rows))  # cumsum may overshoot 1 by rounding
                # rows[cuts[i-1]:cuts[i]] go to client i (cuts are non-decreasing).
                chunk_sizes = np.diff(cuts, prepend=0, append=len(rows))
                shuffled.append(rows)
                owners.append(np.repeat(np.arange(num_clients), chunk_sizes))
            owner = np.concatenate(owners)
            sizes = np.bincount(owner, minlength=num_clients)
            smallest = int(sizes.min())
            if smallest >= self.min_size:
                by_client = np.concatenate(shuffled)[np.argsort(owner, kind="stable")]
                return [np.sort(part) for part in np.split(by_client, np.cumsum(sizes)[:-1])]
        raise PartitionError(
            "partition.min_size",
            f"dirichlet_class: after {self.max_retries} draws with α={self.alpha} some client "
            f"still had fewer than min_size={self.min_size} rows (smallest in the last draw: "
            f"{smallest}; num_clients={num_clients}, dataset of {n} rows, mean "
            f"{n / num_clients:.1f} per client); lower min_size, raise α, or use fewer clients",
        )


@dataclass(frozen=True)
class ShardsPartitioner(Partitioner):
    """McMahan et al.'s pathological non-IID split: sort by label, cut into shards, deal k each.

    Rows are shuffled, stably sorted by label, and cut into ``num_clients·k`` contiguous shards;
    a random permutation deals each client k shards. Shard sizes are chosen so that client sizes
    are ⌊n/M⌋ or ⌊n/M⌋+1 (each client's size split into k near-equal shards, laid along the sorted
    order in a random client order), so shards differ by at most one row.

    Straddling: a shard is a contiguous run of the label-sorted rows, so one that crosses a class
    boundary holds two (or, when a class is smaller than a shard, more) classes, and its client
    may then see more than k classes. Only when every class boundary falls on a shard boundary
    (e.g. equal classes whose size is a multiple of the shard size) does each client see at most
    k classes. A client can also draw two shards of one class and see fewer than k.
    """

    classes_per_client: int = 2
    method = "shards"

    def __post_init__(self) -> None:
        if self.classes_per_client < 1:
            raise ValueError(f"classes_per_client must be >= 1, got {self.classes_per_client}")

    def split(self, data, num_clients, rng):
        n, k = len(data), self.classes_per_client
        _check_clients(num_clients, n, self.method)
        if num_clients * k > n:
            raise PartitionError(
                "partition.classes_per_client",
                f"shards: num_clients={num_clients} × classes_per_client={k} = "
                f"{num_clients * k} shards but the dataset has only {n} rows; "
                "lower classes_per_client or use fewer clients",
            )
        shuffled = rng.permutation(n)
        order = shuffled[np.argsort(data.y[shuffled], kind="stable")]
        client_sizes = np.full(num_clients, n // num_clients)
        client_sizes[: n % num_clients] += 1
        # Shard j of client i has size client_sizes[i]//k (+1 for the first client_sizes[i] % k).
        shard_sizes = np.repeat(client_sizes // k, k).reshape(num_clients, k)
        shard_sizes += np.arange(k)[None, :] < (client_sizes % k)[:, None]
        owner = np.repeat(np.arange(num_clients), k)
        deal = rng.permutation(num_clients * k)  # position along the sorted order of each shard
        sizes = shard_sizes.reshape(-1)[deal]
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for position, shard in enumerate(deal):
            parts[owner[shard]].append(order[bounds[position] : bounds[position + 1]])
        return [np.sort(np.concatenate(chunks)) for chunks in parts]


@dataclass(frozen=True)
class SingleLabelSkew(Partitioner):
    """DP-SCAFFOLD's FEMNIST and MNIST split (spec 004 §4): γ of each user's rows i.i.d., the
    rest from one label.

    User u gets n rows (``samples_per_client``, default ⌊N/M⌋): ⌊(1 − γ)·n⌋ drawn without
    replacement from label u mod K, then the rest uniformly from every row still unassigned.
    γ = 0 is one label per user, γ = 1 is i.i.d. Rows never repeat; a label that runs out raises
    ValueError naming the sizes (lower n or γ, or use fewer users).
    """

    iid_fraction: float
    samples_per_client: int | None = None
    method = "label_skew"

    def __post_init__(self) -> None:
        if not 0.0 <= self.iid_fraction <= 1.0:
            raise ValueError(f"iid_fraction γ must be in [0, 1], got {self.iid_fraction}")

    def split(self, data, num_clients, rng):
        n = self.samples_per_client or len(data) // num_clients
        _check_clients(num_clients, len(data), self.method)
        if n * num_clients > len(data):
            raise PartitionError(
                "partition.samples_per_client",
                f"label_skew: {num_clients} users × {n} rows > {len(data)} rows",
            )
        classes, labels = np.unique(data.y, return_inverse=True)
        pools = [rng.permutation(np.flatnonzero(labels == c)).tolist() for c in range(len(classes))]
        skewed = int((1.0 - self.iid_fraction) * n)
        taken = np.zeros(len(data), dtype=bool)
        parts = []
        for user in range(num_clients):
            pool = pools[user % len(classes)]
            if len(pool) < skewed:
                raise PartitionError(
                    "partition.samples_per_client",
                    f"label_skew: label {classes[user % len(classes)]} has {len(pool)} rows left "
                    f"for user {user}, which needs {skewed}; lower samples_per_client or raise "
                    "iid_fraction",
                )
            rows = [pool.pop() for _ in range(skewed)]
            taken[rows] = True
            parts.append(rows)
        free = rng.permutation(np.flatnonzero(~taken))
        start = 0
        for user in range(num_clients):
            extra = n - skewed
            parts[user] = np.sort(np.concatenate([parts[user], free[start : start + extra]]))
            start += extra
        return [part.astype(np.int64) for part in parts]


def make_partitioner(
    method: str,
    alpha: float | None = None,
    min_size: int = 10,
    classes_per_client: int = 2,
    samples_per_client: int | None = None,
    iid_fraction: float | None = None,
) -> Partitioner:
    """The partitioner named ``method``; ``alpha`` is required by the two Dirichlet methods,
    ``min_size`` is used by ``dirichlet_class``, ``samples_per_client`` by ``dirichlet`` and
    ``classes_per_client`` by ``shards``."""
    if method == "natural":
        return NaturalPartitioner()
    if method == "iid":
        return IIDPartitioner()
    if method in ("dirichlet", "dirichlet_class"):
        if alpha is None:
            raise ValueError(f"partition method {method!r} needs alpha (e.g. 0.3)")
        if method == "dirichlet":
            return DirichletClientPrior(float(alpha), samples_per_client)
        return DirichletPerClass(alpha=float(alpha), min_size=int(min_size))
    if method == "shards":
        return ShardsPartitioner(classes_per_client=int(classes_per_client))
    if method == "label_skew":
        if iid_fraction is None:
            raise ValueError("partition method 'label_skew' needs iid_fraction γ (e.g. 0.1)")
        return SingleLabelSkew(float(iid_fraction), samples_per_client)
    raise ValueError(f"unknown partition method {method!r}; known: {', '.join(PARTITION_METHODS)}")


PARTITION_METHODS = ("natural", "iid", "dirichlet", "dirichlet_class", "shards", "label_skew")


def client_class_counts(y: np.ndarray, offsets: np.ndarray, num_classes: int) -> np.ndarray:
    """int64[clients, classes]: the class histogram of each client's labels
    ``y[offsets[i]:offsets[i + 1]]`` (labels in 0..K-1)."""
    y = np.asarray(y, dtype=np.int64)
    num_clients = len(offsets) - 1
    owner = np.repeat(np.arange(num_clients, dtype=np.int64), np.diff(offsets))
    bad = (y < 0) | (y >= num_classes)
    if bad.any():
        raise ValueError(f"client {owner[bad.argmax()]} has labels outside 0..{num_classes - 1}")
    counts = np.bincount(owner * num_classes + y, minlength=num_clients * num_classes)
    return counts.reshape(num_clients, num_classes).astype(np.int64, copy=False)


def largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Non-negative integers summing to ``total`` proportional to integer ``weights``.

    Hamilton's method in exact integer arithmetic: each entry gets ⌊total·w/Σw⌋, and the
    shortfall goes one each to the largest remainders (ties to the lowest index).
    """
    weights = np.asarray(weights, dtype=np.int64)
    if np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError("largest_remainder needs non-negative weights with a positive sum")
    scaled = weights * int(total)
    counts, remainders = np.divmod(scaled, weights.sum())
    shortfall = int(total) - int(counts.sum())
    counts[np.argsort(-remainders, kind="stable")[:shortfall]] += 1
    return counts


def matched_test_split(
    test_y: np.ndarray,
    client_class_counts: np.ndarray,
    per_client: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Per-client test sets with each client's training label mix (DP-FedSAM's evaluation).

    Client i gets ``per_client`` row indices into ``test_y`` whose class counts are
    ``largest_remainder(client_class_counts[i], per_client)``; rows of each class are drawn
    uniformly without replacement, so a client never sees a test row twice. The clients share one
    test set, so a row may appear in several clients' sets (the sets are not disjoint). Labels in
    ``test_y`` must be the column indices of ``client_class_counts`` (0..K-1). Raises ValueError
    for a client with no training rows (no mix to match) or when a class has fewer test rows
    than one client needs (lower ``per_client``).
    """
    test_y = np.asarray(test_y)
    counts = np.asarray(client_class_counts, dtype=np.int64)
    if counts.ndim != 2:
        raise ValueError(f"client_class_counts must be (clients, classes), got {counts.shape}")
    if per_client < 0:
        raise ValueError(f"per_client must be >= 0, got {per_client}")
    num_classes = counts.shape[1]
    if len(test_y) and (test_y.min() < 0 or test_y.max() >= num_classes):
        raise ValueError(f"test labels must lie in 0..{num_classes - 1}")
    pools = [np.flatnonzero(test_y == c) for c in range(num_classes)]
    available = np.array([len(p) for p in pools])
    sets = []
    for client, row in enumerate(counts):
        if row.sum() == 0:
            raise PartitionError(
                "test_per_client", f"client {client} has no training rows: no label mix to match"
            )
        want = largest_remainder(row, per_client)
        short = np.flatnonzero(want > available)
        if len(short):
            c = int(short[0])
            raise PartitionError(
                "test_per_client",
                f"client {client} needs {want[c]} test rows of class {c} but the test set has "
                f"{available[c]}; lower per_client (now {per_client})",
            )
        picks = [rng.choice(pools[c], size=int(want[c]), replace=False) for c in range(num_classes)]
        sets.append(np.sort(np.concatenate(picks)).astype(np.int64))
    return sets
