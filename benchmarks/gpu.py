"""Clients per second on one device: sequential against vectorised clients, the executors, bf16.

Issue 32's GPU measurements, as one command writing one JSON report. On synthetic images
(uniform random pixels, random labels: the arithmetic of real ones, no data files needed):

* ``mnist_500``: the MNIST CNN, 500 clients of 80 rows, fixed cohorts of 100, 5 steps of 16;
* ``mnist_2000``: the MNIST CNN, 2,000 clients of 4 rows, cohorts of 500, 2 steps of 4;
* ``resnet``: ResNet-18 (GroupNorm; the ``femnist_resnet18`` task, which has no augmentation
  that would keep every client sequential) on 3×32×32 inputs, 500 clients of 100 rows, cohorts
  of 50, 4 steps of 50 (DP-FedSAM's CIFAR-10 round at 2 local epochs).

DP-FedAvg (clip C = 1, server noise σ = 1, no momentum) on each, each round's clients trained
one at a time (``executor.vectorize: false``) and vmapped (``true``), on the local executor
(one host) at each ``--precisions`` (``executor.precision``); the plain PyTorch loop on the same
device beside them (``benchmarks.workloads.plain_loop``: copy the model, SGD, clip, sum, noise,
step) and each row's ratio to it. Then ``dp_fedavg_sample`` (DP-SGD in the clients) sequential
and with ``vectorize: true`` on ``mnist_500``; Ray with 1 actor × 1 GPU, 4 × 0.25 and 8 × 0.125 on
``mnist_2000`` (``--device cpu``: one actor × 1 CPU; the fractional-GPU rows are listed as
skipped); and a ``torch.profiler`` summary of one vectorised round of ``mnist_2000`` (GPU busy
fraction, kernel launches and host time per client; on the CPU the operator count instead).
``table_check`` compares the faster local path per model with ``actors.kernel_table``.
``paper`` (``--paper-steps`` > 0): the DP-FedSAM CIFAR-10 paper config's round (``paper_rows``)
at ``PAPER_VARIANTS``: one host at float32, channels-last and bf16; Ray with fractional GPUs.

Seconds per round: the median of the rounds after the first (``--rounds``). ``--scale`` and
``--batch-cap`` shrink every workload (clients and cohorts × scale, at least 2; batches and
rows capped, steps kept) so that ``--device cpu`` finishes in a minute or two. Without CUDA,
``--device cuda`` (the default) writes a report that says it skipped, and exits 0.

Usage (repository root)::

    uv run python -m benchmarks.gpu [--device cuda|cpu] [--workloads mnist_500 mnist_2000 resnet]
        [--rounds 4] [--scale 1] [--batch-cap N] [--precisions float32 bf16] [--no-ray]
        [--paper-steps 12] [--out benchmarks/results/gpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from actors.kernel_table import row
from benchmarks import write_report
from benchmarks.workloads import plain_loop
from cluster.config import ExperimentConfig, load_config
from cluster.runtime.experiment import make_executor
from cluster.runtime.ray_runtime import disconnect
from cluster.runtime.simulation import Simulation
from datasets.arrays import LabeledArrays
from datasets.locations import parse_location
from datasets.store import ShardStore, write_store
from datasets.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu.json"


@dataclass(frozen=True)
class Workload:
    task: str
    source: str  # the task's source, as the store's manifest names it (pixels synthetic)
    shape: tuple[int, ...]
    clients: int
    cohort: int
    steps: int
    rows: int  # per client
    batch: int

    def scaled(self, scale: float, batch_cap: int | None) -> Workload:
        """Clients and cohort × ``scale`` (at least 2); batch and rows capped, steps kept."""
        batch = min(self.batch, batch_cap or self.batch)
        return replace(
            self,
            clients=max(2, round(self.clients * scale)),
            cohort=max(2, round(self.cohort * scale)),
            rows=self.rows * batch // self.batch,
            batch=batch,
        )


WORKLOADS = {
    "mnist_500": Workload("mnist_cnn", "mnist", (28, 28), 500, 100, 5, 80, 16),
    "mnist_2000": Workload("mnist_cnn", "mnist", (28, 28), 2000, 500, 2, 4, 4),
    "resnet": Workload("femnist_resnet18", "femnist", (3, 32, 32), 500, 50, 4, 100, 50),
}
RAY_LAYOUTS = ((1, 1.0), (4, 0.25), (8, 0.125))  # actors × GPU share each

# Issue 32 item 4: the DP-FedSAM CIFAR-10 paper config's round on one GPU.
PAPER_CONFIG = ROOT / "configs" / "papers" / "dpfedsam_cifar10_dir0.6.yaml"
PAPER = Workload("cifar10_resnet18_flips_gray", "cifar10", (3, 32, 32), 500, 50, 60, 100, 50)
PAPER_ROUND_S = 44.0  # issue 32: one H200, local executor, 2.94 s at 4 steps × 60/4 steps
PAPER_VARIANTS = {  # name → (actors, GPU share each, overrides)
    "local": (1, 1.0, []),
    "local channels_last": (1, 1.0, ["executor.channels_last=true"]),
    "local bf16": (1, 1.0, ["executor.precision=bf16"]),
    "ray 4x0.25": (4, 0.25, []),
    "ray 4x0.25 bf16": (4, 0.25, ["executor.precision=bf16"]),
    "ray 8x0.125 bf16": (8, 0.125, ["executor.precision=bf16"]),
}


def synthetic_store(path: Path, w: Workload, seed: int = 0) -> ShardStore:
    """``w.clients`` clients of ``w.rows`` uniform random uint8 images with random labels."""
    rng = np.random.default_rng(seed)
    n = w.clients * w.rows

    def arrays(count: int) -> LabeledArrays:
        x = rng.integers(0, 256, size=(count, *w.shape), dtype=np.uint8)
        return LabeledArrays(x, rng.integers(0, 10, size=count).astype(np.int64), None)

    clients = [np.arange(c * w.rows, (c + 1) * w.rows) for c in range(w.clients)]
    description = {"source": {"name": w.source, "pixels": "uniform random"}, "seed": seed}
    return write_store(parse_location(str(path)), arrays(n), arrays(64), clients, 10, description)


def workload_config(
    w: Workload, store: ShardStore, rounds: int, overrides: list[str]
) -> ExperimentConfig:
    """DP-FedAvg on the store, fixed cohorts, no evaluation or checkpoint within the rounds."""
    return load_config(
        None,
        [
            f"task={w.task}",
            f"data.source={w.source}",
            f"data.store={store.location}",
            f"data.num_clients={w.clients}",
            f"cohort.size={w.cohort}",
            "cohort.sampling=fixed",
            "algorithm.name=dp_fedavg",
            "algorithm.clip_norm=1.0",
            "algorithm.noise_multiplier=1.0",
            "algorithm.noise_placement=server",
            "algorithm.local.momentum=0",
            "algorithm.local.lr=0.05",
            f"algorithm.local.batch_size={w.batch}",
            f"algorithm.local.local_steps={w.steps}",
            "algorithm.local.local_epochs=null",
            "privacy.delta=1e-5",
            f"rounds={rounds + 1}",  # the last round evaluates: never timed
            f"eval_every={rounds + 1}",
            "tracking.enabled=false",
            "checkpoint.every=0",
            *overrides,
        ],
    )


def local_executor(device: str) -> list[str]:
    """One host: on the GPU, or on the CPU at torch's threads (whatever a config's own
    executor says)."""
    if device == "cuda":
        return ["executor.kind=local", "executor.num_actors=1", "executor.gpus_per_actor=1"]
    return [
        "executor.kind=local",
        "executor.num_actors=1",
        f"executor.cpus_per_actor={torch.get_num_threads()}",
        "executor.gpus_per_actor=0",
    ]


def ray_executor(actors: int, share: float, device: str) -> list[str]:
    """``actors`` Ray actors of 1 CPU and, on the GPU, ``share`` of it each; every round timed
    on the actors (no overlapped start)."""
    gpus = share if device == "cuda" else 0
    return [
        "executor.kind=ray",
        f"executor.num_actors={actors}",
        "executor.cpus_per_actor=1",
        f"executor.gpus_per_actor={gpus}",
        "executor.overlap_start=false",
    ]


# Listed in place of a row where ``device`` is the CPU and a GPU share below one was asked for.
FRACTIONAL_ON_CPU = {"skipped": "no GPU: fractional GPU actors need CUDA"}


def timed_rounds(config: ExperimentConfig, store: ShardStore, rounds: int, profile=None) -> dict:
    """The project's seconds per round (median after the first) and clients per second;
    with ``profile`` (a ``torch.profiler.profile``), the last round runs inside it."""
    executor = make_executor(config, store)
    try:
        sim = Simulation(config, store, executor)
        seconds = []
        for r in range(rounds):
            last = profile is not None and r == rounds - 1
            with profile if last else contextlib.nullcontext():
                start = time.perf_counter()
                sim.history.append(sim.run_round(r))
                _sync(config)
                seconds.append(time.perf_counter() - start)
    finally:
        executor.close()
    return _rates(seconds, config.cohort.size)


def _sync(config: ExperimentConfig) -> None:
    if config.executor.gpus_per_actor > 0 and torch.cuda.is_available():
        torch.cuda.synchronize()


def _rates(seconds: list[float], cohort: int) -> dict:
    per_round = statistics.median(seconds[1:] or seconds)
    return {
        "seconds_per_round": round(per_round, 4),
        "clients_per_second": round(cohort / per_round, 1),
        "round_seconds": [round(s, 4) for s in seconds],
    }


def local_rows(
    name: str, w: Workload, store, device: str, rounds: int, precisions: list[str]
) -> list[dict]:
    """The plain loop, then sequential and vectorised at each precision (one host)."""
    base = workload_config(w, store, rounds, local_executor(device))
    loop = plain_loop(base, store, device)[1]["seconds_per_round"]
    plain = {"seconds_per_round": round(loop, 4), "clients_per_second": round(w.cohort / loop, 1)}
    rows = [{"workload": name, "executor": "plain_loop", **plain}]
    for precision in precisions:
        for vectorize in ("false", "true"):
            overrides = [
                *local_executor(device),
                f"executor.vectorize={vectorize}",
                f"executor.precision={precision}",
            ]
            timing = timed_rounds(workload_config(w, store, rounds, overrides), store, rounds)
            rows.append(
                {
                    "workload": name,
                    "executor": "local",
                    "vectorize": vectorize == "true",
                    "precision": precision,
                    **timing,
                    "vs_plain_loop": _ratio(timing, plain),
                }
            )
    return rows


def _ratio(timing: dict, plain: dict) -> float:
    """The project's seconds per round over the plain loop's (below 1: faster)."""
    return round(timing["seconds_per_round"] / plain["seconds_per_round"], 3)


def sample_level_rows(w: Workload, store, device: str, rounds: int) -> list[dict]:
    """``dp_fedavg_sample`` (DP-SGD in the clients), ``executor.vectorize`` false and true."""
    rows = []
    for vectorize in ("false", "true"):
        overrides = [
            *local_executor(device),
            "algorithm.name=dp_fedavg_sample",
            "algorithm.noise_placement=null",
            f"executor.vectorize={vectorize}",
        ]
        timing = timed_rounds(workload_config(w, store, rounds, overrides), store, rounds)
        rows.append({"algorithm": "dp_fedavg_sample", "vectorize": vectorize == "true", **timing})
    return rows


def ray_rows(w: Workload, store, device: str, rounds: int, layouts=RAY_LAYOUTS) -> list[dict]:
    """Vectorised rounds on Ray, ``layouts`` (actors × GPU share each): 1 × 1, 4 × 0.25,
    8 × 0.125 (CPU: 1 actor × 1 CPU; the fractional-GPU layouts skipped)."""
    rows = []
    for actors, share in layouts:
        layout = f"{actors}x{share:g}"
        if device == "cpu" and share < 1:
            rows.append({"layout": layout, **FRACTIONAL_ON_CPU})
            continue
        overrides = [*ray_executor(actors, share, device), "executor.vectorize=true"]
        try:
            timing = timed_rounds(workload_config(w, store, rounds, overrides), store, rounds)
        finally:
            disconnect()
        rows.append({"layout": layout, "device": device, "vectorize": True, **timing})
    return rows


def paper_rows(w: Workload, store, device: str, rounds: int, variants=PAPER_VARIANTS) -> list:
    """The paper config (``PAPER_CONFIG``: ASAM's two gradients a step, the authors'
    augmentation, so one client at a time) on ``w``'s synthetic store, a fixed cohort of
    ``w.cohort``, ``w.steps`` local steps, each of ``variants``: seconds per round, and that
    round extrapolated to the paper's 60 steps and, where ``w`` is the paper's round but for its
    steps (no ``--scale`` or ``--batch-cap``), its speed-up over the issue's 44 s and the 300
    rounds' hours (``paper_extrapolation``). On the CPU the local variants run on one
    host at torch's threads; variants of a GPU share below one are skipped."""
    rows = []
    for name, (actors, share, extra) in variants.items():
        if device == "cpu" and share < 1:
            rows.append({"variant": name, **FRACTIONAL_ON_CPU})
            continue
        local = not name.startswith("ray")  # the config's own executor: Ray's 8 × 0.5 GPU
        executor = local_executor(device) if local else ray_executor(actors, share, device)
        config = load_config(PAPER_CONFIG, [*_paper_overrides(w, store, rounds), *executor, *extra])
        try:
            timing = timed_rounds(config, store, rounds)
        finally:
            disconnect()
        rows.append({"variant": name, "steps": w.steps, **timing, **paper_extrapolation(w, timing)})
    return rows


