"""Checks of what a valid config points at, before any work: the files a run reads, the services
it talks to and the place its checkpoints go.

``validate`` (cluster.config) checks the config against itself; ``preflight`` checks it against
the world. Each failure is a ``ConfigError`` (or a ``SourceMissingError`` with the command that
fetches the files) naming the field or variable, the value and the fix. Nothing here writes a
local file, creates a directory or starts Ray; the network checks are one TCP connect each, and
for an object-store location (``s3://``) one request more (``datasets.locations.check_access``)
and, where a run will write (``checkpoint.dir``, an unbuilt store's root), a small probe object
written and deleted under the prefix (``datasets.locations.check_writable``).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

from cluster.config import ConfigError, DataConfig, ExperimentConfig
from cluster.config.paths import location_error
from cluster.config.runtime import ray_endpoint
from cluster.tracking.process import sqlite_path, tracking_uri
from datasets import locations
from datasets.locations import Location, LocationError, ObjectLocation
from datasets.preparation import split_preparation
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
        field, address = ray_address(config)
        check_ray_address(field, address)
        if address in (None, "local"):  # an embedded Ray on this machine
            check_machine_fits(config)
    elif config.executor.gpus_per_actor > 0:  # the local hosts share this machine's GPU
        check_machine_fits(config)
    check_writable_location("checkpoint.dir", config.checkpoint_dir)


def check_data(config: ExperimentConfig) -> None:
    """``data.store`` opens and is intact; else the store the config keys is intact if built,
    or its root can take it and the raw files it would be built from are there (or can be
    downloaded into a writable ``data.root``)."""
    from datasets.sources import existing_store_path
    from datasets.vision import SOURCE_NAMES

    d = config.data
    location = d.store
    if location is None:
        root = d.resolved_store_root()
        check_object_store("data.store_root", root)
        try:
            built = existing_store_path(root, *config.store_parameters)
        except OSError as error:  # e.g. a name longer than the filesystem allows
            raise _unusable("data.store_root", root, error) from None
        if built is None:  # built on first use, under the root
            check_writable_location("data.store_root", root)
            if d.source in SOURCE_NAMES:
                _check_raw_files(config)
            elif d.source == "synthetic":
                check_synthetic_fits(config)
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
    ``data.validation.clients``, the held-out ones too: ``DataConfig.partitioned_clients``)."""
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


def check_synthetic_fits(config: ExperimentConfig) -> None:
    """The synthetic data fits this machine's memory while it is generated: the float32 rows,
    one float64 block of users and one user's logits (``datasets.synthetic``)."""
    from datasets.synthetic import CHUNK_USERS

    d, s = config.data, config.data.synthetic
    rows = d.num_clients * s.samples_per_user
    need = (
        rows * (4 * s.num_features + 8)
        + min(d.num_clients, CHUNK_USERS) * s.samples_per_user * s.num_features * 8
        + s.samples_per_user * s.num_classes * 8
    )
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(
            "data.synthetic",
            f"{d.num_clients} users × {s.samples_per_user} samples × {s.num_features} features, "
            f"{s.num_classes} classes",
            f"generating it needs about {need / 2**30:.3g} GiB, this machine has "
            f"{have / 2**30:.3g} GiB: lower data.num_clients or data.synthetic's "
            "samples_per_user, num_features or num_classes",
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


def check_tracking_uri() -> None:
    """``MLFLOW_TRACKING_URI`` names a store this project can track runs in: a well-formed URI;
    an SQLite file that is, or can be created as, an SQLite database in a writable directory
    (its 16-byte header read, MLflow never imported); a server or database that answers (one
    TCP connect); a directory (MLflow's file store) only where ``MLFLOW_ALLOW_FILE_STORE``
    opts into it, as MLflow itself requires; never Databricks (``_check_databricks``)."""
    uri = tracking_uri()
    try:
        where = urlsplit(uri)
        # MLflow reads a bare "databricks" as the Databricks store of the default profile.
        scheme = "databricks" if uri == "databricks" else where.scheme.split("+")[0]
        port = where.port if scheme in _DEFAULT_PORTS else None  # a non-number raises here
    except ValueError as error:
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            uri,
            f"not a valid URI ({error}); e.g. http://127.0.0.1:5000 or sqlite:///mlflow.db "
            "(unset it for the local default)",
        ) from None
    if scheme not in _MLFLOW_SCHEMES:
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            uri,
            f"MLflow has no {scheme!r} store; use sqlite:///mlflow.db or http://HOST:PORT of an "
            "`mlflow server` (unset it for the local default)",
        )
    if scheme in ("", "file"):
        _check_file_store(uri, Path(where.path if scheme else uri))
    elif scheme == "sqlite":
        _check_sqlite_store(uri)
    elif scheme == "databricks":
        _check_databricks(uri)
    elif scheme in _DEFAULT_PORTS:
        _connect_or_fail(
            "MLFLOW_TRACKING_URI",
            uri,
            where.hostname or "localhost",
            port or _DEFAULT_PORTS[scheme],
            "start the server (`uv run mlflow server --port 5000 ...`) or unset "
            "MLFLOW_TRACKING_URI for the local SQLite store",
        )


