"""Micro-benchmarks behind ``benchmarks.overhead`` (its ``--micro-repeats``): where a
``LocalExecutor`` round's time goes, component by component (local steps, the project's trainer
against plain PyTorch, generators, accountant, evaluation), timed round-robin, medians and
minima."""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch
from torch import nn

from cluster.config import ExperimentConfig
from cluster.runtime.executors import torch_threads


def _median(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` calls."""
    return _compare({"fn": fn}, repeats, warmup)["fn"]["median"]


def _compare(fns: dict, repeats: int, warmup: int = 3) -> dict[str, dict[str, float]]:
    """Median and min seconds per call of each function, timed round-robin so that a change in
    machine load (other processes) hits every candidate alike. On a shared machine the min is
    the better estimate of the intrinsic cost, the median of what a run sees."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: {"median": statistics.median(v), "min": min(v)} for name, v in samples.items()}


def _per_step(seconds: dict[str, float], k: int) -> dict[str, float]:
    return {
        "seconds_per_client_median": seconds["median"],
        "us_per_step_median": 1e6 * seconds["median"] / k,
        "us_per_step_min": 1e6 * seconds["min"] / k,
    }


def microbench(config: ExperimentConfig, store, repeats: int) -> dict:
    """Where a LocalExecutor round's time goes, component by component (medians)."""
    from actors.client_host import ClientHost, build_model
    from algorithms.client import client_round
    from algorithms.layout import ParamLayout
    from algorithms.local import ModelObjective
    from algorithms.rng import Purpose, torch_generator
    from cluster.runtime.executors import LocalExecutor
    from privacy.accountant import RdpAccountant

    algorithm = config.build_algorithm()
    trainer, local = algorithm.trainer, config.algorithm.local
    k = trainer.local_steps
    model = build_model(store, config.task)
    objective = ModelObjective(model, ParamLayout.of(model))
    params = ParamLayout.flatten(model)
    arrays = store.client(0)
    x, y = torch.tensor(arrays.x), torch.tensor(arrays.y)
    seed = config.seed

    def project_train():  # algorithms/local.py: functional_call on a flat vector
        trainer.train(objective, params, x, y, torch_generator(seed, 0, 0, Purpose.LOCAL_TRAINING))

    def module_sgd():  # nn.Module + torch.optim.SGD, same batches
        g = torch_generator(seed, 0, 0, Purpose.LOCAL_TRAINING)
        client = copy.deepcopy(model)
        opt = torch.optim.SGD(client.parameters(), lr=local.lr)
        for idx in trainer.batches(len(y), g):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(client(x[idx]), y[idx]).backward()
            opt.step()

    out_features, in_features = model.linear.weight.shape

    def flat_no_functional_call():  # flat vector + F.linear on views: no functional_call
        g = torch_generator(seed, 0, 0, Purpose.LOCAL_TRAINING)
        w = params.clone()
        for idx in trainer.batches(len(y), g):
            w = w.detach().requires_grad_(True)
            weight = w[: out_features * in_features].view(out_features, in_features)
            logits = nn.functional.linear(x[idx], weight, w[out_features * in_features :])
            loss = nn.functional.cross_entropy(logits, y[idx])
            (grad,) = torch.autograd.grad(loss, w)
            w = w.detach() - local.lr * grad

    host = ClientHost(str(store.path), config.task, algorithm, seed, [0])
    payload: dict = {}

    def project_client_round():  # train + generators + clip + report
        client_round(algorithm, host.objective, params, payload, x, y, {}, seed, 0, 0, 20.0)

    result: dict = {"local_steps_per_client": k, "repeats": repeats}
    paths = {
        "project_LocalTrainer_functional_call": project_train,
        "plain_nn_module_torch_optim_sgd": module_sgd,
        "flat_vector_F_linear_no_functional_call": flat_no_functional_call,
        "project_client_round_total": project_client_round,
    }
    for name, seconds in _compare(paths, repeats).items():
        result[name] = _per_step(seconds, k)
    new_generator = lambda: torch_generator(seed, 3, 7, Purpose.LOCAL_TRAINING)  # noqa: E731
    result["torch_generator_us_median"] = 1e6 * _median(new_generator, repeats * 10)

    # Intra-op threads: the driver (LocalExecutor) runs with whatever torch defaults to.
    by_threads = {}
    for n in sorted({1, os.cpu_count() or 1}):
        with torch_threads(n):
            medians = _compare({"project": project_train, "plain": module_sgd}, repeats)
        by_threads[str(n)] = {
            "project_LocalTrainer": _per_step(medians["project"], k),
            "plain_module_sgd": _per_step(medians["plain"], k),
        }
    result["by_torch_threads"] = by_threads

    # The accountant: Simulation asks for ε after every round (Opacus recomputes the RDP curve).
    def account():
        acc = RdpAccountant()
        acc.step(config.algorithm.noise_multiplier, config.sample_rate, rounds=config.rounds)
        acc.epsilon(config.delta)

    few = max(3, repeats // 5)
    result["rdp_accountant_epsilon_seconds"] = _median(account, few, 1)

    executor = LocalExecutor(store, config.task, algorithm, seed)
    flat = params.numpy()
    result["local_executor_evaluate_seconds"] = _median(lambda: executor.evaluate(flat), few, 1)
    test = store.test_rows()
    x_test, y_test = torch.tensor(test.x).flatten(1), torch.tensor(test.y)

    def plain_eval():
        with torch.no_grad():
            logits = model(x_test)
            float((logits.argmax(1) == y_test).float().mean())
            float(nn.functional.cross_entropy(logits, y_test))

    result["plain_evaluate_seconds"] = _median(plain_eval, few, 1)
    m, every = config.cohort.size, config.eval_every
    result["estimated_local_round_seconds"] = {
        "clients": m * result["project_client_round_total"]["seconds_per_client_median"],
        "accountant": result["rdp_accountant_epsilon_seconds"],
        "evaluation_amortized": result["local_executor_evaluate_seconds"] / every,
    }
    return result
