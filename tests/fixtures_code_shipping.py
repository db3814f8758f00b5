"""The driver of ``tests/test_code_shipping.py``: a process of its own, started outside the
checkout (so that Ray's workers, which get the driver's working directory on their path, cannot
find the project there), connected to a running head as a run with ``$RAY_ADDRESS`` (and no
``executor.address``) is.

``python -m tests.fixtures_code_shipping REQUEST``: ``REQUEST`` is JSON with the run's overrides
and the file to write the report to (``torch.save`` of a dict of plain
values).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _where_the_host_runs(stand_in) -> dict:
    """Run in a host actor (``__ray_call__``): where its code came from, and its runtime
    environment."""
    import ray

    return {
        "real_class": type(stand_in._real).__name__,
        "module_file": sys.modules["actors.ray_actor"].__file__,
        "runtime_env": dict(ray.get_runtime_context().runtime_env),
    }


def main(request: dict) -> dict:
    import ray

    from actors.code_digest import code_digest
    from cluster.analysis.trials import Trial, run_concurrently
    from cluster.config import load_config
    from cluster.runtime import code_shipping
    from cluster.runtime.central_optimum import central_optimum
    from cluster.runtime.experiment import make_executor, run_experiment
    from cluster.runtime.ray_runtime import connect, disconnect
    from cluster.runtime.store import open_store

    report: dict = {}
    session = connect(None)  # $RAY_ADDRESS names the head
    report["session"] = session.where
    digest = code_shipping.shipped_digest()
    report["published"] = digest
    # The control, in a fresh worker (Ray reuses a task's worker, and one that ran a stand-in
    # has the package on its path): a plain task finds no project.
    finds = ray.remote(lambda: __import__("importlib.util").util.find_spec("actors") is not None)
    report["plain_task_finds_the_project"] = ray.get(finds.remote())
    # A stand-in of a package the GCS lacks (before any worker installed one: a worker runs
    # one package, and Ray reuses a task's worker)
    missing = code_shipping.Shipped(
        ray.remote(code_shipping.code_bootstrap.function_stand_in("0" * 64, "os", "getpid"))
    )
    try:
        ray.get(missing.remote())
        report["missing"] = "ran"
    except ray.exceptions.RayTaskError as error:
        report["missing"] = str(error)
    # The package holds the sources the driver's digest covers: recomputed in a worker, from
    # the unpacked package and the worker's libraries, it is the same.
    report["worker_digest"] = ray.get(code_shipping.remote_function(code_digest).remote())
    outcome = run_experiment(load_config(None, request["overrides"]))
    report["params"] = outcome.result.params
    report["epsilons"] = [r.epsilon for r in outcome.result.history]
    config = load_config(None, request["overrides"])
    store, _ = open_store(config)
    executor = make_executor(config, store)
    report["hosts"] = ray.get(
        [actor.__ray_call__.remote(_where_the_host_runs) for actor in executor.actors]
    )
    report["optimum"] = executor.central_optimum(config.task, 0.0)  # the store optimum's task
    report["optimum_here"] = central_optimum(store, config.task, 0.0)
    executor.close()
    # Three more versions published, of which one is kept where only the newest is kept
    report["index"] = code_shipping._index()  # the driver's own publication, its job alive
    report["job"] = ray.get_runtime_context().get_job_id()
    report["job_alive"] = code_shipping._job_ends().get(report["job"], "unknown") is None
    code_shipping.KEEP_PACKAGES, code_shipping.KEEP_S = 1, 0.0
    code_shipping._job_ends = lambda: {}
    for version in range(3):
        root = Path(request["scratch"]) / f"v{version}"
        (root / "actors").mkdir(parents=True)
        (root / "actors" / "__init__.py").write_text(f"VERSION = {version}\n")
        code_shipping.publish(root)
    report["kept"] = code_shipping.kept_packages()
    code_shipping.publish()  # this checkout's code again, for a trial
    results = []  # a sweep's trial: a task whose run starts host actors in turn
    run_concurrently([Trial("trial", config)], 1, None, lambda result, uri: results.append(result))
    report["trial_error"] = results[0].error
    report["trial_params"] = results[0].outcome.result.params if results[0].outcome else None
    disconnect()
    report["after_disconnect"] = code_shipping.shipped_digest()
    report["driver_digest"] = code_digest()
    return report


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    torch.save(main(request), request["out"])
