"""This machine's memory against the largest arrays a run would allocate at once, checked
before any work: what does not fit is a ``ConfigError`` naming the field, not a ``MemoryError``
(or the kernel's OOM killer) once the run is under way."""

from __future__ import annotations

import math
import os
from pathlib import Path

from cluster.config import ConfigError, ExperimentConfig

# float64 l × m tables the FetchSGD server rule holds at once in a step, at the least
# (``algorithms.fetchsgd.FetchSgdServerRule.step``): the momentum and error it carries, the
# round's noisy mean and the new momentum.
SERVER_SKETCH_TABLES = 4

# A host actor's process holds at least this much memory of its own before any client's data:
# Python, Ray's worker, torch and the project imported. Measured on the 2-core machine (torch's
# CUDA build, CPU actors): 413-419 MB private (``/proc/PID/smaps_rollup``) per host of the
# quickstart on an embedded Ray of 4 actors; 250 MB leaves room for lighter builds.
ACTOR_PROCESS_BYTES = 250 * 2**20


# Where a container's memory limit is read: cgroup v2, then v1. A pod (KubeRay) or container
# limited below its node's memory is killed at its limit, not at the node's.
CGROUP_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def physical_memory() -> int:
    """Bytes of memory this process may use: this machine's physical memory, or its
    container's cgroup limit where that is lower."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([machine, *filter(None, map(cgroup_limit, CGROUP_LIMIT_FILES))])


def cgroup_limit(path: Path) -> int | None:
    """The limit in a cgroup memory file, in bytes; None where there is none ("max", absent
    or unreadable)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def check_fits_memory(
    field: str, value: object, need: int, what: str, fix: str, have: int | None = None
) -> None:
    """A ``ConfigError`` on ``field`` when ``need`` bytes (what ``what`` allocates) exceed this
    machine's memory (``have`` bytes, where the caller read it already)."""
    have = physical_memory() if have is None else have
    if need > have:
        raise ConfigError(
            field,
            value,
            f"{what} needs about {need / 2**30:.3g} GiB, this machine has {have / 2**30:.3g} "
            f"GiB: {fix}",
        )


def check_sketch_fits(config: ExperimentConfig) -> None:
    """A sketching algorithm's server tables (``SERVER_SKETCH_TABLES`` float64 l × m tables)
    fit this machine's memory: the server runs in the driver."""
    from algorithms.fetchsgd import FetchSgdServerRule

    server = config._build_algorithm(1.0).server  # structure only: σ may be uncalibrated yet
    if not isinstance(server, FetchSgdServerRule):
        return
    rows, cols, tables = server.upload.rows, server.upload.cols, SERVER_SKETCH_TABLES
    check_fits_memory(
        "algorithm.sketch_cols",
        cols,
        tables * rows * cols * 8,
        f"holding the server's {tables} float64 sketch tables of {rows} × {cols} counters",
        "lower algorithm.sketch_cols or sketch_rows (DPSFL's defaults: 5 × 500000)",
    )


def check_actor_processes_fit(config: ExperimentConfig) -> None:
    """An embedded Ray's ``executor.num_actors`` host processes fit this machine's memory, at
    ``ACTOR_PROCESS_BYTES`` each (a lower bound: their clients' data and the model come on
    top). A cluster's nodes are not this machine's, and the local executor's hosts are threads
    of the driver."""
    n = config.executor.num_actors
    check_fits_memory(
        "executor.num_actors",
        n,
        n * ACTOR_PROCESS_BYTES,
        f"starting {n} actor processes (each at least {ACTOR_PROCESS_BYTES / 2**20:.0f} MB: "
        "Python, Ray, torch and the project)",
        "lower executor.num_actors (each actor hosts many clients), or give executor.address of "
        "a cluster",
    )


def check_drawn_rows_fit(config: ExperimentConfig) -> None:
    """A ``dirichlet`` partition with ``samples_per_client`` n stores n rows for each of its
    clients, whatever the dataset's size (rows repeat): at one byte a value (uint8 images;
    float features take four) and eight a label, they fit this machine's memory while the
    store is written."""
    from datasets.sources import source_shape

    d = config.data
    n = d.partition.samples_per_client
    if d.partition.method != "dirichlet" or n is None:
        return
    values = math.prod(source_shape(*config.store_parameters[:2])[0])
    check_fits_memory(
        "data.partition.samples_per_client",
        n,
        d.partitioned_clients * n * (values + 8),
        f"storing {d.partitioned_clients} clients × {n} rows of {values} values",
        "lower samples_per_client or data.num_clients",
    )
