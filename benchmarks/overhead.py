"""Framework overhead on the quickstart workload: plain PyTorch vs LocalExecutor vs Ray.

Runs configs/quickstart.yaml (DP-FedAvg, synthetic(1, 1), 100 clients, cohort 20, 10 local
steps of batch 32, clip + server Gaussian noise) for ``--rounds`` rounds four ways:

* ``plain_torch``: one process, the same math written directly with ``nn.Linear`` +
  ``torch.optim.SGD`` (only the shard store, the cohort sampler and the stream generators,
  ``algorithms.rng.torch_generator``, come from the project). It draws model init,
  mini-batches and server noise from the same seeded streams as the project, so its final
  parameters should match the executors' up to float rounding.
* ``local_executor``: ``Simulation`` + ``LocalExecutor``.
* ``ray_1_actor`` / ``ray_2_actors``: ``Simulation`` + ``RayExecutor`` on an embedded Ray
  (``ray.init(address="local")``, shut down between variants). Ray start-up and actor creation
  are reported in ``setup_seconds`` and excluded from the round timings.

No MLflow: ``Simulation`` is driven directly (``run_experiment`` is what tracks). Afterwards a
few micro-benchmarks isolate where the per-round time goes (local step paths, per-client
overhead, the RDP accountant, evaluation, torch intra-op threads).

Usage (from the repository root)::

    uv run python -m benchmarks.overhead [--rounds N] [--out PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from algorithms.rng import Purpose, stream_seed, torch_generator
from benchmarks.overhead_micro import microbench
from cluster.config import ExperimentConfig, load_config
from cluster.runtime.cohort import sample_cohort
from cluster.runtime.store import open_store

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "overhead.json"
# Ray reads this raylet config from the environment; the lower-case part is significant.
WORKER_NICENESS_ENV = "RAY_worker_niceness"
VARIANTS = ("plain_torch", "local_executor", "ray_1_actor", "ray_2_actors")


def _load() -> tuple[float, float]:
    try:
        one, five, _ = os.getloadavg()
        return round(one, 2), round(five, 2)
    except OSError:
        return (math.nan, math.nan)


def _is_eval_round(config: ExperimentConfig, round_index: int) -> bool:
    return (round_index + 1) % config.eval_every == 0 or round_index + 1 == config.rounds


def summarize(
    round_seconds: list[float], cohort_sizes: list[int], setup_seconds: float, **extra
) -> dict:
    """Timing summary; round 1 is warm-up and excluded from mean/median and clients/s."""
    timed = round_seconds[1:] if len(round_seconds) > 1 else round_seconds
    timed_clients = cohort_sizes[1:] if len(cohort_sizes) > 1 else cohort_sizes
    return {
        "setup_seconds": setup_seconds,
        "first_round_seconds": round_seconds[0],
        "seconds_per_round_mean": statistics.fmean(timed),
        "seconds_per_round_median": statistics.median(timed),
        "seconds_per_round_min": min(timed),
        "seconds_per_round_max": max(timed),
        "clients_per_second": sum(timed_clients) / sum(timed),
        "timed_rounds": len(timed),
        "round_seconds": round_seconds,
        **extra,
    }


# ----------------------------------------------------------------------------- (a) plain torch


def run_plain(config: ExperimentConfig, store) -> dict:
    """DP-FedAvg written directly: copy model → SGD → delta → clip → sum → noise → mean."""
    a, local = config.algorithm, config.algorithm.local
    assert a.name == "dp_fedavg" and a.noise_placement == "server" and local.momentum == 0
    assert local.local_steps is not None and local.weight_decay == 0
    start = time.perf_counter()
    train = []
    for cid in range(store.num_clients):
        arrays = store.client(cid)
        train.append((torch.tensor(arrays.x).flatten(1), torch.tensor(arrays.y)))
    test = store.test_rows()
    x_test, y_test = torch.tensor(test.x).flatten(1), torch.tensor(test.y)
    in_features, num_classes = x_test.shape[1], store.manifest["num_classes"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(config.seed, Purpose.MODEL_INIT))
        model = nn.Linear(in_features, num_classes)
    setup = time.perf_counter() - start

    m = float(config.cohort.size)
    clip = a.clip_norm
    noise_std = a.noise_multiplier * clip if a.noise_multiplier > 0 else 0.0  # σ=0 with C=inf
    round_seconds, cohort_sizes, evals = [], [], []
    for r in range(config.rounds):
        t0 = time.perf_counter()
        cohort = sample_cohort(
            config.cohort.sampling, config.data.num_clients, config.cohort.size, config.seed, r
        )
        global_vec = nn.utils.parameters_to_vector(model.parameters()).detach()
        total = torch.zeros_like(global_vec, dtype=torch.float64)
        for cid in cohort.tolist():
            x, y = train[cid]
            n = len(y)
            size = min(local.batch_size, n)
            g = torch_generator(config.seed, r, cid, Purpose.LOCAL_TRAINING)
            client = copy.deepcopy(model)
            opt = torch.optim.SGD(client.parameters(), lr=local.lr)
            steps = 0
            while steps < local.local_steps:  # fresh permutation per epoch, as in local.py
                perm = torch.randperm(n, generator=g)
                for lo in range(0, n, size):
                    if steps == local.local_steps:
                        break
                    idx = perm[lo : lo + size]
                    opt.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(client(x[idx]), y[idx]).backward()
                    opt.step()
                    steps += 1
            delta = nn.utils.parameters_to_vector(client.parameters()).detach() - global_vec
            norm = float(delta.norm())
            if norm > clip:
                delta = delta * (clip / norm)
            total += delta
        noise = torch.randn(
            total.shape,
            generator=torch_generator(config.seed, r, Purpose.SERVER_NOISE),
            dtype=torch.float64,
        )
        mean = (total + noise_std * noise if noise_std > 0 else total) / m
        new = (global_vec.double() + a.server_lr * mean).to(global_vec.dtype)
        nn.utils.vector_to_parameters(new, model.parameters())
        if _is_eval_round(config, r):
            with torch.no_grad():
                logits = model(x_test)
                acc = float((logits.argmax(1) == y_test).float().mean())
                loss = float(nn.functional.cross_entropy(logits, y_test))
            evals.append({"round": r + 1, "test_accuracy": acc, "test_loss": loss})
        round_seconds.append(time.perf_counter() - t0)
        cohort_sizes.append(len(cohort))
    params = nn.utils.parameters_to_vector(model.parameters()).detach()
    return summarize(
        round_seconds,
        cohort_sizes,
        setup,
        final_test_accuracy=evals[-1]["test_accuracy"],
        final_test_loss=evals[-1]["test_loss"],
        evals=evals,
        _params=params,
    )


# ----------------------------------------------------------------------------- (b-d) Simulation


def run_simulation(config: ExperimentConfig, store, executor, setup: float, **extra) -> dict:
    from cluster.runtime.simulation import Simulation

    t0 = time.perf_counter()
    sim = Simulation(config, store, executor)
    setup += time.perf_counter() - t0
    round_seconds, cohort_sizes = [], []
    last = [time.perf_counter()]

    def on_round(record) -> None:
        now = time.perf_counter()
        round_seconds.append(now - last[0])
        cohort_sizes.append(record.cohort_size)
        last[0] = now

    last[0] = time.perf_counter()
    result = sim.run(on_round)
    evals = [
        {"round": r.round, "test_accuracy": r.test_accuracy, "test_loss": r.test_loss}
        for r in result.history
        if r.test_accuracy is not None
    ]
    return summarize(
        round_seconds,
        cohort_sizes,
        setup,
        final_test_accuracy=evals[-1]["test_accuracy"],
        final_test_loss=evals[-1]["test_loss"],
        final_epsilon=result.history[-1].epsilon,
        evals=evals,
        _params=result.params,
        **extra,
    )


def run_local(config: ExperimentConfig, store) -> dict:
    from cluster.runtime.executors import LocalExecutor

    t0 = time.perf_counter()
    executor = LocalExecutor(store, config.task, config.build_algorithm(), config.seed)
    setup = time.perf_counter() - t0
    try:
        return run_simulation(config, store, executor, setup)
    finally:
        executor.close()


def _actor_info(host_actor) -> dict:
    """Run inside a ClientHostActor (via ``__ray_call__``): its process's scheduling settings."""
    return {"pid": os.getpid(), "niceness": os.nice(0), "torch_threads": torch.get_num_threads()}