_SQLITE_HEADER = b"SQLite format 3\x00"
_SQLITE_FIX = "point it at an MLflow SQLite file or a new one in a writable directory"


def _check_sqlite_store(uri: str) -> None:
    """The database file exists as an SQLite database we may write, or can be created; its
    directory is writable (SQLite writes its journal beside it)."""
    database = sqlite_path(uri)
    if database is None or not database.parent.is_dir():
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            uri,
            "the SQLite file's directory does not exist; sqlite:///relative.db or "
            "sqlite:////absolute/path.db (four slashes) in an existing directory",
        )
    problem = _sqlite_file_problem(database)
    if problem is None and not os.access(database.parent, os.W_OK | os.X_OK):
        problem = f"its directory {database.parent} is not writable"
    if problem is not None:
        raise ConfigError("MLFLOW_TRACKING_URI", uri, f"{database} {problem}; {_SQLITE_FIX}")


def _sqlite_file_problem(database: Path) -> str | None:
    """Why an existing ``database`` cannot be the store (None: it can, or it does not exist)."""
    if not database.exists():
        return None
    if database.is_dir():
        return "is a directory"
    if not database.is_file():
        return "is not a regular file"
    try:
        with database.open("rb") as f:
            header = f.read(len(_SQLITE_HEADER))
    except OSError as error:
        return f"is not readable ({error.strerror})"
    if header and header != _SQLITE_HEADER:  # an empty file is a new database to SQLite
        return "is not an SQLite database (it lacks the 'SQLite format 3' header)"
    if not os.access(database, os.R_OK | os.W_OK):
        return "is not writable"
    return None


def _check_file_store(uri: str, directory: Path) -> None:
    """MLflow 3 refuses its file store (a directory of runs) unless ``MLFLOW_ALLOW_FILE_STORE``
    is true; where it is, the directory must be creatable and writable."""
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            uri,
            "a directory is MLflow's file store, which MLflow 3 refuses (maintenance mode); use "
            "sqlite:///mlflow.db (`uv run mlflow migrate-filestore` moves runs kept there), or "
            "set MLFLOW_ALLOW_FILE_STORE=true to use the directory anyway",
        )
    check_writable_dir("MLFLOW_TRACKING_URI", directory)


def _check_databricks(uri: str) -> None:
    """Databricks is refused: it names experiments by workspace path (``/Users/<you>/<name>``;
    a bare name is INVALID_PARAMETER_VALUE), which ``tracking.experiment``, one file name, can
    never be, so every run would fail as it opens."""
    raise ConfigError(
        "MLFLOW_TRACKING_URI",
        uri,
        "Databricks is not supported: it needs experiment names that are workspace paths "
        "(/Users/<you>/<name>) and tracking.experiment is one file name; track to an `mlflow "
        "server` (http://HOST:PORT) or sqlite:///mlflow.db",
    )


def ray_address(config: ExperimentConfig) -> tuple[str, str | None]:
    """The address ``ray.init`` connects to, and where it comes from: ``executor.address``,
    unless that is unset or ``auto`` and ``RAY_ADDRESS`` is set (Ray's own precedence)."""
    given = config.executor.address
    environment = os.environ.get("RAY_ADDRESS")
    if environment and given in (None, "auto"):
        return "RAY_ADDRESS", environment
    return "executor.address", given


def check_ray_address(field: str, address: str | None) -> None:
    """A Ray address (``ray_address``) is well formed and answers on its port; ``auto`` finds
    a cluster on this machine. Nothing to check for none or ``local`` (an embedded Ray)."""
    if address in (None, "local"):
        return
    endpoint = ray_endpoint(field, address)
    if endpoint is None:  # auto
        address = _running_cluster(field)
        endpoint = ray_endpoint(field, address)
    _connect_or_fail(
        field,
        address,
        *endpoint,
        "start the cluster (`ray start --head`), check RAY_ADDRESS, or remove the address to "
        "run on an embedded Ray",
    )


