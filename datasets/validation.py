"""Validation data held out of a store's training rows (``data.validation``).

A run with ``data.validation`` trains on a store *derived* from its base store: the same test
set, the training rows that remain, and the held-out rows as a third table
(``validation.arrow``, ``datasets.store``). Everything downstream (the hosts, the record rate
s = B/n of sample-level accounting, the partition report) therefore sees only the rows that
remain. The derived store sits beside its base, keyed by the base's checksums, the options and
the seed, and is written once (like the base: the same parameters reuse it).

Which rows are held out, from ``SeedSequence([seed, 0x7A1D])`` (deterministic, the same in
every process):

- ``fraction`` f: each client's rows in a seeded order, the first round(f·n) of its n held out
  (round half up); the rest, in their stored order, stay its training rows.
- ``folds`` k, ``fold`` j: each client's rows in the same seeded order (it does not depend on
  j), cut into k near-equal parts (``numpy.array_split``); part j held out. The k folds of a
  client partition its rows.
- ``clients`` f: the base store was partitioned into N + H clients, H = round(f·N)
  (``DataConfig.partitioned_clients``); a seeded choice of H of them is held out whole, the
  other N (in their order) are the training clients, numbered 0..N−1.

A client left without a training row by ``fraction`` or ``folds`` is refused, and so are
options that hold out no row at all (``PartitionError``, which the run reports as a
``ConfigError`` on that field).
"""

from __future__ import annotations

import numpy as np

from datasets import locations
from datasets.arrays import LabeledArrays
from datasets.partition import PartitionError
from datasets.sources import store_key
from datasets.store import MANIFEST, ShardStore, write_store

SEED_TAG = 0x7A1D
# Manifest fields that the derived store's own writing computes again.
COMPUTED = (
    "format_version",
    "num_clients",
    "num_classes",
    "x_shape",
    "x_dtype",
    "num_train",
    "num_test",
    "num_validation",
    "checksums",
    "layout",
)


def validation_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), SEED_TAG]))


def held_out_rows(sizes: np.ndarray, spec: dict, seed: int) -> list[np.ndarray]:
    """Per client, the sorted indices (into its own rows) held out by ``fraction`` or
    ``folds``/``fold``; ``PartitionError`` where a client would keep no training row."""
    rng, sizes = validation_rng(seed), np.asarray(sizes)
    field = "validation.fraction" if "fraction" in spec else "validation.folds"
    held = []
    for client, size in enumerate(sizes.tolist()):
        order = rng.permutation(size)
        if "fraction" in spec:
            chosen = order[: int(np.floor(spec["fraction"] * size + 0.5))]
        else:
            chosen = np.array_split(order, spec["folds"])[spec["fold"]]
        if size and len(chosen) == size:
            raise PartitionError(
                field,
                f"client {client} has {size} training row(s) and {spec} holds out all of them, "
                "leaving it none to train on; lower data.validation.fraction (or folds), or "
                "hold out clients instead (data.validation.clients)",
            )
        held.append(np.sort(chosen))
    if sizes.size and not any(len(rows) for rows in held):
        raise PartitionError(field, _none_held_out(spec, int(sizes.max())))
    return held


def _none_held_out(spec: dict, largest: int) -> str:
    """Why ``spec`` holds out no row of clients of at most ``largest`` rows, and the fix."""
    if "fraction" in spec:
        return (
            f"{spec} holds out round(fraction·n) = 0 rows of every client (the largest has "
            f"{largest}), so nothing is left to validate on; raise data.validation.fraction "
            f"to at least 1/{largest} = {1 / largest:.3g}"
        )
    return (
        f"{spec} holds out no row: fold {spec['fold']} of every client's rows is empty (the "
        f"largest client has {largest}); lower data.validation.folds to at most {largest} and "
        "keep fold below it"
    )


def held_out_clients(num_partitioned: int, spec: dict, num_clients: int, seed: int) -> np.ndarray:
    """The sorted ids of the H = num_partitioned − num_clients clients held out whole."""
    held = num_partitioned - num_clients
    if held < 1:
        raise PartitionError(
            "validation.clients",
            f"the store holds {num_partitioned} clients, none beyond the {num_clients} training "
            "ones to hold out; build it with data.validation.clients set",
        )
    return np.sort(validation_rng(seed).choice(num_partitioned, held, replace=False))


def split_store(
    base: ShardStore, spec: dict, num_clients: int, seed: int
) -> tuple[LabeledArrays, list[np.ndarray], LabeledArrays]:
    """(training rows in client order, each training client's indices into them, held-out
    rows) of ``base`` under the validation options ``spec``."""
    rows = base.train_rows()
    offsets = base.offsets
    sizes = base.client_sizes
    if "clients" in spec:
        held = held_out_clients(base.num_clients, spec, num_clients, seed)
        kept = np.setdiff1d(np.arange(base.num_clients), held)
        train_parts = [np.arange(offsets[c], offsets[c + 1]) for c in kept]
        held_parts = [np.arange(offsets[c], offsets[c + 1]) for c in held]
        groups = np.repeat(np.arange(len(held)), sizes[held])
    else:
        chosen = held_out_rows(sizes, spec, seed)
        train_parts, held_parts = [], []
        for client, picked in enumerate(chosen):
            own = np.arange(offsets[client], offsets[client + 1])
            held_parts.append(own[picked])
            train_parts.append(np.delete(own, picked))
        groups = np.repeat(np.arange(base.num_clients), [len(p) for p in held_parts])
    train_index = np.concatenate(train_parts) if train_parts else np.empty(0, dtype=np.int64)
    held_index = np.concatenate(held_parts) if held_parts else np.empty(0, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum([len(p) for p in train_parts])])
    clients = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    train = LabeledArrays(rows.x[train_index], rows.y[train_index])
    validation = LabeledArrays(rows.x[held_index], rows.y[held_index], groups)
    return train, clients, validation


def _validation_description(base: ShardStore, spec: dict, seed: int) -> dict:
    return {**spec, "seed": int(seed), "base": base.path.name}


def validation_location(base: ShardStore, spec: dict, seed: int) -> locations.Location:
    """Where ``validation_store`` keeps the store derived from ``base``: beside it, keyed by
    its checksums and the split."""
    validation = _validation_description(base, spec, seed)
    key = store_key({"base": base.manifest["checksums"], "validation": validation})
    return base.path.parent / f"{base.path.name}-validation-{key}"


def validation_store(base: ShardStore, spec: dict, num_clients: int, seed: int) -> ShardStore:
    """The store derived from ``base`` with ``spec``'s rows held out (module docstring),
    opened if it was written before, else written beside ``base`` first."""
    description = {k: v for k, v in base.manifest.items() if k not in COMPUTED}
    description["validation"] = _validation_description(base, spec, seed)
    location = validation_location(base, spec, seed)
    if locations.exists(location / MANIFEST):
        return ShardStore.open(location)
    train, clients, validation = split_store(base, spec, num_clients, seed)
    test = base.test_rows()
    return write_store(
        location,
        train,
        LabeledArrays(test.x, test.y),
        clients,
        base.manifest["num_classes"],
        description,
        validation,
    )