def paper_extrapolation(w: Workload, timing: dict) -> dict:
    """``timing``'s round at the paper's 60 steps (× 60 / ``w.steps``: an upper bound) and,
    where ``w`` is the paper's round but for its steps, its speed-up over the issue's 44 s and
    the 300 rounds' hours (else None: a smaller cohort or batch is not the paper's round)."""
    paper_round = timing["seconds_per_round"] * PAPER.steps / w.steps
    paper_sized = replace(w, steps=PAPER.steps) == PAPER
    return {
        "paper_round_s_extrapolated": round(paper_round, 2),
        "speedup_vs_issue_44s_h200": round(PAPER_ROUND_S / paper_round, 2) if paper_sized else None,
        "paper_run_hours_extrapolated": (
            round(paper_round * 300 / 3600, 2) if paper_sized else None
        ),
    }


def _paper_overrides(w: Workload, store, rounds: int) -> list[str]:
    return [
        f"data.store={store.location}",
        f"data.num_clients={w.clients}",
        "data.test_per_client=null",
        f"cohort.size={w.cohort}",
        "cohort.sampling=fixed",  # the same work each round
        f"algorithm.local.batch_size={w.batch}",
        f"algorithm.local.local_steps={w.steps}",
        "algorithm.local.local_epochs=null",
        f"rounds={rounds + 1}",  # the last round evaluates: never timed
        f"eval_every={rounds + 1}",
        "tracking.enabled=false",
        "checkpoint.every=0",
    ]