def _running_cluster(field: str) -> str:
    """What Ray 2.60 resolves ``auto`` to (``ray._private.services``): the address the last
    ``ray start`` left in ``ray_current_cluster`` under Ray's temporary directory, else that
    of a raylet running on this machine. Nothing is started or connected to."""
    from ray._private.services import get_ray_address_from_environment

    try:
        return get_ray_address_from_environment("auto", None)
    except ConnectionError:
        raise ConfigError(
            field,
            "auto",
            "no Ray cluster runs on this machine for auto to find; start one with `ray start "
            "--head`, give HOST:PORT of a cluster, or leave executor.address and RAY_ADDRESS "
            "unset for an embedded Ray",
        ) from None


def check_machine_fits(config: ExperimentConfig) -> None:
    """An embedded Ray gets this machine's CPUs and GPUs: the actor pool must fit in them
    (``ray_runtime.check_resources`` checks a cluster's, once connected)."""
    from cluster.runtime.ray_runtime import resource_shortfall

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


def check_object_store(field: str, location: Location) -> None:
    """For an object-store ``location``: credentials, its endpoint and its bucket are there
    (``locations.check_access``); nothing to check for a local path."""
    if isinstance(location, ObjectLocation):
        try:
            locations.check_access(location)
        except LocationError as error:
            raise location_error(field, str(location), error) from None


def check_writable_location(field: str, location: Location) -> None:
    """A local directory that can be written (``check_writable_dir``), or an object-store
    prefix whose bucket can be reached (``check_object_store``) and under which these
    credentials may write and delete (``locations.check_writable``: a probe object, written
    and deleted with the same short timeouts)."""
    if not isinstance(location, ObjectLocation):
        check_writable_dir(field, location)
        return
    check_object_store(field, location)
    try:
        locations.check_writable(location)
    except LocationError as error:
        raise location_error(field, str(location), error) from None


def check_writable_dir(field: str, path: Path) -> None:
    """``path`` is, or can be created as, a directory this process may write (nothing created),
    on a filesystem that holds files (``refuse_pseudo_filesystem``)."""
    refuse_pseudo_filesystem(field, path)
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as error:  # e.g. a name longer than the filesystem allows
        raise _unusable(field, path, error) from None
    if not existing.is_dir():
        raise ConfigError(
            field, str(path), f"{existing} is a file, not a directory; choose another directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(field, str(path), f"{existing} is not writable; choose another directory")


def _unusable(field: str, path: Path, error: OSError) -> ConfigError:
    return ConfigError(field, str(path), f"unusable ({error.strerror}); choose another directory")


# Kernel pseudo-filesystems: os.access calls /proc writable for root, yet no file can be created
# there. The roots are refused by name too (where /proc/self/mounts does not exist, and /dev
# may be a tmpfs in a container).
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")
PSEUDO_FILESYSTEMS = frozenset(
    {
        "autofs",
        "binfmt_misc",
        "bpf",
        "cgroup",
        "cgroup2",
        "configfs",
        "debugfs",
        "devpts",
        "devtmpfs",
        "efivarfs",
        "fusectl",
        "hugetlbfs",
        "mqueue",
        "nsfs",
        "proc",
        "pstore",
        "securityfs",
        "selinuxfs",
        "sysfs",
        "tracefs",
    }
)


def refuse_pseudo_filesystem(field: str, path: Path) -> None:
    """A ``ConfigError`` when ``path`` (symlinks resolved) lies under ``PSEUDO_ROOTS`` or on a
    mount of a type in ``PSEUDO_FILESYSTEMS``."""
    real = os.path.realpath(path)
    mount, kind = _mount_of(real)
    root = next((r for r in PSEUDO_ROOTS if _is_within(real, r)), None)
    if root is not None or kind in PSEUDO_FILESYSTEMS:
        where = root or f"{mount} ({kind})"
        raise ConfigError(
            field,
            str(path),
            f"{real} is in {where}, a kernel pseudo-filesystem, not storage; choose a "
            "directory on a disk",
        )


def _mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount ``path`` lies on, from /proc/self/mounts
    (the last of stacked mounts wins); ("", "") where that is unreadable."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return "", ""
    found = ("", "")
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        if _is_within(path, point) and len(point) >= len(found[0]):
            found = (point, fields[2])
    return found


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


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
    from cluster.runtime.checkpoint import checkpoint_path, load_checkpoint
    from cluster.tracking.process import flatten

    path = checkpoint_path(config, None)
    if config.tracking.enabled or not locations.exists(path):
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
