"""``executor:``, ``checkpoint:``, ``tracking:``: where and how a run executes (never what it
computes: a resumed run may change these)."""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from actors.code_digest import PROJECT_ROOT
from cluster.config.errors import ConfigError
from cluster.config.paths import configured_path, resolve
from datasets.locations import Location

RESTART_TIMEOUT_VARIABLE = "DPFL_RESTART_TIMEOUT_S"
DEFAULT_RESTART_TIMEOUT_S = 120.0


def restart_timeout_s() -> float:
    """How long lost actors may take to be running again, somewhere: ``$DPFL_RESTART_TIMEOUT_S``
    (unset or empty: 120 s; an autoscaling cluster may need minutes to add a node; inf: wait
    for good). A ``ConfigError`` unless it is a number of seconds > 0 (NaN is not one)."""
    text = os.environ.get(RESTART_TIMEOUT_VARIABLE) or ""
    if not text:
        return DEFAULT_RESTART_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # NaN too; inf: wait for good
        raise ConfigError(
            RESTART_TIMEOUT_VARIABLE,
            text,
            "must be a number of seconds > 0 (e.g. 600 where nodes are added on demand, inf to "
            f"wait for good); unset it for {DEFAULT_RESTART_TIMEOUT_S:g}",
        )
    return value


@dataclass
class ExecutorConfig:
    kind: Literal["local", "ray"] = "ray"
    num_actors: int = 2
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    address: str | None = None  # Ray address; None = $RAY_ADDRESS or an embedded Ray
    # Where Ray puts the actors: pack = Ray's default (fill a node before the next), spread =
    # one per node in turn (Ray's SPREAD strategy: cluster.runtime.ray_executor.actor_options).
    # Never changes what is computed: results are bit-identical either way.
    placement: Literal["pack", "spread"] = "pack"
    # Train each actor's clients of a round as vmapped batches where that is the same
    # computation (algorithms/vectorized.py): true wherever possible; auto where it is also
    # faster (on a GPU; on the CPU for models without convolutions); false never (one client at
    # a time, bit-identical across actor layouts). Vectorised is equal to sequential up to float
    # rounding, which for convolutions depends on how many clients share a batch.
    vectorize: Literal["auto", True, False] = "auto"
    # 2-D convolutions on NHWC views (algorithms.local.ModelObjective). auto, for both: the
    # fixed table of actors/kernel_table.py by model and device type (recorded in the MLflow
    # run as kernels.*), never a timing at run time.
    channels_last: Literal["auto", True, False] = "auto"
    # bf16: the model's forward and backward under bf16 autocast (tensor cores on a GPU); the
    # parameters, the update, its clip and its noise stay float32, so the sensitivity and the
    # noise scale are those of float32. Opt-in: the trained weights differ by bf16's rounding.
    precision: Literal["float32", "bf16"] = "float32"
    # On a running Ray (executor.address, or a Ray job): keep the actors this many idle
    # seconds after the run, for the next run with the same code and executor settings, which
    # then skips their process start and imports (cluster/runtime/warm_pool.py). 0: none.
    keep_warm_s: float = 0.0
    # With an embedded Ray and CPU actors: the first rounds run in this process, on hosts given
    # the same clients as the actors (bit-identical rounds), while Ray and its actors start;
    # the actors take over once they answer (cluster/runtime/overlapped_start.py). auto: where
    # the clients' data, held twice meanwhile, takes at most a quarter of this machine's
    # memory; true: also beyond; false: the first round waits for the actors.
    overlap_start: Literal["auto", True, False] = "auto"


JOB_CONFIG_VARIABLE = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def in_ray_job() -> bool:
    """Launched by ``ray job submit``: Ray hands the entrypoint its job config in this variable."""
    return JOB_CONFIG_VARIABLE in os.environ


def job_carries_code() -> bool:
    """A Ray job whose runtime environment gave this process the project (``ray job submit
    --working-dir .`` from the checkout, or the packages as ``py_modules``): the job's workers
    get it the same way. A job whose working_dir is something else (a folder of configs,
    say) while the project comes from an installed copy, or from a subfolder of the
    working_dir, which the workers do not have on their path, is not: the code is shipped as
    for any driver (``ray_connection``)."""
    try:
        environment = json.loads(os.environ.get(JOB_CONFIG_VARIABLE, "{}")).get("runtime_env")
    except (ValueError, AttributeError):  # Ray itself refuses such a job config
        return False
    return (
        isinstance(environment, dict)
        and bool(environment.get("working_dir") or environment.get("py_modules"))
        and unpacked_by_ray(PROJECT_ROOT)
    )


def unpacked_by_ray(root: Path) -> bool:
    """``root`` is a package Ray's runtime environment unpacked for a job's working_dir or one
    of its py_modules (``<session>/runtime_resources/{working_dir,py_modules}_files/<package>``,
    Ray's layout since 1.x): the root on its workers' path too."""
    return root.parent.name in ("working_dir_files", "py_modules_files") and (
        root.parent.parent.name == "runtime_resources"
    )


