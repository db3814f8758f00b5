"""``fresh_batches`` draws, for many clients at once, exactly ``LocalTrainer.batches``' fresh
batches (``randperm(n)[:b]`` per step) and leaves every generator where those calls leave it,
in one slice of clients or in several (``SWAP_ENTRIES`` cut)."""

import pytest
import torch

import algorithms.fresh_batches as fresh
from algorithms.fresh_batches import fresh_batches
from algorithms.local import LocalTrainer

# one record, fewer than a batch, exactly a batch, odd K·(n − 1) (K = 3, n = 16 and 2), equal
# shapes sharing one draw, and large clients
SIZES = [1, 7, 10, 16, 2, 50, 50, 50, 1000]
STEPS = [3, 5, 10, 3, 3, 10, 10, 7, 2]


def _generators(seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(SIZES))]


@pytest.mark.parametrize("entries", [fresh.SWAP_ENTRIES, 1, 40_000])  # all, 1 or 4 a slice
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("batch_size", [1, 10, 64])
def test_fresh_batches_are_the_sequential_draws_bit_for_bit(monkeypatch, entries, seed, batch_size):
    monkeypatch.setattr(fresh, "SWAP_ENTRIES", entries)
    generators, reference = _generators(seed), _generators(seed)
    index, mask = fresh_batches(SIZES, STEPS, batch_size, generators)
    assert index.shape == (len(SIZES), max(STEPS), min(batch_size, max(SIZES)))
    for i, (size, steps) in enumerate(zip(SIZES, STEPS, strict=True)):
        trainer = LocalTrainer(
            lr=0.1, batch_size=batch_size, local_steps=steps, batch_sampling="fresh"
        )
        expected = list(trainer.batches(size, reference[i]))
        width = min(batch_size, size)
        assert mask[i].tolist() == [1.0] * width + [0.0] * (mask.shape[1] - width)
        for k, batch in enumerate(expected):
            assert torch.equal(index[i, k, :width], batch)
            assert not index[i, k, width:].any()  # padding 0
        assert torch.equal(generators[i].get_state(), reference[i].get_state())
