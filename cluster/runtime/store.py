"""The run's shard store: checked before any work (``check_data``), opened or built when the run
starts (``open_store``). Its client sizes are also what a sample-level privacy claim is
computed from (``cluster.claims.calibration``)."""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, fields

import numpy as np

from cluster.config import ConfigError, DataConfig, ExperimentConfig, PartitionConfig
from cluster.config.loading import override_text
from cluster.runtime.memory import check_drawn_rows_fit, check_fits_memory
from cluster.runtime.storage_checks import (
    check_object_store,
    check_writable_dir,
    check_writable_location,
    refuse_pseudo_filesystem,
    unusable,
)
from datasets import locations
from datasets.partition import PartitionError, make_partitioner
from datasets.preparation import split_preparation
from datasets.sources import build_or_open_store
from datasets.store import MANIFEST, ShardStore, StoreError
from datasets.validation import held_out_rows, validation_location, validation_store


def open_store(config: ExperimentConfig) -> tuple[ShardStore, bool]:
    """The run's store: ``data.store`` as given, or built from the config on first use; with
    ``data.validation``, the store derived from it with the validation rows held out
    (``datasets.validation``). A partition, validation split or per-client test set its rows
    cannot give is a ``ConfigError`` (a store is written only after its split is drawn)."""
    d = config.data
    try:
        if d.store is not None:
            store, built = ShardStore.open(d.store), False
            check_store_matches(store, d)
        else:
            store, built = build_or_open_store(
                d.resolved_store_root(),
                *config.store_parameters,
                data_root=d.resolved_data_root(),
                download=d.download,
            )
        if d.validation is not None:
            store = validation_store(store, d.validation.describe(), d.num_clients, config.seed)
        if d.test_per_client:  # every host draws these: a failure here, not in an actor
            store.matched_test_sets(d.test_per_client, config.seed)
    except PartitionError as error:  # bad input that only the data's rows could reveal
        raise _refused_partition(error, d) from None
    return store, built


def _refused_partition(error: PartitionError, d: DataConfig) -> ConfigError:
    """The ``ConfigError`` of ``error`` on its ``data.`` field, saying which store was not
    written."""
    field = f"data.{error.field}"
    value = functools.reduce(getattr, field.split(".")[1:], d)
    kept = {"test_per_client": "", "validation": "; no validation store was written"}.get(
        error.field.split(".")[0], "; no store was written"
    )
    return ConfigError(field, value, f"{error}{kept}")


def check_known_validation_rows(config: ExperimentConfig) -> None:
    """Where every client's training row count is known before any data is made (synthetic
    users, natural partition: round(train_fraction · samples_per_user) each), the
    ``data.validation`` rows or folds are checked on it as ``datasets.validation`` will cut
    them: none left to train on, or none held out, is refused before any store is built."""
    d, s = config.data, config.data.synthetic
    if d.validation is None or d.validation.kind == "clients" or d.store is not None:
        return
    if d.source != "synthetic" or d.partition.method != "natural":
        return
    rows = round(s.train_fraction * s.samples_per_user)
    try:
        held_out_rows(np.array([rows]), d.validation.describe(), config.seed)
    except PartitionError as error:
        raise _refused_partition(error, d) from None


def check_data(config: ExperimentConfig) -> None:
    """``data.store`` opens and is intact; else the store the config keys is intact if built,
    or its root can take it and the raw files it would be built from are there (or can be
    downloaded into a writable ``data.root``). A validation split is checked where the rows
    are known (``check_known_validation_rows``)."""
    from datasets.sources import existing_store_path
    from datasets.vision import SOURCE_NAMES

    check_known_validation_rows(config)
    d = config.data
    location = d.store
    if location is None:
        root = d.resolved_store_root()
        check_object_store("data.store_root", root)
        try:
            built = existing_store_path(root, *config.store_parameters)
        except OSError as error:  # e.g. a name longer than the filesystem allows
            raise unusable("data.store_root", root, error) from None
        if built is None:  # built on first use, under the root
            check_writable_location("data.store_root", root)
            if d.source in SOURCE_NAMES:
                _check_raw_files(config)
            elif d.source == "synthetic":
                check_synthetic_fits(config)
            check_drawn_rows_fit(config)
            return
        location = str(built)
    else:
        check_object_store("data.store", d.store_location())
    try:
        store = ShardStore.open(location)
        store.check()
    except StoreError as error:
        raise unreadable_store(location, error, _rebuild_fix(d)) from None
    check_store_matches(store, d)
    if d.validation is not None:  # its store is written beside this one, unless it is there
        derived = validation_location(store, d.validation.describe(), config.seed)
        if not locations.exists(derived / MANIFEST):
            check_writable_location("data.validation", store.path.parent)


def unreadable_store(location: str, error: StoreError, fix: str) -> ConfigError:
    """The ``ConfigError`` of the store at ``location`` that ``error`` could not read: naming
    ``data.store`` and ``fix`` (restore or rebuild it), or, where its object store refused
    these credentials, the AWS variables (rebuilding would not help)."""
    if not error.denied:
        return ConfigError("data.store", location, f"{error.problem}; {fix}")
    return ConfigError(
        "AWS_ACCESS_KEY_ID",
        os.environ.get("AWS_ACCESS_KEY_ID") or "(unset)",
        f"these credentials may not read the shard store {location} ({error.problem}) at "
        f"{locations.endpoint()}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
        "AWS_PROFILE) to credentials with s3:GetObject on it (for data.store)",
    )


