"""Vectorised local training (algorithms/vectorized.py) is the sequential path, per client, up
to float rounding: same batches, steps, learning rate, loss and accuracy statistics; and a
whole run with ``executor.vectorize: true`` reaches the sequential run's weights and ε."""

import pytest
import torch
from helpers import small_config

from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, ModelObjective, SamGradient
from algorithms.rng import torch_generator
from algorithms.vectorized import train_clients, vectorizable
from cluster.experiment import run_experiment
from models import build_model

TOLERANCE = 1e-5


def _objective(name: str, shape: tuple[int, ...]) -> ModelObjective:
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    return ModelObjective(model, ParamLayout.of(model))


def _clients(n: int, records: int, shape: tuple[int, ...]):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(records, *shape, generator=g), torch.randint(0, 10, (records,), generator=g))
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    ("model", "shape", "trainer"),
    [
        ("logreg", (40,), LocalTrainer(lr=0.1, batch_size=10, local_steps=5)),
        ("logreg", (40,), LocalTrainer(lr=0.1, batch_size=8, local_epochs=2, momentum=0.9)),
        (
            "mnist_cnn",
            (1, 28, 28),
            LocalTrainer(lr=0.05, batch_size=16, local_steps=3, weight_decay=1e-3),
        ),
    ],
)
def test_vectorized_equals_sequential_per_client(model, shape, trainer):
    objective = _objective(model, shape)
    params = ParamLayout.flatten(objective.model)
    data = _clients(5, 30, shape)
    assert vectorizable(trainer, objective, [len(y) for _, y in data])
    fast = train_clients(
        trainer, objective, params, data, [torch_generator(0, 3, i) for i in range(5)]
    )
    for i, (x, y) in enumerate(data):
        slow = trainer.train(objective, params, x, y, torch_generator(0, 3, i))
        assert (fast[i].params - slow.params).abs().max() < TOLERANCE
        counts = (fast[i].steps, fast[i].seen, fast[i].correct)
        assert counts == (slow.steps, slow.seen, slow.correct)
        assert fast[i].loss_sum == pytest.approx(slow.loss_sum, rel=1e-5)
        assert fast[i].lr == slow.lr


def test_not_vectorized_where_it_would_compute_something_else():
    objective = _objective("logreg", (40,))
    plain = LocalTrainer(lr=0.1, batch_size=10, local_steps=5)
    assert not vectorizable(plain, objective, [30, 31])  # unequal batches across clients
    assert not vectorizable(plain, objective, [30])  # nothing to batch
    sam = LocalTrainer(lr=0.1, batch_size=10, local_steps=5, gradient=SamGradient(0.5))
    assert not vectorizable(sam, objective, [30, 30])
    dropout = _objective("reddi_cnn", (1, 28, 28))
    assert not vectorizable(plain, dropout, [30, 30])


def test_a_vectorized_run_matches_the_sequential_run(store_root, tmp_path, monkeypatch):
    import actors.client_host as client_host

    batches = []

    def counted(trainer, objective, params, data, generators):
        batches.append(len(data))
        return train_clients(trainer, objective, params, data, generators)

    monkeypatch.setattr(client_host, "train_clients", counted)
    options = (
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=0.5",
        "algorithm.noise_multiplier=1",
        "algorithm.local.momentum=0.5",
        f"checkpoint.dir={tmp_path}",
    )
    runs = {
        flag: run_experiment(small_config(store_root, *options, f"executor.vectorize={flag}"))
        for flag in ("false", "true")
    }
    assert batches == [5] * 5  # every round's cohort of 5 trained as one batch
    sequential, vectorized = runs["false"].result, runs["true"].result
    assert (sequential.params - vectorized.params).abs().max() < TOLERANCE
    assert [r.epsilon for r in sequential.history] == [r.epsilon for r in vectorized.history]
    assert [r.metrics["clip_fraction"] for r in sequential.history] == [
        r.metrics["clip_fraction"] for r in vectorized.history
    ]
