"""Checks of what a valid config points at, before any work: the files a run reads, the services
it talks to and the place its checkpoints go.

``validate`` (cluster.config) checks the config against itself; ``preflight`` checks it against
the world. Each failure is a ``ConfigError`` (or a ``SourceMissingError`` with the command that
fetches the files) naming the field or variable, the value and the fix. Nothing here writes a
file, creates a directory or starts Ray; the network checks are one TCP connect each.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from cluster.config import ConfigError, DataConfig, ExperimentConfig
from cluster.tracking_process import sqlite_path, tracking_uri
from datasets.store import ShardStore, StoreError

CONNECT_TIMEOUT_S = 3.0

# Tracking URI schemes MLflow stores a run under (a path without a scheme is a file store).
_MLFLOW_SCHEMES = {
    "",
    "file",
    "sqlite",
    "http",
    "https",
    "databricks",
    "postgresql",
    "mysql",
    "mssql",
}
_DEFAULT_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306}


def preflight(config: ExperimentConfig) -> None:
    """Every check of the outside world a run can fail before it starts (see the module doc).
    The command line also refuses to overwrite an earlier run's checkpoint
    (``check_no_checkpoint_overwritten``); programs that call ``run_experiment`` own their
    checkpoint directories."""
    check_data(config)
    if config.tracking.enabled:
        check_tracking_uri()
    if config.executor.kind == "ray":
        address = config.executor.address or os.environ.get("RAY_ADDRESS")
        check_ray_address(address)
        if not address:
            check_machine_fits(config)
    elif config.executor.gpus_per_actor > 0:  # the local hosts share this machine's GPU
        check_machine_fits(config)
    check_writable_dir("checkpoint.dir", config.checkpoint_dir)


def check_data(config: ExperimentConfig) -> None:
    """``data.store`` opens and is intact; else the store the config keys (if built) is intact,
    or the raw files it would be built from are there."""
    from datasets.sources import existing_store_path
    from datasets.vision import SOURCE_NAMES, check_present

    d = config.data
    location = d.store
    if location is None:
        root = d.resolved_store_root()
        if root.exists() and not root.is_dir():
            raise ConfigError(
                "data.store_root", str(root), "is a file, not a directory; point it elsewhere"
            )
        built = existing_store_path(root, *config.store_parameters)
        if built is None:
            if d.source in SOURCE_NAMES and not d.download:
                check_present(d.source, d.resolved_data_root(), **_source_files_options(config))
            return
        location = str(built)
    try:
        store = ShardStore.open(location)
        store.check()
    except StoreError as error:
        raise ConfigError("data.store", location, f"{error.problem}; {_rebuild_fix(d)}") from None
    check_store_matches(store, d)


def check_store_matches(store: ShardStore, d: DataConfig) -> None:
    """The store holds the configured source and number of clients."""
    source = store.manifest["source"]["name"]
    if store.num_clients != d.num_clients or source != d.source:
        raise ConfigError(
            "data.store",
            store.location,
            f"it holds {store.num_clients} clients of {source!r}; set "
            f"data.num_clients={store.num_clients} and data.source={source}",
        )


def _source_files_options(config: ExperimentConfig) -> dict:
    """The options that decide which raw files a vision source reads."""
    options = config.data.source_options()
    options.pop("pca_components", None)
    return options


def _rebuild_fix(d: DataConfig) -> str:
    if d.store is not None:
        return "rebuild it with `uv run python -m cluster partition ...` or remove data.store"
    return "delete that directory and run again: the store is rebuilt from the same parameters"


def check_tracking_uri() -> None:
    """``MLFLOW_TRACKING_URI`` names a store MLflow can use and, for a server, one that answers."""
    uri = tracking_uri()
    scheme = urlsplit(uri).scheme.split("+")[0]
    if scheme not in _MLFLOW_SCHEMES:
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            uri,
            f"MLflow has no {scheme!r} store; use sqlite:///mlflow.db, a directory, or "
            "http://HOST:PORT of an `mlflow server` (unset it for the local default)",
        )
    if scheme == "sqlite":
        database = sqlite_path(uri)
        if database is None or not database.parent.is_dir():
            raise ConfigError(
                "MLFLOW_TRACKING_URI",
                uri,
                "the SQLite file's directory does not exist; sqlite:///relative.db or "
                "sqlite:////absolute/path.db (four slashes) in an existing directory",
            )
    if scheme in _DEFAULT_PORTS:
        where = urlsplit(uri)
        _connect_or_fail(
            "MLFLOW_TRACKING_URI",
            uri,
            where.hostname or "localhost",
            where.port or _DEFAULT_PORTS[scheme],
            "start the server (`uv run mlflow server --port 5000 ...`) or unset "
            "MLFLOW_TRACKING_URI for the local SQLite store",
        )


def check_ray_address(address: str | None) -> None:
    """A given Ray address (``executor.address`` or ``RAY_ADDRESS``) answers on its port."""
    if not address or address in ("auto", "local"):
        return
    where = urlsplit(address if "://" in address else f"ray://{address}")
    if where.port is None:
        raise ConfigError(
            "executor.address",
            address,
            "give HOST:PORT of the head's GCS (ray start --head prints it, e.g. 10.0.0.1:6379), "
            "ray://HOST:10001, or remove it for an embedded Ray",
        )
    _connect_or_fail(
        "executor.address",
        address,
        where.hostname or "localhost",
        where.port,
        "start the cluster (`ray start --head`), check RAY_ADDRESS, or remove the address to "
        "run on an embedded Ray",
    )


def check_machine_fits(config: ExperimentConfig) -> None:
    """An embedded Ray gets this machine's CPUs and GPUs: the actor pool must fit in them
    (``ray_runtime.check_resources`` checks a cluster's, once connected)."""
    from cluster.ray_runtime import resource_shortfall

    e = config.executor
    machine = {"CPU": _cpu_count(), "GPU": _gpu_count()}
    short = resource_shortfall(e.num_actors, e.cpus_per_actor, e.gpus_per_actor, machine)
    if short is not None:
        field, need, resource, have = short
        raise ConfigError(
            f"executor.{field}",
            getattr(e, field),
            f"{e.num_actors} actors need {need:g} {resource}s, this machine has {have:g}: lower "
            f"executor.num_actors or executor.{field}, or give executor.address of a larger "
            "cluster",
        )


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def check_writable_dir(field: str, path: Path) -> None:
    """``path`` is, or can be created as, a directory this process may write (nothing created)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(
            field, str(path), f"{existing} is a file, not a directory; choose another directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(field, str(path), f"{existing} is not writable; choose another directory")


def _connect_or_fail(field: str, value: str, host: str, port: int, fix: str) -> None:
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return
    except OSError as error:
        reason = f"nothing answers at {host}:{port} ({error.strerror or error})"
        raise ConfigError(field, value, f"{reason}; {fix}") from None


def check_no_checkpoint_overwritten(config: ExperimentConfig) -> None:
    """An untracked run's checkpoint is named by experiment, preset and seed: refuse to overwrite
    one left by an earlier run (it may hold hundreds of rounds), or any other file there (read
    as a checkpoint is read: no code in it runs). Tracked runs are named by their MLflow run
    and never collide."""
    from cluster.checkpoint import checkpoint_path, load_checkpoint
    from cluster.tracking_process import flatten

    path = checkpoint_path(config, None)
    if config.tracking.enabled or not path.exists():
        return
    keep = (
        "move it away, or set checkpoint.dir (or tracking.enabled: true, which names "
        "checkpoints by run)"
    )
    try:
        stored = flatten(load_checkpoint(path)["config"])
    except ConfigError as error:
        raise ConfigError(
            "checkpoint.dir",
            str(path),
            f"holds a file this code does not read as a checkpoint ({error.fix}), which this "
            f"run would overwrite: {keep}",
        ) from None
    ours = flatten(config.to_dict())
    differs = sorted(k for k in stored.keys() | ours.keys() if stored.get(k) != ours.get(k))
    what = f"of another run (its {differs[0]} differs)" if differs else "of an earlier run"
    raise ConfigError(
        "checkpoint.dir",
        str(path),
        f"holds a checkpoint {what}, which this run would overwrite: continue it with `uv run "
        f"python -m cluster resume {path}`, {keep}",
    )
