"""The embedded Ray that ``python -m cluster run`` starts when no cluster is named."""

import pytest


def test_the_embedded_ray_retries_its_object_store_connection_every_100_ms():
    """Its raylet connects to its own object store right after starting it; a first attempt
    that finds the store not yet listening waited Ray's default 1 s (``ray.init`` 2.4 or 3.4 s
    on 2 cores). The embedded instance is started with 100 ms retries, as many attempts more:
    what the GCS hands every process of the cluster."""
    ray = pytest.importorskip("ray")
    from cluster.ray_runtime import EMBEDDED_SYSTEM_CONFIG, connect

    if ray.is_initialized():
        ray.shutdown()
    try:
        assert connect(None).embedded
        config = ray._private.state.state.get_system_config()
        assert {key: config.get(key) for key in EMBEDDED_SYSTEM_CONFIG} == EMBEDDED_SYSTEM_CONFIG
        timeout = EMBEDDED_SYSTEM_CONFIG["raylet_client_connect_timeout_milliseconds"]
        attempts = EMBEDDED_SYSTEM_CONFIG["raylet_client_num_connect_attempts"]
        assert timeout * attempts == 1000 * 10  # Ray's default patience: 10 attempts × 1 s
    finally:
        ray.shutdown()
