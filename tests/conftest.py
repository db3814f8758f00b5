import logging
import shutil

import pytest
import torch

import cluster  # noqa: F401  (before any test imports Ray: no uv-run worker environments)

# Fixtures shared by several test modules, kept in modules of their own.
pytest_plugins = ["tests.fixtures_s3", "tests.fixtures_ray_cluster", "tests.fixtures_k8s"]

# The test models are tiny: intra-op threads only add contention on a 2-core CI machine.
torch.set_num_threads(1)


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
