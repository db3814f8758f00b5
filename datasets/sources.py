"""Data sources and the one entry point that turns (source, partition, seed) into a shard store.

A store is keyed by a hash of everything that determines its content, so a second run with the
same parameters reuses it and a run with other parameters never reads a stale one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from datasets import locations
from datasets.arrays import LabeledArrays
from datasets.glue import GLUE_NUM_CLASSES, GLUE_SOURCES, load_glue
from datasets.locations import Location
from datasets.partition import make_partitioner
from datasets.preparation import fitted_split, split_preparation
from datasets.store import FORMAT_VERSION, MANIFEST, ShardStore, write_store
from datasets.synthetic import SyntheticSpec, generate_synthetic
from datasets.vision import SOURCE_NAMES, image_shape, load_source, num_classes

SOURCES = ("synthetic", *SOURCE_NAMES, *GLUE_SOURCES)


def _load(
    source: str,
    params: dict,
    seed: int,
    data_root: str | Path | None,
    download: bool,
    statistics_from: str = "training",
):
    """(train, test, number of classes) of a source; vision and GLUE sources read
    ``data_root`` (GLUE's options: ``tokenizer``, a folder inside it, and ``max_length``); a
    PCA is fitted to the split ``statistics_from`` names (``preparation.fitted_split``)."""
    if source == "synthetic":
        spec = SyntheticSpec(**params)
        train, test = generate_synthetic(spec, seed, statistics_from)
        return train, test, spec.num_classes
    if data_root is None and source in SOURCES:
        raise ValueError(f"source {source!r} reads files: give a data root")
    if source in GLUE_SOURCES:
        return (*load_glue(source, Path(data_root), **params), GLUE_NUM_CLASSES)
    if source in SOURCE_NAMES:
        params = dict(params)
        components = params.pop("pca_components", None)
        train, test = load_source(source, data_root, download=download, **params)
        if components:
            train, test = pca_features(train, test, components, statistics_from)
        return train, test, num_classes(source, **params)
    raise ValueError(f"unknown data source {source!r}; known: {', '.join(SOURCES)}")


def source_shape(source: str, params: dict) -> tuple[tuple[int, ...], int]:
    """(shape of a row, number of classes) of what ``_load`` returns for ``source`` with these
    options, known without reading or generating any data (the model is built for it)."""
    params, _ = split_preparation(params)
    if source == "synthetic":
        spec = SyntheticSpec(**params)
        return (spec.num_features,), spec.num_classes
    if source in GLUE_SOURCES:
        return (params["max_length"],), GLUE_NUM_CLASSES
    components = params.pop("pca_components", None)
    return ((components,) if components else image_shape(source)), num_classes(source, **params)


def pca_features(
    train: LabeledArrays, test: LabeledArrays, components: int, statistics_from: str = "training"
):
    """Both splits projected on the top ``components`` principal directions of the pixels (in
    [0, 1], centred on their mean) of one split, ``preparation.fitted_split``: the training
    split (DP-SCAFFOLD's non-private MNIST preprocessing) or the source's test split (public
    data). Features are float32."""
    fitted = fitted_split(train, test, statistics_from)
    pixels = fitted.x.reshape(len(fitted.x), -1).astype(np.float64) / 255.0
    if not 0 < components <= pixels.shape[1]:
        raise ValueError(f"pca_components must be in [1, {pixels.shape[1]}], got {components}")
    mean = pixels.mean(axis=0)
    _, _, vt = np.linalg.svd(pixels - mean, full_matrices=False)
    basis = vt[:components].T

    def project(split: LabeledArrays) -> LabeledArrays:
        flat = split.x.reshape(len(split.x), -1).astype(np.float64) / 255.0
        return LabeledArrays(((flat - mean) @ basis).astype(np.float32), split.y, split.group)

    return project(train), project(test)


def store_key(description: dict) -> str:
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def build_store(
    path: str | Location,
    source: str,
    source_params: dict,
    partition: dict,
    num_clients: int,
    seed: int,
    data_root: str | Path | None = None,
    download: bool = False,
) -> ShardStore:
    """Load a source, partition its training split and write the store at ``path``.

    The partition is drawn from ``SeedSequence([seed, 0xDA7A])``; the manifest records the
    source and its options, the partitioner's ``describe()``, the seed and the store format.
    The source options in ``datasets.preparation.PREPARATION_OPTIONS`` run around the
    partition (subsample, standardise, hold out each client's test rows).
    """
    description = _description(source, source_params, partition, num_clients, seed)
    params, preparation = split_preparation(source_params)
    train, test, classes = _load(
        source, params, seed, data_root, download, preparation.statistics_from
    )
    train, test = preparation.before_partition(train, test, seed)
    partitioner = make_partitioner(**{k: v for k, v in partition.items() if v is not None})
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xDA7A]))
    clients = partitioner.split(train, num_clients, rng)
    test, clients = preparation.after_partition(train, test, clients, seed)
    description["partition"] = partitioner.describe()
    location = locations.parse_location(path)
    return write_store(location, train, test, clients, classes, description)


def _description(
    source: str, source_params: dict, partition: dict, num_clients: int, seed: int
) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "source": {"name": source, **source_params},
        # Unset options are not part of the identity: adding an option keeps existing keys.
        "partition": {k: v for k, v in partition.items() if v is not None},
        "num_clients": int(num_clients),
        "seed": int(seed),
    }


def build_or_open_store(
    root: str | Location,
    source: str,
    source_params: dict,
    partition: dict,
    num_clients: int,
    seed: int,
    **loading,
) -> tuple[ShardStore, bool]:
    """Open the store for these parameters under ``root``, building it first if absent.

    ``loading`` (``data_root``, ``download``) is passed to ``build_store`` when it builds.

    ``source_params`` are the source's options (synthetic generator parameters; ``split`` for
    EMNIST, ``only_digits`` for FEMNIST); they, the partition, the seed and the store format
    key the store. Where the raw files live (``data_root``) does not.
    Returns ``(store, built)``; ``built`` is False when an existing store was reused.
    """
    args = (source, source_params, partition, num_clients, seed)
    root = locations.parse_location(root)
    existing = existing_store_path(root, *args)
    if existing is not None:
        return ShardStore.open(existing), False
    return build_store(store_path(root, *args), *args, **loading), True


def store_path(
    root: Location, source: str, source_params: dict, partition: dict, num_clients: int, seed: int
) -> Location:
    """Where the store of these parameters lives under ``root`` (a directory or an object-store
    prefix), built or not."""
    key = store_key(_description(source, source_params, partition, num_clients, seed))
    return root / f"{source}-{key}"


def existing_store_path(root: Location, *args) -> Location | None:
    """``store_path(root, *args)`` if a store was committed there (its manifest, written last,
    is there), else None."""
    path = store_path(root, *args)
    return path if locations.exists(path / MANIFEST) else None