def profile_row(w: Workload, store, device: str, rounds: int) -> dict:
    """``torch.profiler`` over one vectorised round (the last of ``rounds``), one host."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    overrides = [*local_executor(device), "executor.vectorize=true"]
    config = workload_config(w, store, rounds, overrides)
    profiler = profile(activities=activities)
    timing = timed_rounds(config, store, rounds, profiler)
    return {"cohort": w.cohort, **profile_summary(profiler, timing["round_seconds"][-1], w.cohort)}


def profile_summary(profiler, wall: float, cohort: int) -> dict:
    """GPU busy fraction (the device's kernel time / the round's wall time), kernel launches and
    host CPU time per client, and the operators with the most self time (device time on a GPU:
    an operator's own kernels; CPU time on the CPU); on the CPU, operators per client."""
    from torch.autograd import DeviceType

    events = profiler.key_averages()
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    host_us = sum(e.self_cpu_time_total for e in ops)
    device_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in ops if "LaunchKernel" in e.key)
    on_gpu = bool(kernels)
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    top = sorted(ops, key=lambda e: getattr(e, key), reverse=True)[:8]
    return {
        "round_wall_seconds": round(wall, 4),
        "gpu_busy_fraction": round(device_us / 1e6 / wall, 4) if on_gpu else None,
        "kernel_launches_per_client": round(launches / cohort, 1) if on_gpu else None,
        "host_cpu_ms_per_client": round(host_us / 1e3 / cohort, 3),
        "wall_ms_per_client": round(wall * 1e3 / cohort, 3),
        "aten_ops_per_client": round(
            sum(e.count for e in ops if e.key.startswith("aten::")) / cohort, 1
        ),
        "top_ops": [{"op": e.key, "ms": round(getattr(e, key) / 1e3, 3)} for e in top],
        "note": None if on_gpu else "CPU: no device kernels; host time is the round's work",
    }