def run_ray(config: ExperimentConfig, store, num_actors: int) -> dict:
    import ray

    from cluster.runtime.ray_executor import RayExecutor
    from cluster.runtime.ray_runtime import PROJECT_ROOT, check_resources

    e = config.executor
    t0 = time.perf_counter()
    # The same embedded start-up as cluster.runtime.ray_runtime.connect, but address="local"
    # so that a Ray cluster someone else started on this machine is never joined by accident. On an
    # overloaded machine the raylet can miss its start-up deadline: retry once before failing.
    for attempt in (1, 2):
        try:
            ray.init(
                address="local",
                include_dashboard=False,
                log_to_driver=True,
                runtime_env={"env_vars": {"PYTHONPATH": str(PROJECT_ROOT)}},
            )
            break
        except Exception as error:
            ray.shutdown()
            if attempt == 2:
                raise
            print(f"  ray.init failed ({error}); retrying once", file=sys.stderr, flush=True)
    ray_init = time.perf_counter() - t0
    executor = None
    try:
        check_resources(num_actors, e.cpus_per_actor, e.gpus_per_actor)
        t1 = time.perf_counter()
        executor = RayExecutor(
            store,
            config.task,
            config.build_algorithm(),
            config.seed,
            num_actors,
            e.cpus_per_actor,
            e.gpus_per_actor,
        )
        actors = time.perf_counter() - t1
        info = ray.get([a.__ray_call__.remote(_actor_info) for a in executor.actors])
        return run_simulation(
            config,
            store,
            executor,
            time.perf_counter() - t0,
            ray_init_seconds=ray_init,
            ray_init_attempts=attempt,
            actor_creation_seconds=actors,
            num_actors=num_actors,
            cpus_per_actor=e.cpus_per_actor,
            cluster_cpus=ray.cluster_resources().get("CPU"),
            actor_processes=info,
        )
    finally:
        if executor is not None:
            executor.close()
        ray.shutdown()