RayConnection = Literal["embedded", "client", "job", "cluster"]


def effective_ray_address(address: str | None) -> str | None:
    """What Ray connects to: ``address``, or ``$RAY_ADDRESS`` where it is unset or ``auto``
    (Ray's own precedence)."""
    if address in (None, "auto"):
        return os.environ.get("RAY_ADDRESS") or address
    return address


def ray_connection(address: str | None) -> RayConnection:
    """How ``ray_runtime.connect(address)`` joins Ray: ``embedded``, a Ray of its own (no
    address, or ``local``); ``client``, Ray Client (``ray://``: the code as a job working_dir);
    ``job``, a cluster from inside a Ray job whose runtime environment carries the code;
    ``cluster``, any other running Ray, to which the code is shipped through its GCS
    (``cluster.runtime.code_shipping``). The one rule for connecting, the preflight checks
    and the options that depend on where the actors run."""
    effective = effective_ray_address(address)
    if effective in (None, "local"):
        return "embedded"
    if effective.startswith("ray://"):
        return "client"
    return "job" if job_carries_code() else "cluster"


@dataclass
class CheckpointConfig:
    every: int = 10  # rounds between checkpoints; 0 = only at the end
    # $DPFL_CHECKPOINT_DIR, else this; relative: to the working directory, or in a Ray job to
    # the store root (a job's working directory is a temporary copy, deleted with the job)
    dir: str = "checkpoints"

    def resolved_dir(self, store_root: Location) -> Location:
        path = self.configured_path()
        if not path.is_absolute() and in_ray_job():
            path = store_root / path
        return resolve("checkpoint.dir", path)

    def configured_path(self) -> Location:
        return configured_path("checkpoint.dir", "DPFL_CHECKPOINT_DIR", self.dir, True)


@dataclass
class TrackingConfig:
    enabled: bool = True
    experiment: str = "dpfl"
    run_name: str | None = None


# ----------------------------------------------------------------------------- checks


NAME_MAX_BYTES = 100


def check_name(path: str, name: str) -> None:
    """A name that becomes a file or directory name (the untracked checkpoint's file, MLflow's
    artifact directory) must be exactly one, so that it stays in the directory meant for it:
    refused (never rewritten) when ``_name_problem`` finds one."""
    problem = _name_problem(name)
    if problem is not None:
        raise ConfigError(
            path,
            name,
            f"{problem}; it names files, so it must be one file name: printable characters "
            f"other than / and \\, not . or .., at most {NAME_MAX_BYTES} bytes (e.g. "
            "mnist-dp-sweep)",
        )


def _name_problem(name: str) -> str | None:
    """Empty; a ``/`` or ``\\``; ``.`` or ``..``; a character ``str.isprintable`` refuses (NUL,
    control and format characters, separators other than the space); over ``NAME_MAX_BYTES``
    bytes in UTF-8 (file names are limited in bytes)."""
    if not name:
        return "is empty"
    if "/" in name or "\\" in name:
        return "contains a path separator"
    if name in (".", ".."):
        return "is a relative directory"
    if not name.isprintable():
        return "contains a control or other non-printable character"
    if len(name.encode()) > NAME_MAX_BYTES:
        return f"is longer than {NAME_MAX_BYTES} bytes in UTF-8"
    return None


RAY_ADDRESS_FORMS = (
    "HOST:PORT of the head's GCS (e.g. 10.0.0.1:6379, [::1]:6379), ray://HOST:PORT of a Ray "
    "Client server (e.g. ray://10.0.0.1:10001), auto (the cluster `ray start` runs on this "
    "machine) or local (a new embedded Ray)"
)
_HOST_PORT = re.compile(r"(?:ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


def starts_embedded_ray(e: ExecutorConfig) -> bool:
    """Whether the run starts a Ray of its own (``ray_connection``: ``kind: ray`` with no
    address, or ``local``, from ``executor.address`` or ``$RAY_ADDRESS``). Only such a Ray is
    known to have nodes on this machine alone: a loopback address may be a port-forward to a
    cluster, or a head that other machines' nodes joined on another interface."""
    return e.kind == "ray" and ray_connection(e.address) == "embedded"


def ray_endpoint(path: str, address: str) -> tuple[str, int] | None:
    """The (host, port) a Ray address connects to; None for ``auto`` and ``local``, which Ray
    resolves itself. A malformed address is a ``ConfigError`` listing ``RAY_ADDRESS_FORMS``."""
    if address in ("auto", "local"):
        return None
    match = _HOST_PORT.fullmatch(address)
    host, port = (match.group(1), int(match.group(2))) if match else ("", 0)
    if host.startswith("["):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            host = ""
    if not host or not 1 <= port <= 65535:
        raise ConfigError(
            path,
            address,
            f"not a Ray address; give {RAY_ADDRESS_FORMS}, or leave executor.address and "
            "RAY_ADDRESS unset for an embedded Ray",
        )
    return host, port
