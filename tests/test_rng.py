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
    numpy_rng,
    pools,
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


def _mt_state(generator: torch.Generator) -> np.ndarray:
    return generator.get_state().numpy()[24 : 24 + 8 * 624].view("<u8")


KEY = secret_streams.SECRET_FLOOR | 0x5EC2E7  # a secret key (its top bit set)


def test_a_cpu_stream_of_a_secret_key_holds_mt19937s_whole_state_from_its_material():
    """``manual_seed`` keeps 32 bits of a seed (MT19937), and SeedSequence gave every stream
    of a 128-bit key the same 32 bits, which a search of 2³² recovered (a review did, from
    released models). A secret key's CPU stream gets all
    624 state words, SHAKE-128 of the stream's keyed BLAKE2b material."""
    ids = (3, 7, Purpose.SERVER_NOISE)
    generator = torch_generator(KEY, *ids)
    words = _mt_state(generator)
    material = secret_streams.material(KEY, ids)
    expected = np.frombuffer(hashlib.shake_128(material).digest(4 * 624), dtype="<u4")
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
    # A public seed keys its streams through SeedSequence; the two never meet.
    assert stream_seed(11, *ids) == int(
        np.random.SeedSequence([11, *ids]).generate_state(1, np.uint64)[0]
    )
    assert not secret_streams.is_secret(2**63 - 1) and secret_streams.is_secret(KEY)


def test_a_cpu_stream_holds_the_shake_of_its_seed_sequences_whole_pool():
    """torch's ``manual_seed`` keeps 32 bits of a seed: at seed 0 the server-noise streams of
    rounds 12,288 and 29,994 have seeds that share their low 32 bits, and drew the same noise
    (two of 100,000 rounds: T²/2³³ ≈ 1.2 such pairs expected), which made the difference of
    their releases noiseless; two clients' noise the same for their uploads. A CPU stream now
    holds MT19937's whole state, SHAKE-128 of its SeedSequence's 128-bit pool, one at a time
    or a round's clients at once."""
    noise = Purpose.SERVER_NOISE
    low = [stream_seed(0, r, noise) & 0xFFFFFFFF for r in (12288, 29994)]
    assert low[0] == low[1]  # the pair that coincided
    first, later = (torch.randn(4, generator=torch_generator(0, r, noise)) for r in (12288, 29994))
    assert not torch.equal(first, later)

    def expected(*key: int) -> np.ndarray:
        pool = np.random.SeedSequence(list(key)).pool.astype("<u4").tobytes()
        return np.frombuffer(hashlib.shake_128(pool).digest(4 * 624), dtype="<u4")

    for ids in [(12288, noise), (7, 3, Purpose.CLIENT_NOISE), (2**40 + 1, 5, 99, 4)]:
        assert np.array_equal(_mt_state(torch_generator(0, *ids)), expected(0, *ids))
    clients = [0, 5, 2**33, 17]
    for client, generator in zip(
        clients, client_generators(9, 2, clients, Purpose.SAMPLE_NOISE), strict=True
    ):
        assert np.array_equal(_mt_state(generator), expected(9, 2, client, 11))
    draws = torch.randn(100_000, generator=torch_generator(3, 1, noise), dtype=torch.float64)
    assert abs(float(draws.mean())) < 0.01 and abs(float(draws.std()) - 1) < 0.01


def test_streams_sharing_a_pool_word_share_no_noise():
    """Read in turn (``generate_state``, NumPy's MT19937 seeding), each state word hangs on one
    32-bit pool word, and MT's first outputs mix words of one residue mod 4: two client-noise
    streams of seed 0 that share pool word 0 drew 18 equal float32 noise coordinates of 10,000
    (a review found ≈ n²/2³¹ such pairs in a run). From SHAKE of the whole pool: none."""
    a, b = (0, 434, 6, Purpose.CLIENT_NOISE), (0, 763, 37, Purpose.CLIENT_NOISE)
    pool_a, pool_b = (np.random.SeedSequence(list(k)).pool for k in (a, b))
    assert pool_a[0] == pool_b[0] and not np.array_equal(pool_a, pool_b)
    drawn = [torch.randn(10_000, generator=torch_generator(*k)) for k in (a, b)]
    assert int((drawn[0] == drawn[1]).sum()) == 0


def test_pools_equal_seed_sequences():
    draw = random.Random(5)
    for width in (3, 4):
        rows = [[draw.randrange(2**32) for _ in range(width)] for _ in range(50)]
        expected = [np.random.SeedSequence(row).pool for row in rows]
        assert np.array_equal(pools(np.array(rows, dtype=object)), np.array(expected))
    mixed = np.array([[2**40, 1], [3, 2**64 - 1]], dtype=object)  # row by row
    assert np.array_equal(
        pools(mixed), [np.random.SeedSequence([int(v) for v in r]).pool for r in mixed]
    )
