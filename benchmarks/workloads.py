"""Issue 16's workloads: the project against the plain PyTorch loop a researcher would write.

* **A** — real MNIST (the test split in ``../shared/data/mnist``: images 0–7999 train, 8000–9999
  test), 100 IID clients of 80 examples, fixed cohorts of 10, one local epoch of batch 16 (5 SGD
  steps, lr 0.05, no momentum) on the 582k-parameter CNN (``mnist_cnn``, no GroupNorm), flat
  clip C = 1, server noise σ = 1 on the sum, 30 rounds, one evaluation at the end. Wall time from
  after the imports to the final model, in three parts: start-up until the first round starts
  (the project: ``run_experiment`` with Ray, its actors and the hosts' data, while its MLflow run
  opens in its own process; the loop: loading the clients' tensors), the rounds (the project's
  last one includes the final evaluation), and the end (the loop: the final evaluation; the
  project: its checkpoint and the MLflow run's artifacts and end).
* **B** — synthetic(1, 1) logistic regression, 10,000 clients × 50 training samples, fixed
  cohorts of 1,000, 5 local steps of batch 10, lr 0.1, clip 1, σ = 1: seconds per round after
  the first.
* **S** — B's data and cohorts under ``dp_fedavg_sample``: K = 10 DP-SGD steps of batch 10
  drawn afresh, per-example clip C = 1, σ_g = 1 per step (replace-one), lr 0.1, 4 rounds:
  seconds per round after the first; its plain loop is ``benchmarks.workload_s`` (DP-SGD with
  torch.func per client). ``local_sequential`` against ``local_vectorized`` is issue 32's
  sample-level vectorisation.

The plain loop (``plain_loop``) is one process at torch's default threads: copy the model, SGD
over the client's batches, clip the delta, sum, add N(0, σ²C²), average, step. It reads the same
shard store, the same cohorts (``sample_cohort``) and the same seeded batch and noise streams
(``algorithms.rng``) as the project, so at σ = 0 both end with the same weights up to float
rounding (``--check-equal`` reports the largest difference after 3 rounds, the loop at the
project's one intra-op thread: sequential, vectorised, and sequential with NCHW convolutions,
which is the loop's computation; A's CNN amplifies other kernels' rounding, and even another
thread count's, by a CPU-dependent amount). Each workload prints one JSON
line: both times and their ratios. The project's executors: ``ray`` (2 actors × 1 CPU) and
``local`` (in process, one host thread at one intra-op thread per thread of the plain loop) as
configured by default (``executor.vectorize: auto``: clients vmapped where that is the same
computation and faster, ``algorithms/vectorized.py``; ``channels_last: auto``), each also
``_sequential`` (``vectorize: false``: one client at a time) and ``_vectorized`` (``true``:
vmapped wherever it is the same computation). ``ray_running`` is ``ray`` connecting to a Ray
that already runs on this machine (``executor.address``): a head that the benchmark starts
before the timings with ``ray start --head`` and stops after them (``running_ray``).
``ray_warm`` is ``ray_running`` with warm actors (``executor.keep_warm_s``): the benchmark runs
it once, untimed, before the timings, and each timed run reuses the actors the one before left
(``cluster/runtime/warm_pool.py``). ``ray`` runs its first rounds in the driver while its
embedded Ray and actors start (``executor.overlap_start: auto``); ``ray_waiting`` waits for the
actors first.

Usage (repository root)::

    uv run python -m benchmarks.workloads [--workloads A B] [--executors ray ray_running local]
        [--repeat 3]
    uv run python -m benchmarks.workloads --workloads A --executors ray_running ray_warm
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from actors.client_host import build_model
from algorithms.rng import Purpose, stream_seed, torch_generator
from benchmarks.workload_s import loop_timing, plain_dp_sgd_loop
from cluster.config import ExperimentConfig, config_from_dict, load_config
from cluster.runtime.cohort import sample_cohort
from cluster.runtime.executors import torch_threads
from cluster.runtime.experiment import run_experiment
from cluster.runtime.ray_runtime import HEAD_PORT_OPTIONS, disconnect
from cluster.runtime.store import open_store
from datasets.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
MNIST_ROOT = ROOT.parent / "shared" / "data" / "mnist"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "workloads.json"
COMMON = [
    "algorithm.name=dp_fedavg",
    "algorithm.clip_norm=1.0",
    "algorithm.noise_multiplier=1.0",
    "algorithm.noise_placement=server",
    "algorithm.local.momentum=0",
    "cohort.sampling=fixed",
    "privacy.delta=1e-5",
    "checkpoint.every=0",
]
WORKLOADS = {
    "A": [
        "task=mnist_cnn",
        "data.source=mnist_test_split",
        f"data.root={MNIST_ROOT}",
        "data.num_clients=100",
        "data.partition.method=iid",
        "cohort.size=10",
        "algorithm.local.lr=0.05",
        "algorithm.local.batch_size=16",
        "algorithm.local.local_steps=null",
        "algorithm.local.local_epochs=1",
        "rounds=30",
        "eval_every=30",
    ],
    "B": [
        "task=synthetic_logreg",
        "data.source=synthetic",
        "data.num_clients=10000",
        "data.synthetic.samples_per_user=63",  # round(0.8 · 63) = 50 training rows each
        "data.partition.method=natural",
        "cohort.size=1000",
        "algorithm.local.lr=0.1",
        "algorithm.local.batch_size=10",
        "algorithm.local.local_steps=5",
        "rounds=10",
        "eval_every=10",
    ],
}
WORKLOADS["S"] = [
    *WORKLOADS["B"][:-4],  # B's data, cohorts and lr (not its steps and rounds)
    "algorithm.name=dp_fedavg_sample",
    "algorithm.noise_placement=null",  # the noise is DP-SGD's, in every local step
    "algorithm.local.batch_size=10",
    "algorithm.local.local_steps=10",
    "rounds=4",
    "eval_every=4",
]


def workload_config(name: str, overrides: list[str]) -> ExperimentConfig:
    return load_config(None, [*COMMON, *WORKLOADS[name], *overrides])


def plain_loop(config: ExperimentConfig, store, device: str = "cpu") -> tuple[torch.Tensor, dict]:
    """DP-FedAvg as a researcher writes it in an afternoon (see the module docstring), on
    ``device`` (on a GPU each round ends when its kernels have: ``benchmarks.gpu``)."""
    start = time.perf_counter()
    a, local, task = config.algorithm, config.algorithm.local, TASKS[config.task]
    clients = []
    for cid in range(store.num_clients):
        rows = store.client(cid)
        x, y = torch.tensor(rows.x, device=device), torch.tensor(rows.y, device=device)
        clients.append((task.preprocess(x), y))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(config.seed, Purpose.MODEL_INIT))
        model = build_model(store, config.task).to(device)
    startup = time.perf_counter() - start
    round_seconds = []
    for r in range(config.rounds):
        t0 = time.perf_counter()
        cohort = sample_cohort("fixed", store.num_clients, config.cohort.size, config.seed, r)
        global_vec = nn.utils.parameters_to_vector(model.parameters()).detach()
        total = torch.zeros_like(global_vec, dtype=torch.float64)
        for cid in cohort.tolist():
            x, y = clients[cid]
            g = torch_generator(config.seed, r, cid, Purpose.LOCAL_TRAINING)
            steps = local.local_steps or local.local_epochs * math.ceil(len(y) / local.batch_size)
            client = copy.deepcopy(model)
            opt = torch.optim.SGD(client.parameters(), lr=local.lr)
            done = 0
            while done < steps:  # a fresh permutation per epoch
                perm = torch.randperm(len(y), generator=g)
                for lo in range(0, len(y), local.batch_size):
                    if done == steps:
                        break
                    idx = perm[lo : lo + local.batch_size]
                    opt.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(client(x[idx]), y[idx]).backward()
                    opt.step()
                    done += 1
            delta = nn.utils.parameters_to_vector(client.parameters()).detach() - global_vec
            total += delta * min(1.0, a.clip_norm / max(float(delta.norm()), 1e-12))
        if a.noise_multiplier > 0:
            g = torch_generator(config.seed, r, Purpose.SERVER_NOISE)
            total += (
                a.noise_multiplier
                * a.clip_norm
                * torch.randn(total.shape, generator=g, dtype=torch.float64).to(device)
            )
        mean = total / config.cohort.size
        new = (global_vec.double() + a.server_lr * mean).to(global_vec.dtype)
        nn.utils.vector_to_parameters(new, model.parameters())
        if device != "cpu":
            torch.cuda.synchronize()
        round_seconds.append(time.perf_counter() - t0)
    rounds_done = time.perf_counter()
    test = store.test_rows()
    with torch.no_grad():
        logits = model(task.preprocess(torch.tensor(test.x, device=device)))
        accuracy = float((logits.argmax(1) == torch.tensor(test.y, device=device)).float().mean())
    timing = loop_timing(start, startup, round_seconds, rounds_done, accuracy)
    return nn.utils.parameters_to_vector(model.parameters()).detach(), timing


EXECUTORS = {
    "ray": ["executor.kind=ray", "executor.num_actors=2", "executor.cpus_per_actor=1"],
    # In process, one host thread per thread of the plain loop (torch's default: the cores).
    "local": [
        "executor.kind=local",
        f"executor.num_actors={torch.get_num_threads()}",
        "executor.cpus_per_actor=1",
    ],
}
# The defaults (vectorize: auto) vectorise clients where it is the same computation and faster;
# these force one client at a time, or vmap wherever it is the same computation.
for base in ("ray", "local"):
    EXECUTORS[f"{base}_sequential"] = [*EXECUTORS[base], "executor.vectorize=false"]
    EXECUTORS[f"{base}_vectorized"] = [*EXECUTORS[base], "executor.vectorize=true"]
# Ray as above, its first round waiting for the actors (no rounds in the driver meanwhile:
# ``executor.overlap_start``, cluster/runtime/overlapped_start.py).
EXECUTORS["ray_waiting"] = [*EXECUTORS["ray"], "executor.overlap_start=false"]
# Ray as above, but connecting to a Ray already running on this machine (``running_ray``,
# started once outside every timing, as ``ray start --head`` is once for many runs).
RUNNING_RAY = "ray_running"
EXECUTORS[RUNNING_RAY] = EXECUTORS["ray"]
# ``ray_running`` with warm actors (``executor.keep_warm_s``): the actors an earlier run on the
# running head left (``run_workload`` runs one, untimed, before the timings).
WARM_RAY = "ray_warm"
EXECUTORS[WARM_RAY] = [*EXECUTORS["ray"], "executor.keep_warm_s=600"]
ON_RUNNING_RAY = (RUNNING_RAY, WARM_RAY)


def project(config: ExperimentConfig, executor: str) -> tuple[torch.Tensor, dict]:
    """``run_experiment`` as the CLI runs it (tracking on, into a temporary SQLite store)."""
    config = config_from_dict(config.to_dict(), EXECUTORS[executor])
    reported = []  # when each round's record reached the caller
    start = time.perf_counter()
    outcome = run_experiment(config, on_round=lambda record: reported.append(time.perf_counter()))
    end = time.perf_counter()
    history = outcome.result.history
    rounds = [r.seconds for r in history]
    timing = {
        "wall_seconds": end - start,
        # Until the first round starts: Ray, its actors, the hosts' data (the MLflow run opens
        # in its own process meanwhile); then after the last round (which includes the final
        # evaluation): the checkpoint, and waiting for the MLflow run's artifacts and end.
        "startup_seconds": reported[0] - rounds[0] - start,
        "end_seconds": end - reported[-1],
        "rounds_seconds": sum(rounds),
        "seconds_per_round": statistics.median(rounds[1:]),
        "final_test_accuracy": outcome.final_accuracy,
        "epsilon": outcome.epsilon,
    }
    return outcome.result.params, timing


TIMES = (
    "wall_seconds",
    "startup_seconds",
    "rounds_seconds",
    "end_seconds",
    "seconds_per_round",
    "process_seconds",
)
RATIOS = ("wall_seconds", "seconds_per_round", "process_seconds")
NCHW = "executor.channels_last=false"


def _medians(runs: list[dict]) -> dict:
    """One timing: each time the median over the repeats (every repeat's listed beside it)."""
    if len(runs) == 1:
        return runs[0]
    medians = {key: statistics.median(run[key] for run in runs) for key in TIMES}
    return {**runs[-1], **medians, "repeats": [{key: run[key] for key in TIMES} for run in runs]}


def timed_in_child(
    name: str, variant: str, overrides: list[str], env: dict[str, str] | None = None
) -> dict:
    """One timing of ``variant`` (``plain`` or an executor) in a fresh interpreter: nothing
    imported, cached or left running by an earlier variant (a loop run after the project in
    one process found MLflow imported and Ray's processes winding down). The child reads the
    store this process built (``DPFL_STORE_ROOT``); its clock starts after its imports.
    ``env``: its environment (default: this process's)."""
    command = ["benchmarks.workload_child", "--child", variant, "--workloads", name]
    start = time.perf_counter()
    timing = json_line_of_child(command, overrides, f"{variant} on workload {name}", env)
    return {**timing, "process_seconds": time.perf_counter() - start}


def json_line_of_child(
    module_and_args: list[str], overrides: list[str], what: str, env: dict[str, str] | None = None
) -> dict:
    """Run ``python -m MODULE ARGS --set K=V ...`` from the repository root with ``env`` (default:
    this process's) and return the JSON line it printed last; its stderr's end if it fails."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    done = subprocess.run(
        [sys.executable, "-m", *module_and_args, *sets],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**(os.environ if env is None else env), "PYTHONPATH": str(ROOT)},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


HEAD_START_S = 300.0  # `ray start` on 2 loaded cores took 45 s
HEAD_TRIES = 3


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that were free on loopback a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


CORES = os.cpu_count() or 1
# In the drivers' environment of ``running_ray``: the pid of the head's ``ray start``, below which
# its GCS, raylet, agents and workers run (``benchmarks.startup`` reads their CPU).
HEAD_PID_VARIABLE = "DPFL_BENCH_RAY_HEAD_PID"


@contextmanager
def running_ray(
    root: Path, num_cpus: int | None = None, cwd: Path = ROOT
) -> Iterator[tuple[list[str], dict[str, str]]]:
    """A Ray head on this machine for ``ray_running`` (``ray start --head --block``), started
    before and stopped after every timing; yields the overrides and the environment of the
    drivers that connect to it. Loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the
    head's and the drivers' environment: README, Security), token authentication with a token
    of its own, its own temporary directory and ports: other Rays on this machine are left
    alone, and it is stopped by its process group, never by ``ray stop``. ``num_cpus``: Ray's
    logical CPUs (default: the machine's); ``cwd``: the head's working directory, and so its
    workers' (default: the repository root)."""
    token = root / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        RAY_USAGE_STATS_ENABLED="0",
    )
    options = (*HEAD_PORT_OPTIONS, "dashboard-port")  # its head process's: 8265 may be taken
    ports = dict(zip(options, _free_ports(len(options)), strict=True))
    command = [
        str(Path(sys.executable).parent / "ray"),
        *("start", "--head", "--block", "--include-dashboard=false"),
        "--dashboard-host=127.0.0.1",
        f"--temp-dir={root / 'ray'}",
        *(f"--{option}={port}" for option, port in ports.items()),
        *([f"--num-cpus={num_cpus}"] if num_cpus is not None else []),
    ]
    head = _start_head(command, env, root / "ray-start.log", cwd)
    try:
        yield (
            [f"executor.address=127.0.0.1:{ports['port']}"],
            {**env, HEAD_PID_VARIABLE: str(head.pid)},
        )
    finally:
        _stop_process_group(head)


