"""Checks of what a valid config points at, before any work: the files a run reads, the services
it talks to and the place its checkpoints go.

``validate`` (cluster.config) checks the config against itself; ``preflight`` checks it against
the world. Each failure is a ``ConfigError`` (or a ``SourceMissingError`` with the command that
fetches the files) naming the field or variable, the value and the fix. Nothing here writes a
local file, creates a directory or starts Ray; the network checks are one TCP connect each (for
a PostgreSQL tracking store, one login more: ``_check_postgres_login``), and
for an object-store location (``s3://``) one request more (``datasets.locations.check_access``)
and, where a run will write (``checkpoint.dir``, an unbuilt store's root), a small probe object
written and deleted under the prefix (``datasets.locations.check_writable``).
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from cluster.config import ConfigError, ExperimentConfig
from cluster.config.runtime import (
    effective_ray_address,
    in_ray_job,
    ray_endpoint,
    restart_timeout_s,
    starts_embedded_ray,
)
from cluster.redaction import redact_credentials
from cluster.runtime.memory import check_actor_processes_fit, check_sketch_fits
from cluster.runtime.storage_checks import check_writable_dir, check_writable_location
from cluster.runtime.store import check_data
from cluster.tracking.settings import sqlite_path, tracking_uri
from datasets import locations

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
    check_sketch_fits(config)
    if config.tracking.enabled:
        check_tracking_uri()
    if config.executor.kind == "ray":
        restart_timeout_s()
        check_ray_address(*ray_address(config))
        if starts_embedded_ray(config.executor):  # a Ray on this machine alone
            check_machine_fits(config)
            check_actor_processes_fit(config)
    else:
        check_host_threads(config)
        if config.executor.gpus_per_actor > 0:  # the local hosts share this machine's GPU
            check_machine_fits(config)
    check_writable_location("checkpoint.dir", config.checkpoint_dir)


def check_tracking_uri() -> None:
    """``MLFLOW_TRACKING_URI`` names a store this project can track runs in: a well-formed URI;
    an SQLite file that is, or can be created as, an SQLite database in a writable directory
    (its 16-byte header read, MLflow never imported); a server or database that answers (one
    TCP connect), and takes the login where it is PostgreSQL; a directory (MLflow's file store)
    only where ``MLFLOW_ALLOW_FILE_STORE`` opts into it, as MLflow itself requires; never
    Databricks (``_check_databricks``)."""
    uri = tracking_uri()
    if _password_read_as_address(uri):
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            uri,
            "it holds an @ after a / or a second @: a password or token with / or @ is read as "
            "the path, host or port: percent-encode them (%2F, %40; an @ of the path too), or "
            "give the password in PGPASSWORD or MLFLOW_TRACKING_PASSWORD",
        )
    try:
        where = urlsplit(uri)
        # MLflow reads a bare "databricks" as the Databricks store of the default profile.
        scheme = "databricks" if uri == "databricks" else where.scheme.split("+")[0]
        port = where.port if scheme in _DEFAULT_PORTS else None  # a non-number raises here
    except ValueError as error:
        # The parser's reason may quote part of a password ("a/b@host" splits it as a port)
        why = error if redact_credentials(uri) == uri else "a password or token holds / or @"
        raise ConfigError(
            "MLFLOW_TRACKING_URI",
            uri,
            f"not a valid URI ({why}); e.g. http://127.0.0.1:5000 or sqlite:///mlflow.db "
            "(unset it for the local default; percent-encode a password's / and @)",
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
    if scheme == "postgresql":
        _check_postgres_login(uri)


# libpq's words for a login refused for its password: the server's (a wrong one), the client's
# (none given where the server asks for one).
_PASSWORD_REFUSED = ("password authentication failed", "no password supplied")


def _password_read_as_address(uri: str) -> bool:
    """Whether a network URI's user information, up to the last ``@`` of its authority and
    path, holds a ``/`` or an ``@``: the parser then reads part of the password as the host,
    the port or the path (``http://admin:1234/x@host``: a host ``admin``, port 1234)."""
    scheme, separator, rest = uri.partition("://")
    if not separator or scheme.split("+")[0] not in _DEFAULT_PORTS or "@" not in rest:
        return False
    userinfo = rest.split("?")[0].rpartition("@")[0]
    return "/" in userinfo or "@" in userinfo


def _check_postgres_login(uri: str) -> None:
    """The PostgreSQL database at ``uri`` takes the login: one connection through psycopg, with
    the password libpq finds (the URI's, else ``PGPASSWORD``, as k8s/ gives it to MLflow). A
    refused password fails here, in one paragraph: in the tracking process MLflow would retry
    the connection for ≈ 100 s (``mlflow.store.db.utils.create_sqlalchemy_engine_with_retry``),
    and the run's opening would be given up at ``OPEN_WAIT_S`` as a store that did not answer.
    Any other failure is left to MLflow (a server still starting may come up as it
    retries)."""
    import psycopg  # only for a PostgreSQL store: ≈ 0.2 s of imports

    where = urlsplit(uri)
    conninfo = where._replace(scheme="postgresql").geturl()  # "postgresql+psycopg": libpq's
    try:
        with psycopg.connect(conninfo, connect_timeout=math.ceil(CONNECT_TIMEOUT_S)):
            return
    except psycopg.Error as error:
        reason = " ".join(str(error).split())
    if not any(words in reason for words in _PASSWORD_REFUSED):
        return
    raise ConfigError(
        "MLFLOW_TRACKING_URI",
        uri,
        f"PostgreSQL refused the login ({reason}); set PGPASSWORD to the password of the "
        "URI's database user (libpq reads it, so it is in no URI or log line)",
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
    effective = effective_ray_address(given)
    return ("executor.address" if effective == given else "RAY_ADDRESS"), effective


def check_ray_address(field: str, address: str | None) -> None:
    """A Ray address (``ray_address``) is well formed and answers on its port; ``auto`` finds
    a cluster on this machine. Nothing to check for none or ``local`` (an embedded Ray),
    except that inside a Ray job an embedded Ray cannot start its workers: Ray gives every
    ``ray.init`` in a job the job's runtime environment, whose working_dir lives in the job's
    cluster, not in the new one (its workers fail to set it up)."""
    if address in (None, "local") and in_ray_job():
        raise ConfigError(
            field,
            address,
            "inside a Ray job a second, embedded Ray cannot start workers (Ray hands it the "
            "job's runtime environment, which only the job's cluster holds): leave "
            "executor.address and RAY_ADDRESS unset to run on the job's cluster, or run "
            "outside `ray job submit` for an embedded Ray",
        )
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
    if e.gpus_per_actor > 0:
        check_gpu_precision(e.precision)


def check_gpu_precision(precision: str) -> None:
    """This machine's first GPU (the hosts' device type) runs ``executor.precision``
    (``precision_unsupported``: bf16 needs NVIDIA Ampere or later)."""
    import torch

    from algorithms.local import precision_unsupported

    why = precision_unsupported(precision, torch.device("cuda", 0))
    if why is not None:
        raise ConfigError("executor.precision", precision, why)


def check_host_threads(config: ExperimentConfig) -> None:
    """The local executor's hosts run on this machine at ``int(cpus_per_actor)`` torch threads
    each (``make_executor``): more than its CPUs only oversubscribes it. The hosts together
    may hold more than its CPUs (they take turns where a model has dropout, and a Ray trial
    reserves the CPUs: ``trials``)."""
    e, cpus = config.executor, _cpu_count()
    if int(e.cpus_per_actor) > cpus:
        raise ConfigError(
            "executor.cpus_per_actor",
            e.cpus_per_actor,
            f"the local executor's hosts each run {int(e.cpus_per_actor)} torch threads, this "
            f"machine has {cpus} CPUs: lower executor.cpus_per_actor to at most {cpus}, or set "
            "executor.kind=ray with executor.address of a larger cluster",
        )


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


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
    from cluster.runtime.checkpoint import checkpoint_path, load_checkpoint, resume_command
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
        f"holds a checkpoint {what}, which this run would overwrite: continue it with "
        f"`{resume_command(path)}`, {keep}",
    )