def table_check(rows: list[dict], device: str) -> dict:
    """Per model kind, the faster local float32 path against ``actors.kernel_table``'s row."""
    found = {}
    for r in rows:
        if r.get("executor") == "local" and r["precision"] == "float32":
            model = TASKS[WORKLOADS[r["workload"]].task].model_name
            found.setdefault(model, {})[r["vectorize"]] = r["seconds_per_round"]
    check = {}
    for model, times in found.items():
        if len(times) == 2:
            faster = times[True] < times[False]
            table = row(model, device).vectorize
            check[f"{model}/{device}"] = {
                "vectorized_speedup": round(times[False] / times[True], 3),
                "faster": "vectorized" if faster else "sequential",
                "table": "vectorized" if table else "sequential",
                "agrees": faster == table,
            }
    return check


def run(args) -> dict:
    """Every section for ``args`` (see ``main``), as one report."""
    report = {"benchmark": "gpu", "device": args.device, "rounds": args.rounds}
    if args.device == "cuda" and not torch.cuda.is_available():
        return {**report, "skipped": "no CUDA device (run with --device cpu for the CPU)"}
    report["device_name"] = _device_name(args.device)
    report["torch"] = torch.__version__
    workloads = {
        name: WORKLOADS[name].scaled(args.scale, args.batch_cap) for name in args.workloads
    }
    report["workloads"] = {name: w.__dict__ for name, w in workloads.items()}
    with tempfile.TemporaryDirectory(prefix="dpfl-gpu-") as tmp:
        stores = {name: synthetic_store(Path(tmp) / name, w) for name, w in workloads.items()}
        local = []
        for name, w in workloads.items():
            local += local_rows(name, w, stores[name], args.device, args.rounds, args.precisions)
        report["local"] = local
        report["table_check"] = table_check(local, args.device)
        if "mnist_500" in workloads:
            w = workloads["mnist_500"]
            report["sample_level"] = sample_level_rows(
                w, stores["mnist_500"], args.device, args.rounds
            )
        if "mnist_2000" in workloads:
            w, store = workloads["mnist_2000"], stores["mnist_2000"]
            if not args.no_ray:
                report["ray"] = ray_rows(w, store, args.device, args.rounds)
            report["profile"] = profile_row(w, store, args.device, args.rounds)
        if args.paper_steps:
            paper = replace(PAPER, steps=args.paper_steps).scaled(args.scale, args.batch_cap)
            report["paper_workload"] = paper.__dict__
            store = synthetic_store(Path(tmp) / "paper", paper)
            variants = {
                k: v for k, v in PAPER_VARIANTS.items() if not args.no_ray or k[:3] != "ray"
            }
            report["paper"] = paper_rows(paper, store, args.device, args.rounds, variants)
    return report


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--workloads", nargs="*", choices=sorted(WORKLOADS), default=list(WORKLOADS)
    )
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (first discarded)")
    parser.add_argument("--scale", type=float, default=1.0, help="× clients and cohorts")
    parser.add_argument("--batch-cap", type=int, default=None, help="largest batch size")
    parser.add_argument(
        "--precisions", nargs="*", choices=["float32", "bf16"], default=["float32", "bf16"]
    )
    parser.add_argument("--no-ray", action="store_true", help="leave out the Ray rows")
    parser.add_argument(
        "--paper-steps",
        type=int,
        default=12,
        help="local steps of the DP-FedSAM paper round (its 60 extrapolated from them; 0: none)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.paper_steps < 0:
        parser.error(f"--paper-steps {args.paper_steps}: 0 (no paper round) or more")
    if args.rounds < 2 or not args.scale > 0 or (args.batch_cap is not None and args.batch_cap < 1):
        parser.error(
            f"--rounds {args.rounds} --scale {args.scale} --batch-cap {args.batch_cap}: need "
            "rounds >= 2 (the first is not timed), scale > 0, batch cap >= 1"
        )
    if "float32" not in args.precisions:
        parser.error("--precisions must include float32 (the reference every ratio needs)")
    report = run(args)
    path = write_report(report, args.out)
    print(f"{path}: {'skipped: ' + report['skipped'] if 'skipped' in report else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