# ----------------------------------------------------------------------------- driver


def machine_info() -> dict:
    import ray

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "ray": ray.__version__,
        "numpy": np.__version__,
        "load_average_1m_5m": _load(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS), help="subset to run"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads in this process (plain loop, LocalExecutor, driver); Ray actors "
        "set their own (cpus_per_actor). 0 keeps torch's default. Default 1.",
    )
    parser.add_argument("--store-root", help="shard store root (default: $DPFL_STORE_ROOT or temp)")
    parser.add_argument(
        "--ray-uv-hook",
        choices=["on", "off"],
        default="off",
        help="Ray's `uv run` runtime-env hook (RAY_ENABLE_UV_RUN_RUNTIME_ENV, on by default in "
        "Ray, off in this project: see cluster/__init__.py): under `uv run` it ships the working "
        "dir and has every worker build its own venv. 'on' measures Ray's start-up with it.",
    )
    parser.add_argument(
        "--ray-worker-niceness",
        type=int,
        help="set RAY_worker_niceness for the embedded raylet (Ray's default: workers, hence "
        "the actors, run at nice 15 and lose the CPU to any normal-priority process)",
    )
    parser.add_argument(
        "--micro-repeats", type=int, default=50, help="repeats per micro-benchmark (0 skips them)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 is warm-up)")

    if "ray" in sys.modules:  # read once, when ray is imported
        parser.error("--ray-uv-hook must be applied before ray is imported")
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "1" if args.ray_uv_hook == "on" else "0"
    if args.ray_worker_niceness is not None:
        os.environ[WORKER_NICENESS_ENV] = str(args.ray_worker_niceness)
    default_threads = torch.get_num_threads()
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)

    tmp = None
    overrides = [f"rounds={args.rounds}", "tracking.enabled=false"]
    if args.store_root:
        overrides.append(f"data.store_root={args.store_root}")
    elif not os.environ.get("DPFL_STORE_ROOT"):
        tmp = tempfile.TemporaryDirectory(prefix="dpfl-bench-")
        overrides.append(f"data.store_root={tmp.name}")
    config = load_config(CONFIG, overrides)

    t0 = time.perf_counter()
    store, built = open_store(config)
    store_seconds = time.perf_counter() - t0
    report: dict = {
        "benchmark": "overhead",
        "workload": "configs/quickstart.yaml",
        "config": config.to_dict(),
        "rounds": args.rounds,
        "machine": {**machine_info(), "torch_default_threads": default_threads},
        "ray_settings": {
            "init": "ray.init(address='local', include_dashboard=False, runtime_env=PYTHONPATH)",
            "uv_run_hook": args.ray_uv_hook,
            "worker_niceness": os.environ.get(WORKER_NICENESS_ENV, "ray default (15)"),
            "uv_env_detected": "UV" in os.environ or "VIRTUAL_ENV" in os.environ,
        },
        "store": {"path": str(store.path), "built": built, "seconds": store_seconds},
        "notes": [
            "Round 1 is warm-up: excluded from seconds_per_round mean/median and "
            "clients_per_second; reported as first_round_seconds.",
            "Round times include evaluation every eval_every rounds; Simulation rounds also "
            "include the RDP accountant's epsilon (the plain loop does no accounting).",
            "setup_seconds: plain/local = loading client shards into tensors (+ Simulation); "
            "ray = ray.init + actor creation (+ Simulation).",
            "The executor section of config is overridden per variant (local / ray, num_actors).",
            "plain_torch's first round includes torch.optim's one-off lazy import on the first "
            "optimizer construction (torch._dynamo and ~900 modules).",
            "Ray actors run at the raylet's worker niceness (Ray default 15): on a shared "
            "machine they yield the CPU to any normal-priority process; see "
            "--ray-worker-niceness and load_average_before_after.",
        ],
        "results": {},
    }
    runners = {
        "plain_torch": lambda: run_plain(config, store),
        "local_executor": lambda: run_local(config, store),
        "ray_1_actor": lambda: run_ray(config, store, 1),
        "ray_2_actors": lambda: run_ray(config, store, 2),
    }
    params = {}
    for name in args.variants:
        print(f"running {name} ({args.rounds} rounds) ...", flush=True)
        before = _load()
        try:
            result = runners[name]()
        except Exception as error:  # keep the other variants' numbers
            result = {"error": f"{type(error).__name__}: {error}"}
            print(f"  {name} failed: {result['error']}", file=sys.stderr, flush=True)
        params[name] = result.pop("_params", None)
        result["load_average_before_after"] = [before, _load()]
        report["results"][name] = result

    reference = params.get("local_executor")
    if reference is not None:
        for name, p in params.items():
            if p is not None and name in report["results"]:
                diff = float((p.double() - reference.double()).abs().max())
                report["results"][name]["final_params_max_abs_diff_vs_local_executor"] = diff

    if args.micro_repeats > 0:
        print("running micro-benchmarks ...", flush=True)
        report["microbench"] = microbench(config, store, args.micro_repeats)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"wrote {args.out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


