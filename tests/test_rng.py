"""Stream seeds computed for many clients at once equal NumPy's SeedSequence bit for bit."""

import random

import numpy as np
import pytest
import torch

from algorithms.rng import Purpose, client_generators, stream_seed, stream_seeds, torch_generator


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 7])
def test_stream_seeds_equal_seed_sequence(width):
    draw = random.Random(width)
    values = [0, 1, 2**32 - 1, 12345]
    rows = [
        [draw.choice([*values, draw.randrange(2**32)]) for _ in range(width)] for _ in range(2000)
    ]
    expected = [int(np.random.SeedSequence(row).generate_state(1, np.uint64)[0]) for row in rows]
    assert [int(s) for s in stream_seeds(np.array(rows, dtype=object))] == expected


def test_keys_of_several_words_equal_seed_sequence():
    """A column of multi-word keys (a sweep trial's 60-bit stream seed beside round, client and
    purpose) is mixed vectorised; columns whose rows differ in word count fall back."""
    draw = random.Random(0)
    for first in (2**40 + 3, 2**59 + 12345, 2**63 - 1, 2**96 + 1):
        rows = [[first, draw.randrange(100), draw.randrange(2**32), 4] for _ in range(500)]
        expected = [stream_seed(*row) for row in rows]
        assert [int(s) for s in stream_seeds(np.array(rows, dtype=object))] == expected
    rows = np.array([[2**40 + 3, 1, 5], [7, 2**64 - 1, 0]], dtype=object)
    assert [int(s) for s in stream_seeds(rows)] == [stream_seed(*map(int, r)) for r in rows]
    assert len(stream_seeds(np.zeros((0, 4), dtype=object))) == 0


def test_client_generators_draw_what_torch_generator_draws():
    clients = [0, 3, 99, 4096]
    batch = client_generators(11, 7, clients, Purpose.CLIENT_NOISE)
    for client, generator in zip(clients, batch, strict=True):
        alone = torch_generator(11, 7, client, Purpose.CLIENT_NOISE)
        assert torch.equal(torch.randn(5, generator=generator), torch.randn(5, generator=alone))
