"""Vectorised local training (algorithms/vectorized.py) is the sequential path, per client, up
to float rounding: same batches, steps, learning rate, loss and accuracy statistics; and a
whole run with ``executor.vectorize: true`` reaches the sequential run's weights and ε."""

import pytest
import torch
from helpers import small_config

from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, ModelObjective, SamGradient
from algorithms.rng import torch_generator
from algorithms.vectorized import ClientRows, train_clients, vectorizable
from cluster.runtime.experiment import run_experiment
from cluster.runtime.store import open_store
from models import build_model

TOLERANCE = 1e-5
# The CNN's ReLUs and max-pools amplify rounding where an activation sits at a kink: one client
# of 30 rows (momentum 0.5, two steps) differs by 2.6e-5 in most rounds' batches, before and
# after the CPU streams' seeding changed (f4c90ca), against updates of ≈ 1e-2; a wrong batch,
# step or learning rate differs by the update's size.
TOLERANCE_KINKED = 1e-4


def _objective(name: str, shape: tuple[int, ...]) -> ModelObjective:
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    return ModelObjective(model, ParamLayout.of(model))


def _clients(sizes: list[int], shape: tuple[int, ...]):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(records, *shape, generator=g), torch.randint(0, 10, (records,), generator=g))
        for records in sizes
    ]


EQUAL = [30] * 5
# Dirichlet-like: one record, fewer than a batch, exact batches, a ragged last batch.
UNEQUAL = [30, 1, 7, 16, 45, 30, 23]


@pytest.mark.parametrize(
    ("model", "shape", "trainer", "sizes"),
    [
        ("logreg", (40,), LocalTrainer(lr=0.1, batch_size=10, local_steps=5), EQUAL),
        (
            "logreg",
            (40,),
            LocalTrainer(lr=0.1, batch_size=8, local_epochs=2, momentum=0.9),
            EQUAL,
        ),
        (
            "mnist_cnn",
            (1, 28, 28),
            LocalTrainer(lr=0.05, batch_size=16, local_steps=3, weight_decay=1e-3),
            EQUAL,
        ),
        # Unequal sizes: masked batches, different step counts and (inverse_sk) learning rates.
        (
            "logreg",
            (40,),
            LocalTrainer(lr=0.1, batch_size=8, local_epochs=2, momentum=0.9, weight_decay=1e-3),
            UNEQUAL,
        ),
        (
            "logreg",
            (40,),
            LocalTrainer(
                lr=0.1, batch_size=8, local_steps=4, batch_sampling="fresh", lr_scaling="inverse_sk"
            ),
            UNEQUAL,
        ),
        (
            "mnist_cnn",
            (1, 28, 28),
            LocalTrainer(lr=0.05, batch_size=16, local_epochs=1, momentum=0.5),
            UNEQUAL,
        ),
    ],
)
def test_vectorized_equals_sequential_per_client(model, shape, trainer, sizes):
    objective = _objective(model, shape)
    params = ParamLayout.flatten(objective.model)
    data = _clients(sizes, shape)
    assert vectorizable(trainer, objective)
    generators = [torch_generator(0, 3, i) for i in range(len(data))]
    fast = train_clients(trainer, objective, params, ClientRows.concatenated(data), generators)
    evals = objective.grad_evals
    for i, (x, y) in enumerate(data):
        slow = trainer.train(objective, params, x, y, torch_generator(0, 3, i))
        tolerance = TOLERANCE if model == "logreg" else TOLERANCE_KINKED
        assert (fast[i].params - slow.params).abs().max() < tolerance
        counts = (fast[i].steps, fast[i].seen, fast[i].correct)
        assert counts == (slow.steps, slow.seen, slow.correct)
        assert fast[i].loss_sum == pytest.approx(slow.loss_sum, rel=1e-5)
        assert fast[i].lr == slow.lr
    assert objective.grad_evals == 2 * evals  # one evaluation per client step, both ways


def test_chunks_group_clients_of_similar_step_counts(monkeypatch):
    """Chunked (a tiny chunk budget), unequal clients still match the sequential path."""
    import algorithms.vectorized as vectorized

    objective = _objective("logreg", (40,))
    params = ParamLayout.flatten(objective.model)
    monkeypatch.setattr(vectorized, "MAX_CHUNK_FLOATS", 3 * params.numel())
    trainer = LocalTrainer(lr=0.1, batch_size=8, local_epochs=1)
    data = _clients(UNEQUAL, (40,))
    generators = [torch_generator(1, 0, i) for i in range(len(data))]
    fast = train_clients(trainer, objective, params, ClientRows.concatenated(data), generators)
    for i, (x, y) in enumerate(data):
        slow = trainer.train(objective, params, x, y, torch_generator(1, 0, i))
        assert (fast[i].params - slow.params).abs().max() < TOLERANCE
        assert fast[i].steps == slow.steps


