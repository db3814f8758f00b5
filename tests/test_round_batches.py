"""``fresh_batches`` and ``epoch_batches`` draw, for many clients at once, exactly
``LocalTrainer.batches``' batches (``randperm(n)[:b]`` per step; slices of a ``randperm(n)``
per epoch) and leave every generator where those calls leave it, in one slice of clients or in
several (``SWAP_ENTRIES`` cut)."""

import pytest
import torch

import algorithms.round_batches as round_batches
from algorithms.local import LocalTrainer
from algorithms.round_batches import epoch_batches, fresh_batches

# one record, fewer than a batch, exactly a batch, odd K·(n − 1) (K = 3, n = 16 and 2), equal
# shapes sharing one draw, and large clients
SIZES = [1, 7, 10, 16, 2, 50, 50, 50, 1000]
STEPS = [3, 5, 10, 3, 3, 10, 10, 7, 2]


def _generators(seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(SIZES))]


@pytest.mark.parametrize("entries", [round_batches.SWAP_ENTRIES, 1, 40_000])  # all, 1 or 4
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("batch_size", [1, 3, 10, 64])
@pytest.mark.parametrize("sampling", ["fresh", "epoch"])
def test_round_batches_are_the_sequential_draws_bit_for_bit(
    monkeypatch, entries, seed, batch_size, sampling
):
    monkeypatch.setattr(round_batches, "SWAP_ENTRIES", entries)
    generators, reference = _generators(seed), _generators(seed)
    draw = fresh_batches if sampling == "fresh" else epoch_batches
    index, sizes = draw(SIZES, STEPS, batch_size, generators)
    assert index.shape == (len(SIZES), max(STEPS), min(batch_size, max(SIZES)))
    assert sizes.shape == index.shape[:2]
    for i, (size, steps) in enumerate(zip(SIZES, STEPS, strict=True)):
        trainer = LocalTrainer(
            lr=0.1, batch_size=batch_size, local_steps=steps, batch_sampling=sampling
        )
        expected = list(trainer.batches(size, reference[i]))
        assert sizes[i].tolist() == [len(b) for b in expected] + [0] * (max(STEPS) - steps)
        for k, batch in enumerate(expected):
            assert torch.equal(index[i, k, : len(batch)], batch)
            assert not index[i, k, len(batch) :].any()  # padding 0
        assert not index[i, steps:].any()
        assert torch.equal(generators[i].get_state(), reference[i].get_state())


@pytest.mark.parametrize("draw", [fresh_batches, epoch_batches])
def test_clients_with_no_steps_get_no_batches_and_draw_nothing(draw):
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    states = [g.get_state() for g in generators]
    index, sizes = draw([5, 3], [0, 0], 2, generators)
    assert index.shape == (2, 0, 2) and sizes.shape == (2, 0)
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True))


@pytest.mark.parametrize("draw", [fresh_batches, epoch_batches])
def test_one_large_client_does_not_lengthen_the_others_shuffles(monkeypatch, draw):
    """Clients are shuffled in chunks of similar sizes: 200 clients of 20 rows beside one of
    30,000 make shuffles of [200, 1, ≤ 20] and [1, 1, ≤ 30000] entries, not [201, 1, 30000]
    (which, with 1,000 clients of 20 and one of 50,000, took 400 MB)."""
    shapes = []
    shuffles = round_batches._shuffles

    def recorded(sizes, draws, generators, width):
        perm = shuffles(sizes, draws, generators, width)
        shapes.append(tuple(perm.shape))
        return perm

    monkeypatch.setattr(round_batches, "_shuffles", recorded)
    sizes, steps = [20] * 200 + [30_000], [1] * 201
    generators = [torch.Generator().manual_seed(i) for i in range(201)]
    reference = [torch.Generator().manual_seed(i) for i in range(201)]
    index, counts = draw(sizes, steps, 10, generators)
    assert sorted(shapes) == [(1, 1, 30_000), (200, 1, 20)]
    sampling = "fresh" if draw is fresh_batches else "epoch"
    for i in (0, 199, 200):  # the chunks' results land in their clients' rows
        trainer = LocalTrainer(lr=0.1, batch_size=10, local_steps=1, batch_sampling=sampling)
        (expected,) = trainer.batches(sizes[i], reference[i])
        assert torch.equal(index[i, 0], expected) and counts[i, 0] == 10
