import logging
import shutil

import pytest
import torch

import cluster  # noqa: F401  (before any test imports Ray: no uv-run worker environments)

# Fixtures shared by several test modules, kept in modules of their own.
pytest_plugins = ["tests.fixtures_s3", "tests.fixtures_ray_cluster", "tests.fixtures_k8s"]

# The test models are tiny: intra-op threads only add contention on a 2-core CI machine.
torch.set_num_threads(1)

# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2 --dist loadgroup). The
# modules that start Ray (an embedded one, a cluster, a head) run one after the other on one
# worker: two Rays at once on 2 cores would each wait on the other's process starts, and some of
# these tests bound how long a start or a recovery may take. Every other test goes to
# whichever worker is free.
RAY_MODULES = {
    "test_code_shipping",
    "test_equivalence",
    "test_executors",
    "test_exposure",
    "test_interrupt_phases",
    "test_interrupts",
    "test_multinode",
    "test_multinode_object_store",
    "test_object_store",
    "test_overlapped_start",
    "test_ray_job",
    "test_ray_runtime",
    "test_recovery",
    "test_startup_benchmark",
    "test_warm_pool",
    "test_workloads",
}


# Before pytest-xdist's own hook, which renames a grouped test ``…@ray`` on a worker: run after
# it, the mark comes too late and the Ray modules spread over both workers.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def store_root(tmp_path_factory):
    """One shard-store root for the session, so equal data parameters reuse one store."""
    return tmp_path_factory.mktemp("shards")


@pytest.fixture(scope="session")
def _mlflow_schema(tmp_path_factory):
    """An empty MLflow SQLite store, created once: a new store spends ≈ 4.5 s of CPU on MLflow's
    schema migrations (each test's tracking process would run them again)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-schema") / "mlflow.db"
    logger = logging.getLogger("mlflow")  # quiet: its INFO lines would land in a test's stderr
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        MlflowClient(f"sqlite:///{path}").search_experiments()
    finally:
        logger.setLevel(level)
    return path


@pytest.fixture(scope="session")
def sqlite_store(_mlflow_schema):
    """``sqlite_store(path)``: a copy of the empty store at ``path`` (what MLflow would create
    there); its tracking URI. For tests where the store is incidental: tests about creating a
    store (quietly, or not at all) use a path with nothing there."""

    def make(path) -> str:
        shutil.copyfile(_mlflow_schema, path)
        return f"sqlite:///{path}"

    return make