def test_clients_read_in_place_train_as_clients_concatenated():
    """A host's preloaded clients are row ranges of one block, read where they lie in any
    order (``ClientDataCache.rows``); others are concatenated: the same batches and weights,
    bit for bit."""
    objective = _objective("logreg", (40,))
    params = ParamLayout.flatten(objective.model)
    trainer = LocalTrainer(lr=0.1, batch_size=8, local_epochs=2, momentum=0.5)
    data = _clients(UNEQUAL, (40,))
    block = ClientRows.concatenated(data)
    order = [3, 0, 6, 1, 5, 2, 4]
    in_place = block.of(order)
    assert in_place.x is block.x and in_place.starts != sorted(in_place.starts)
    rows = (in_place, ClientRows.concatenated([data[i] for i in order]))
    results = [
        train_clients(trainer, objective, params, r, [torch_generator(2, 0, i) for i in order])
        for r in rows
    ]
    for fast, slow in zip(*results, strict=True):
        assert torch.equal(fast.params, slow.params)
        assert (fast.loss_sum, fast.correct, fast.seen) == (slow.loss_sum, slow.correct, slow.seen)


def test_not_vectorized_where_it_would_compute_something_else():
    objective = _objective("logreg", (40,))
    plain = LocalTrainer(lr=0.1, batch_size=10, local_steps=5)
    assert vectorizable(plain, objective)
    sam = LocalTrainer(lr=0.1, batch_size=10, local_steps=5, gradient=SamGradient(0.5))
    assert not vectorizable(sam, objective)
    poisson = LocalTrainer(lr=0.1, batch_size=10, local_steps=5, batch_sampling="poisson")
    assert not vectorizable(poisson, objective)  # an empty batch is not a masked mean
    dropout = _objective("reddi_cnn", (1, 28, 28))
    assert not vectorizable(plain, dropout)
    with pytest.raises(ValueError, match="at least one record"):
        empty = ClientRows.concatenated(_clients([3, 0], (40,)))
        train_clients(plain, objective, torch.zeros(410), empty, [None, None])


@pytest.mark.parametrize(
    "data",
    [
        (),  # equal clients, 5 local steps
        # Dirichlet over classes: unequal clients, one local epoch (unequal step counts)
        (
            "data.partition.method=dirichlet_class",
            "data.partition.alpha=0.3",
            "data.partition.min_size=5",
            "algorithm.local.local_steps=null",
            "algorithm.local.local_epochs=1",
        ),
    ],
)
def test_a_vectorized_run_matches_the_sequential_run(store_root, tmp_path, monkeypatch, data):
    import actors.client_host as client_host

    batches = []

    def counted(trainer, objective, params, clients, *streams):
        batches.append(len(clients.sizes))
        return train_clients(trainer, objective, params, clients, *streams)

    monkeypatch.setattr(client_host, "train_clients", counted)
    options = (
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=0.5",
        "algorithm.noise_multiplier=1",
        "algorithm.local.momentum=0.5",
        f"checkpoint.dir={tmp_path}",
        "executor.num_actors=1",  # one host: a round's cohort is one vmapped batch
        *data,
    )
    configs = {
        flag: small_config(store_root, *options, f"executor.vectorize={flag}")
        for flag in ("false", "true")
    }
    sizes = open_store(configs["true"])[0].client_sizes
    assert (len(set(sizes.tolist())) > 1) == bool(data)
    runs = {flag: run_experiment(config) for flag, config in configs.items()}
    assert batches == [5] * 5  # every round's cohort of 5 trained as one batch
    sequential, vectorized = runs["false"].result, runs["true"].result
    assert (sequential.params - vectorized.params).abs().max() < TOLERANCE
    assert [r.epsilon for r in sequential.history] == [r.epsilon for r in vectorized.history]
    assert [r.metrics["clip_fraction"] for r in sequential.history] == [
        r.metrics["clip_fraction"] for r in vectorized.history
    ]


def test_an_empty_cohort_trains_no_client():
    objective = _objective("logreg", (40,))
    params = ParamLayout.flatten(objective.model)
    trainer = LocalTrainer(lr=0.1, batch_size=8, local_steps=2)
    assert train_clients(trainer, objective, params, ClientRows.concatenated([]), []) == []
