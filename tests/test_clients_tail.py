"""The batched tail of a vectorised round (algorithms/clients_tail.py) is ``client_round``'s
tail per client bit for bit: the same float64 sums, weights, counts and reports (norms, clip
stats, upload bytes, dropped clients); and a run with it ends where a run without it does."""

import math
from dataclasses import asdict

import pytest
import torch
from helpers import small_config

from algorithms.aggregate import PartialAggregate
from algorithms.algorithm import Algorithm
from algorithms.client import client_round
from algorithms.clients_tail import batchable, sum_trained_clients
from algorithms.layout import ParamLayout
from algorithms.local import LocalResult, LocalTrainer, ModelObjective
from algorithms.presets import ClientDP, dp_fedavg, fedavg, scaffold
from algorithms.server import MeanServerRule
from cluster.runtime.experiment import run_experiment
from models import build_model

TRAINER = LocalTrainer(lr=0.1, batch_size=10, local_steps=5)
SIZES = [50, 7, 50, 1, 23, 50, 50]


def _objective() -> ModelObjective:
    torch.manual_seed(0)
    model = build_model("logreg", (40,), 10)
    return ModelObjective(model, ParamLayout.of(model))


def _trained(params: torch.Tensor, broken: bool) -> list[LocalResult]:
    """Updates of norms around 1 (some clipped at C = 1, some not); one not finite if
    ``broken``."""
    g = torch.Generator().manual_seed(3)
    results = []
    for i, size in enumerate(SIZES):
        step = torch.randn(params.shape, generator=g) * (0.3 + 0.4 * i) / params.numel() ** 0.5
        if broken and i == 2:
            step[5] = math.inf
        results.append(LocalResult(params + step, 5, 1.7 * size, size // 3, size, 5, 0.1))
    return results


def _per_client(algorithm, objective, params, trained) -> PartialAggregate:
    """What ``ClientHost.run_round`` sums with ``client_round`` one client at a time."""
    partial = PartialAggregate()
    for cid, (size, result) in enumerate(zip(SIZES, trained, strict=True)):
        x, y = torch.zeros(size, 40), torch.zeros(size, dtype=torch.int64)
        uploads, weight, _, report = client_round(
            algorithm, objective, params, {}, x, y, {}, 0, 2, cid, 10.0, trained=result
        )
        if report.dropped:
            partial.add_noise_share(uploads)
        else:
            partial.add(uploads, weight)
        partial.reports.append(report)
    return partial


BATCHABLE = {
    "server noise": dp_fedavg(TRAINER, ClientDP(1.0, 1.0, "server")),
    "client placement, no noise": dp_fedavg(TRAINER, ClientDP(1.0, 0.0, "client")),
    "no mechanism, sample weights": fedavg(TRAINER, weighting="samples"),
    "clip and sample weights": Algorithm(
        "dp_fedavg", TRAINER, ClientDP(1.0, 1.0).pipeline(), MeanServerRule(1.0, "samples")
    ),
}


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("name", sorted(BATCHABLE))
def test_batched_tail_equals_each_clients_tail(name, broken):
    objective = _objective()
    algorithm = BATCHABLE[name].bind(objective.layout)
    assert batchable(algorithm)
    params = ParamLayout.flatten(objective.model)
    trained = _trained(params, broken)
    expected = _per_client(algorithm, objective, params, trained)
    batched = sum_trained_clients(algorithm, params, trained, list(range(len(SIZES))), SIZES)
    assert batched.sums.keys() == expected.sums.keys()
    assert all(torch.equal(batched.sums[k], expected.sums[k]) for k in expected.sums)
    assert (batched.weight, batched.count) == (expected.weight, expected.count)
    assert [repr(asdict(r)) for r in batched.reports] == [repr(asdict(r)) for r in expected.reports]
    assert batched.dropped == int(broken)
    if algorithm.pipeline.mechanism is not None:  # some clipped, some not
        assert {r.clipped for r in batched.reports if not r.dropped} == {0.0, 1.0}


def test_blocks_of_clients_sum_as_one(monkeypatch):
    import algorithms.clients_tail as clients_tail

    objective = _objective()
    algorithm = BATCHABLE["server noise"].bind(objective.layout)
    params = ParamLayout.flatten(objective.model)
    trained, ids = _trained(params, True), list(range(len(SIZES)))
    whole = sum_trained_clients(algorithm, params, trained, ids, SIZES)
    monkeypatch.setattr(clients_tail, "MAX_CHUNK_FLOATS", 2 * params.numel())
    blocks = sum_trained_clients(algorithm, params, trained, ids, SIZES)
    assert torch.equal(whole.sums["delta"], blocks.sums["delta"])
    assert [repr(asdict(r)) for r in whole.reports] == [repr(asdict(r)) for r in blocks.reports]


@pytest.mark.parametrize(
    "algorithm",
    [
        dp_fedavg(TRAINER, ClientDP(1.0, 1.0, "client")),  # each client's own noise
        dp_fedavg(TRAINER, ClientDP(1.0, 1.0, "local")),
        dp_fedavg(TRAINER, ClientDP(1.0, 1.0, clip_scope="layer")),
        scaffold(TRAINER),
    ],
)
def test_not_batched_where_the_tail_does_more(algorithm):
    assert not batchable(algorithm.bind(_objective().layout))


def test_rows_added_one_by_one():
    rows = torch.randn(6, 33) * torch.logspace(-4, 4, 6)[:, None]
    one_by_one = PartialAggregate()
    for row, weight in zip(rows, [1.0, 2.0, 3.0, 1.0, 1.0, 7.0], strict=True):
        one_by_one.add({"delta": row}, weight)
    together = PartialAggregate()
    together.add_rows("delta", rows[:2], [1.0, 2.0])
    together.add_rows("delta", rows[2:2], [])
    together.add_rows("delta", rows[2:], [3.0, 1.0, 1.0, 7.0])
    assert torch.equal(together.sums["delta"], one_by_one.sums["delta"])
    assert (together.weight, together.count) == (one_by_one.weight, one_by_one.count)


def test_a_run_ends_where_it_does_without_the_batched_tail(store_root, tmp_path, monkeypatch):
    import actors.client_host as client_host

    config = small_config(
        store_root,
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=0.3",
        "algorithm.noise_multiplier=1",
        "executor.vectorize=true",
        "executor.num_actors=1",
        f"checkpoint.dir={tmp_path}",
    )
    calls = []

    def counted(*args):
        calls.append(len(args[2]))
        return sum_trained_clients(*args)

    monkeypatch.setattr(client_host, "sum_trained_clients", counted)
    batched = run_experiment(config)
    assert calls == [5] * 5  # every round's cohort of 5 took the batched tail
    monkeypatch.setattr(client_host, "batchable", lambda algorithm: False)
    per_client = run_experiment(config)
    assert torch.equal(batched.result.params, per_client.result.params)
    for a, b in zip(batched.result.history, per_client.result.history, strict=True):
        assert (a.epsilon, a.metrics.keys()) == (b.epsilon, b.metrics.keys())
        assert all(a.metrics[k] == b.metrics[k] for k in a.metrics if "seconds" not in k)
        assert a.update_norms == b.update_norms