def _start_head(command: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    """``command`` (``ray start --head --block``) once it says the head runs; up to
    ``HEAD_TRIES`` tries: the raylet waits a fixed 15 s for its dashboard agent (not
    configurable in Ray 2.60), which a heavily loaded machine can exceed."""
    for _ in range(HEAD_TRIES):
        with log.open("w") as out:
            head = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + HEAD_START_S
        while "Ray runtime started" not in log.read_text():
            if head.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        else:
            return head
        _stop_process_group(head)
    raise RuntimeError(f"`ray start --head` did not start:\n{log.read_text()[-4000:]}")


def _stop_process_group(head: subprocess.Popen) -> None:
    """SIGTERM to the head's process group (``ray start`` leads it; the GCS, the raylet and the
    helpers it started are in it; the workers exit with their raylet), SIGKILL after 2 s: the
    GCS and the raylet of Ray 2.60 outlive a SIGTERM to the group (still running 8 s after it),
    and a throwaway head has nothing to save."""
    for sig, grace_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            return
        try:
            head.wait(grace_s)
        except subprocess.TimeoutExpired:
            continue
        return


def _create_tracking_schema() -> None:
    """A fresh SQLite store migrates its schema on first use (seconds): done here, once, as on
    a machine that has run an experiment before, not inside the first variant's timing."""
    from mlflow.tracking import MlflowClient

    MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).search_experiments()