def _check_raw_files(config: ExperimentConfig) -> None:
    """A vision source's files are in ``data.root``, or it can take them (``data.download``)."""
    from datasets.vision import check_present

    root = config.data.resolved_data_root()
    if config.data.download:
        check_writable_dir("data.root", root)
    else:
        refuse_pseudo_filesystem("data.root", root)
        check_present(config.data.source, root, **_source_files_options(config))


def check_store_matches(store: ShardStore, d: DataConfig) -> None:
    """The store holds the configured source and number of clients (with
    ``data.validation.clients``, the held-out ones too: ``DataConfig.partitioned_clients``),
    built with the configured source options and partition (``check_store_options``)."""
    _check_source_and_clients(store, d)
    check_store_options(store, d)


def _check_source_and_clients(store: ShardStore, d: DataConfig) -> None:
    source = store.manifest["source"]["name"]
    if store.num_clients != d.partitioned_clients or source != d.source:
        held_out = d.partitioned_clients - d.num_clients
        clients = (
            f"data.num_clients={store.num_clients}"
            if not held_out
            else f"data.num_clients (+ {held_out} held out by data.validation.clients) to "
            f"{store.num_clients} in all"
        )
        raise ConfigError(
            "data.store",
            store.location,
            f"it holds {store.num_clients} clients of {source!r}; set {clients} and "
            f"data.source={source}",
        )


def check_store_options(store: ShardStore, d: DataConfig) -> None:
    """The config's source options and partition are those its manifest says the store was
    built with: the store's rows are what trains, so a config that says otherwise would record
    data that never ran. (The store's seed drew its rows; the run's ``seed`` seeds the run.)
    A manifest that records no partition (a store not written by ``build_store``, e.g.
    ``benchmarks.gpu``'s random pixels) says nothing to compare: such a store opens as it is."""
    if "partition" not in store.manifest:
        return
    built = {k: v for k, v in store.manifest["source"].items() if k not in ("name", "num_users")}
    wanted = {k: v for k, v in d.source_options().items() if k != "num_users"}
    for name in sorted(built.keys() | wanted.keys()):
        if built.get(name) != wanted.get(name):
            held = built.get(name)
            if name == "statistics_from" and held is None:  # keyed only where not training
                held = "training"
            _refuse_other_store(store, _option_field(d, name), wanted.get(name), held)
    partition = {k: v for k, v in asdict(d.partition).items() if v is not None}
    if make_partitioner(**partition).describe() != store.manifest["partition"]:
        held = {k: v for k, v in store.manifest["partition"].items() if k in _PARTITION_FIELDS}
        _refuse_other_store(store, "data.partition", partition, held)


_PARTITION_FIELDS = {f.name for f in fields(PartitionConfig)}


def _option_field(d: DataConfig, option: str) -> str:
    """The config field a source option of ``DataConfig.source_options`` comes from."""
    if d.source == "synthetic" and option != "statistics_from":
        return f"data.synthetic.{option}"
    return "data.pretrained" if option == "tokenizer" else f"data.{option}"


def _refuse_other_store(store: ShardStore, field: str, value: object, built: object) -> None:
    raise ConfigError(
        field,
        value,
        f"the store {store.location} (data.store) was built with {built!r}, and its rows are "
        f"what would train; set {field}={override_text(built)} to match it, or remove "
        "data.store to build a store from this config",
    )


def check_synthetic_fits(config: ExperimentConfig) -> None:
    """The synthetic data fits this machine's memory while it is generated
    (``datasets.synthetic``): the float32 rows, one float64 block of users, and one user's
    three float64 d × k model arrays (mean, noise, weights) and its n × k logits."""
    from datasets.synthetic import CHUNK_USERS

    d, s = config.data, config.data.synthetic
    rows = d.num_clients * s.samples_per_user
    need = (
        rows * (4 * s.num_features + 8)
        + min(d.num_clients, CHUNK_USERS) * s.samples_per_user * s.num_features * 8
        + 3 * s.num_features * s.num_classes * 8
        + s.samples_per_user * s.num_classes * 8
    )
    check_fits_memory(
        "data.synthetic",
        f"{d.num_clients} users × {s.samples_per_user} samples × {s.num_features} features, "
        f"{s.num_classes} classes",
        need,
        "generating it",
        "lower data.num_clients or data.synthetic's samples_per_user, num_features or num_classes",
    )


def _source_files_options(config: ExperimentConfig) -> dict:
    """The options that decide which raw files a vision source reads."""
    options, _ = split_preparation(config.data.source_options())
    options.pop("pca_components", None)
    return options


def _rebuild_fix(d: DataConfig) -> str:
    if d.store is not None:
        return "rebuild it with `uv run python -m cluster partition ...` or remove data.store"
    return "delete that directory and run again: the store is rebuilt from the same parameters"