def print_table(report: dict) -> None:
    header = (
        f"{'variant':<15} {'setup s':>8} {'1st rnd s':>9} {'mean s/rnd':>10} "
        f"{'med s/rnd':>9} {'clients/s':>9} {'final acc':>9} {'Δparams':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, r in report["results"].items():
        if "error" in r:
            print(f"{name:<15} error: {r['error']}")
            continue
        diff = r.get("final_params_max_abs_diff_vs_local_executor")
        print(
            f"{name:<15} {r['setup_seconds']:>8.2f} {r['first_round_seconds']:>9.3f} "
            f"{r['seconds_per_round_mean']:>10.3f} {r['seconds_per_round_median']:>9.3f} "
            f"{r['clients_per_second']:>9.1f} {r['final_test_accuracy']:>9.4f} "
            f"{'' if diff is None else f'{diff:.1e}':>9}"
        )
    micro = report.get("microbench")
    if micro:
        print(f"\nper local step, µs (median / min of {micro['repeats']} clients):")
        for key in (
            "project_LocalTrainer_functional_call",
            "plain_nn_module_torch_optim_sgd",
            "flat_vector_F_linear_no_functional_call",
            "project_client_round_total",
        ):
            v = micro[key]
            print(f"  {key:<42} {v['us_per_step_median']:>8.1f} / {v['us_per_step_min']:>7.1f}")
        for n, v in micro["by_torch_threads"].items():
            project = v["project_LocalTrainer"]["us_per_step_median"]
            plain = v["plain_module_sgd"]["us_per_step_median"]
            print(f"  torch threads={n}: project {project:.1f}, plain {plain:.1f} (median)")
        print(f"  RDP accountant ε per round: {micro['rdp_accountant_epsilon_seconds']:.3f} s")
        print(
            f"  evaluate: LocalExecutor {micro['local_executor_evaluate_seconds'] * 1e3:.1f} ms, "
            f"plain {micro['plain_evaluate_seconds'] * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    raise SystemExit(main())