def child(name: str, variant: str, overrides: list[str]) -> dict:
    """The timing ``timed_in_child`` reads: the plain loop's, or the project's."""
    config = workload_config(name, overrides)
    if variant == "plain":
        store, _ = open_store(config)
        return (plain_dp_sgd_loop if name == "S" else plain_loop)(config, store)[1]
    return project(config, variant)[1]


def run_workload(
    name: str, executors: list[str], overrides: list[str], check_equal: bool, repeat: int = 1
):
    """The plain loop, then each executor, ``repeat`` times in turn, each in its own process:
    a ratio is the median of each repeat's ratio to the plain loop run just before it (this
    machine's speed drifts by tens of percent over minutes, which separate runs would read as
    differences)."""
    config = workload_config(name, overrides)
    store, _ = open_store(config)  # built here, outside every timing
    plains, timings = [], {executor: [] for executor in executors}
    on_head = set(ON_RUNNING_RAY) & set(executors)
    with tempfile.TemporaryDirectory(prefix="dpfl-ray-head-") as tmp:
        # Room for a warm pool beside another variant's fresh actors: Ray's logical CPUs, the
        # pool's processes are idle while the others run.
        cpus = 2 * CORES if WARM_RAY in executors else None
        head = running_ray(Path(tmp), num_cpus=cpus) if on_head else nullcontext(([], None))
        with head as (address, env):
            if WARM_RAY in executors:  # the pool an earlier run left
                timed_in_child(name, WARM_RAY, [*overrides, *address], env)
            for _ in range(repeat):
                plains.append(timed_in_child(name, "plain", overrides))
                for executor in executors:
                    extra = address if executor in ON_RUNNING_RAY else []
                    variant_env = env if executor in ON_RUNNING_RAY else None
                    timings[executor].append(
                        timed_in_child(name, executor, [*overrides, *extra], variant_env)
                    )
    line = {"workload": name, "rounds": config.rounds, "plain_loop": _medians(plains)}
    for executor, runs in timings.items():
        line[f"project_{executor}"] = _medians(runs)
        line[f"ratio_{executor}"] = {
            key: statistics.median(a[key] / b[key] for a, b in zip(runs, plains, strict=True))
            for key in RATIOS
        }
    if check_equal:
        exact = workload_config(name, [*overrides, "algorithm.noise_multiplier=0", "rounds=3"])
        with torch_threads(1):  # the project's hosts' intra-op threads: oneDNN's kernels vary
            theirs, _ = plain_loop(exact, store)
        variants = {  # the last runs the loop's kernels: one client at a time, NCHW
            "local_sequential": exact,
            "local_vectorized": exact,
            "local_sequential_nchw": config_from_dict(exact.to_dict(), [NCHW]),
        }
        line["sigma0_max_abs_weight_difference"] = {
            label: float((project(config, label.removesuffix("_nchw"))[0] - theirs).abs().max())
            for label, config in variants.items()
        }
    disconnect()
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.workloads", description=__doc__)
    parser.add_argument("--workloads", nargs="*", choices=sorted(WORKLOADS), default=["A", "B"])
    parser.add_argument(
        "--executors", nargs="*", choices=sorted(EXECUTORS), default=["ray", "ray_sequential"]
    )
    parser.add_argument("--set", action="append", default=[], help="override (all workloads)")
    parser.add_argument("--check-equal", action="store_true", help="σ = 0 weight comparison")
    parser.add_argument("--repeat", type=int, default=1, help="alternations; medians reported")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", choices=["plain", *sorted(EXECUTORS)], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one timing, as JSON on the last line (``timed_in_child``)
        print(json.dumps(child(args.workloads[0], args.child, args.set)), flush=True)
        disconnect()
        return 0
    with tempfile.TemporaryDirectory(prefix="dpfl-workloads-") as tmp:
        os.environ.setdefault("DPFL_STORE_ROOT", str(Path(tmp) / "shards"))
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        os.environ.setdefault("DPFL_CHECKPOINT_DIR", str(Path(tmp) / "checkpoints"))
        _create_tracking_schema()
        lines = []
        for name in args.workloads:
            line = run_workload(name, args.executors, args.set, args.check_equal, args.repeat)
            print(json.dumps(line), flush=True)
            lines.append(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
