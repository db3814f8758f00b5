"""Stream seeds computed for many clients at once equal NumPy's SeedSequence bit for bit; a
run's secret key (``privacy.secret_streams``) keys its streams cryptographically."""

import hashlib
import random

import numpy as np
import pytest
import torch

from algorithms import secret_streams
from algorithms.rng import (
    Purpose,
    client_generators,
    distinct_round_streams,
    numpy_rng,
    stream_seed,
    stream_seeds,
    torch_generator,
)


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


KEY = secret_streams.SECRET_FLOOR | 0x5EC2E7  # a secret key (its top bit set)


def test_a_cpu_stream_of_a_secret_key_holds_mt19937s_whole_state_from_its_material():
    """A public seed's CPU generator keeps 32 bits of its seed (MT19937's ``manual_seed``),
    and SeedSequence gave every stream of a 128-bit key the same 32 bits, which a search of
    2³² recovered (a review did, from released models). A secret key's CPU stream gets all
    624 state words, SHAKE-256 of the stream's keyed BLAKE2b material."""
    ids = (3, 7, Purpose.SERVER_NOISE)
    generator = torch_generator(KEY, *ids)
    words = generator.get_state().numpy()[24 : 24 + 8 * 624].view("<u8")
    material = secret_streams.material(KEY, ids)
    expected = np.frombuffer(hashlib.shake_256(material).digest(4 * 624), dtype="<u4")
    assert np.array_equal(words, expected)
    assert (
        material
        == hashlib.blake2b(
            b"".join(i.to_bytes(8, "little") for i in ids),
            key=KEY.to_bytes(16, "little"),
            digest_size=32,
        ).digest()
    )
    # Its draws are N(0, 1), and every bit of the key changes them.
    draws = torch.randn(100_000, generator=torch_generator(KEY, *ids), dtype=torch.float64)
    assert abs(float(draws.mean())) < 0.01 and abs(float(draws.std()) - 1) < 0.01
    first = draws[:8]
    for bit in range(127):
        other = torch.randn(
            8, generator=torch_generator(KEY ^ (1 << bit), *ids), dtype=torch.float64
        )
        assert not torch.equal(other, first)


def test_every_stream_function_keys_a_secret_cryptographically():
    ids = (4, 12, Purpose.CLIENT_NOISE)
    material = secret_streams.material(KEY, ids)
    assert stream_seed(KEY, *ids) == int.from_bytes(material[:8], "little")
    assert (
        numpy_rng(KEY, *ids).random()
        == np.random.default_rng(int.from_bytes(material, "little")).random()
    )
    clients = [0, 12, 2**40]
    for client, generator in zip(
        clients, client_generators(KEY, 4, clients, Purpose.CLIENT_NOISE), strict=True
    ):
        alone = torch_generator(KEY, 4, client, Purpose.CLIENT_NOISE)
        assert torch.equal(torch.randn(5, generator=generator), torch.randn(5, generator=alone))
    # A public seed keeps SeedSequence (runs repeat as before); the two never meet.
    assert stream_seed(11, *ids) == int(
        np.random.SeedSequence([11, *ids]).generate_state(1, np.uint64)[0]
    )
    assert not secret_streams.is_secret(2**63 - 1) and secret_streams.is_secret(KEY)


def test_rounds_whose_server_streams_would_coincide_are_kept_apart():
    """torch's CPU generator keeps 32 bits of a seed: at seed 0, two of 100,000 rounds'
    server-noise streams draw the same noise (T²/2³³ ≈ 1.2 expected pairs), which would make
    the difference of their releases noiseless. The later round is keyed apart; no other
    round's stream changes, and a secret key needs nothing."""
    noise = Purpose.SERVER_NOISE
    apart = distinct_round_streams(0, 100_000, noise)
    assert apart == {29994: (1,)}
    draws = {r: torch.randn(4, generator=torch_generator(0, r, noise)) for r in range(30_000)}
    same = [r for r in range(29994) if torch.equal(draws[r], draws[29994])]
    assert len(same) == 1  # the hazard, without the extra word
    kept = torch.randn(4, generator=torch_generator(0, 29994, noise, 1))
    assert not any(torch.equal(kept, d) for d in draws.values())
    assert distinct_round_streams(0, 29994, noise) == {}  # an earlier round: nothing changes
    assert distinct_round_streams(KEY, 100_000, noise) == {}
