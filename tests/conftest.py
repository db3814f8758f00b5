import pytest
import torch

import cluster  # noqa: F401  (before any test imports Ray: no uv-run worker environments)

# Fixtures shared by several test modules, kept in modules of their own.
pytest_plugins = ["tests.fixtures_s3", "tests.fixtures_ray_cluster"]

# The test models are tiny: intra-op threads only add contention on a 2-core CI machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def store_root(tmp_path_factory):
    """One shard-store root for the session, so equal data parameters reuse one store."""
    return tmp_path_factory.mktemp("shards")
