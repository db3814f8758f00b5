"""benchmarks/workloads.py compares like with like: at σ = 0 the project and the plain PyTorch
loop end with the same weights (float rounding: the project trains on a flat parameter vector
through ``functional_call``, the loop on an ``nn.Module`` with ``torch.optim.SGD``).

A is checked on the loop's kernels, where they agree bit for bit: one client at a time, NCHW
convolutions, one intra-op thread (oneDNN picks its kernels by layout and thread count). A's CNN
max-pools, so its trajectory amplifies any other kernel's rounding by an amount that depends on
the CPU (after 3 rounds, NHWC against NCHW: 3e-8 on the CPU it was written on, 7.6e-5 on an AMD
EPYC); tests/test_kernels.py and tests/test_vectorized.py check those kernels per client, where
nothing amplifies. B, a logistic regression, is smooth and is checked as configured by default
(vectorised)."""

from pathlib import Path

import pytest

from benchmarks.workload_s import plain_dp_sgd_loop
from benchmarks.workloads import (
    MNIST_ROOT,
    plain_loop,
    project,
    run_workload,
    workload_config,
)
from cluster.runtime.executors import torch_threads
from cluster.runtime.store import open_store

TOLERANCE = 1e-5  # max |Δw| after 3 rounds; seen: 0 (A), 0 (B) (2026-11-28; 1.5e-8 on B before)


@pytest.mark.parametrize("name", ["A", "B"])
def test_project_and_plain_loop_reach_the_same_weights(name, store_root, tmp_path, monkeypatch):
    if name == "A" and not (MNIST_ROOT / "MNIST").is_dir():
        pytest.skip(f"workload A reads the MNIST test split from {MNIST_ROOT} (../shared absent)")
    monkeypatch.setenv("DPFL_CHECKPOINT_DIR", str(tmp_path))
    small = {
        "A": ["data.num_clients=100", "executor.channels_last=false"],
        "B": ["data.num_clients=200", "cohort.size=20"],
    }
    config = workload_config(
        name,
        [
            *small[name],
            f"data.store_root={store_root}",
            "algorithm.noise_multiplier=0",
            "rounds=3",
            "eval_every=3",
            "tracking.enabled=false",
        ],
    )
    store, _ = open_store(config)
    ours, project_timing = project(config, {"A": "local_sequential", "B": "local"}[name])
    with torch_threads(1):  # the project's hosts' intra-op threads (oneDNN's kernels vary)
        theirs, plain_timing = plain_loop(config, store)
    assert (ours - theirs).abs().max() < TOLERANCE
    for timing in (project_timing, plain_timing):  # start-up, rounds and end: the wall time
        parts = ("startup_seconds", "rounds_seconds", "end_seconds")
        assert all(timing[part] > 0 for part in parts)
        total = sum(timing[part] for part in parts)
        assert total == pytest.approx(timing["wall_seconds"], rel=0.05)
    assert project_timing["final_test_accuracy"] == pytest.approx(
        plain_timing["final_test_accuracy"], abs=1e-3
    )


def test_workload_s_plain_loop_draws_the_projects_batches_and_noise(
    store_root, tmp_path, monkeypatch
):
    """Workload S with its DP-SGD noise on (σ_g = 1, per-step std 2 on the sum) and
    ``NOISE_BLOCK_FLOATS`` cut to blocks of R = 3 < K = 10 rows (d = 410: 40 features × 10
    classes + 10): the plain loop and the project's vectorised and sequential paths end with
    the same weights, so the loop draws the project's fresh batches and noise (another draw
    would move the weights by the noise's size, ≈ 0.2 a step)."""
    import algorithms.dpsgd as dpsgd

    monkeypatch.setattr(dpsgd, "NOISE_BLOCK_FLOATS", 3 * 410)
    monkeypatch.setenv("DPFL_CHECKPOINT_DIR", str(tmp_path))
    small = ["data.num_clients=200", "cohort.size=20", "rounds=2", "eval_every=2"]
    options = [*small, f"data.store_root={store_root}", "tracking.enabled=false"]
    config = workload_config("S", options)
    store, _ = open_store(config)
    theirs, _ = plain_dp_sgd_loop(config, store)
    assert dpsgd.noise_block_rows(theirs.numel(), 10) == 3
    for executor in ("local_vectorized", "local_sequential"):
        ours, _ = project(config, executor)
        assert (ours - theirs).abs().max() < TOLERANCE, executor


@pytest.mark.slow  # ≈ 45 s: a benchmark's repeat logic, run with the benchmarks
def test_repeats_alternate_and_report_medians(store_root, tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CHECKPOINT_DIR", str(tmp_path))
    small = ["data.num_clients=200", "cohort.size=20", "rounds=3", "eval_every=3"]
    options = [*small, f"data.store_root={store_root}", "tracking.enabled=false"]
    line = run_workload("B", ["local"], options, check_equal=False, repeat=2)
    ours, plain = line["project_local"], line["plain_loop"]
    assert len(ours["repeats"]) == len(plain["repeats"]) == 2
    for timing in (ours, plain):
        for key in ("wall_seconds", "seconds_per_round", "process_seconds"):
            assert timing[key] == pytest.approx(sum(r[key] for r in timing["repeats"]) / 2)
        # The child process's whole life, its imports included, as a user waits for it.
        assert all(r["process_seconds"] > r["wall_seconds"] for r in timing["repeats"])
    pairs = zip(ours["repeats"], plain["repeats"], strict=True)
    ratios = sorted(a["seconds_per_round"] / b["seconds_per_round"] for a, b in pairs)
    assert line["ratio_local"]["seconds_per_round"] == pytest.approx(sum(ratios) / 2)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread CPU needs Linux /proc")
def test_round_cpu_reads_the_threads_cpu_between_two_rounds(store_root, tmp_path, monkeypatch):
    """benchmarks/round_cpu.py: the CPU of two host threads (the training), the driver and the
    rest, per round between two rounds' records; the floor is their total over the cores."""
    import threading

    from benchmarks.round_cpu import round_cpu, thread_cpu_seconds

    monkeypatch.setenv("DPFL_CHECKPOINT_DIR", str(tmp_path))
    small = ["data.num_clients=200", "cohort.size=20", f"data.store_root={store_root}"]
    line = round_cpu("B", [*small, "executor.num_actors=2"], first=2, last=5)
    assert line["host_threads"] == 2
    cpu = line["cpu_ms_per_round"]
    assert set(cpu) <= {"host", "driver", "other"} and cpu["host"] > 0
    assert line["total_cpu_ms_per_round"] == pytest.approx(sum(cpu.values()), abs=0.2)
    floor = line["total_cpu_ms_per_round"] / line["cores"]
    assert line["floor_ms_per_round"] == pytest.approx(floor, abs=0.1)
    assert line["wall_ms_per_round"] > 0
    assert threading.main_thread().native_id in thread_cpu_seconds()


def test_host_round_times_one_hosts_share_of_each_round(store_root):
    """benchmarks/host_round.py: a host of half the clients runs its members of each cohort."""
    from benchmarks.host_round import host_round_cpu

    small = ["data.num_clients=200", "cohort.size=20", f"data.store_root={store_root}"]
    line = host_round_cpu("B", small, rounds=3, profile=0)
    assert line["hosted_clients"] == 100
    assert 0 < line["clients_per_round"] < 20 and line["cpu_ms_per_round"] > 0
    assert line["cpu_ms_per_round_min"] <= line["cpu_ms_per_round"]
