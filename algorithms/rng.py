"""Explicit, seeded randomness.

Every random draw in a simulation comes from a generator keyed by
``SeedSequence([seed, round, client_id, purpose, ...])`` (a CPU torch generator gets MT19937's
whole state from its pool, not a 32-bit seed: ``algorithms.mt_state``). Nothing reads global
RNG state it did not seed first (dropout and model initialisation seed torch's global generator
from their own stream), so results depend neither on the number of actors nor on the order in
which clients are scheduled.
A run's secret key (``privacy.secret_streams``) keys them cryptographically instead
(``algorithms.secret_streams``), through the same functions.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from algorithms import secret_streams
from algorithms.mt_state import cpu_generator, mt_words


class Purpose(IntEnum):
    """Distinct streams so that, e.g., turning noise off never shifts the data-sampling stream."""

    MODEL_INIT = 1
    COHORT = 2
    LOCAL_TRAINING = 3
    CLIENT_NOISE = 4
    SERVER_NOISE = 5
    DATA = 6
    AUGMENT = 7
    DROPOUT = 8
    SHARED_MASK = 9
    LUS_BATCH = 10
    SAMPLE_NOISE = 11  # per-step DP-SGD noise inside a client
    CLIP_BIT = 12  # the noise on a client's adaptive-clip bit (DPSFL-AC)
    SERVER_COUNT_NOISE = 13  # server-placed noise on the adaptive clip's count
    LUS_MASK = 14  # LUS's random-mask ablation (lus_score: random)


def _seed_words(seed: int, keys: tuple[int, ...]) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(seed), *(int(k) for k in keys)])


def numpy_rng(seed: int, *keys: int) -> np.random.Generator:
    """A NumPy generator for the stream ``(seed, *keys)``."""
    if secret_streams.is_secret(seed):
        return secret_streams.numpy_rng(seed, keys)
    return np.random.default_rng(_seed_words(seed, keys))


def stream_seed(seed: int, *keys: int) -> int:
    """The 64-bit seed of the stream ``(seed, *keys)`` (for APIs that take a seed, not a
    generator, such as ``torch.manual_seed`` for dropout and model init, and a GPU generator)."""
    if secret_streams.is_secret(seed):
        return secret_streams.stream_seed(seed, keys)
    return int(_seed_words(seed, keys).generate_state(1, np.uint64)[0])


def torch_generator(seed: int, *keys: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator on ``device`` for the stream ``(seed, *keys)``: on the CPU, MT19937's
    whole state from ``SeedSequence([seed, *keys])``'s pool (``algorithms.mt_state``); on a
    GPU, Philox seeded with ``stream_seed(seed, *keys)``."""
    if secret_streams.is_secret(seed):
        return secret_streams.torch_generator(seed, keys, device)
    if torch.device(device).type == "cpu":
        return _cpu_generator(_seed_words(seed, keys).pool)
    return _gpu_generators([stream_seed(seed, *keys)], device)[0]


def _gpu_generators(seeds, device: str | torch.device) -> list[torch.Generator]:
    generators = [torch.Generator(device=device) for _ in seeds]
    for generator, seed in zip(generators, seeds, strict=True):
        generator.manual_seed(int(seed))
    return generators


def client_generators(
    seed: int, round_index: int, client_ids: list[int], purpose: Purpose, device="cpu"
) -> list[torch.Generator]:
    """``torch_generator(seed, round_index, c, purpose)`` for every client c, with the streams
    of all clients computed at once (``pools``): a round's thousand clients cost one
    pass over arrays instead of a thousand ``SeedSequence`` objects (≈ 30 µs each)."""
    if secret_streams.is_secret(seed):
        return [torch_generator(seed, round_index, c, purpose, device=device) for c in client_ids]
    keys = np.array([[seed, round_index, c, purpose] for c in client_ids], dtype=object).reshape(
        -1, 4
    )
    if torch.device(device).type == "cpu":
        return [_cpu_generator(pool) for pool in pools(keys)]
    return _gpu_generators(stream_seeds(keys), device)


def _cpu_generator(pool: np.ndarray) -> torch.Generator:
    """A CPU generator whose MT19937 state is SHAKE-128 of a SeedSequence pool (4 uint32)."""
    return cpu_generator(mt_words(pool.astype("<u4").tobytes()))


# NumPy's SeedSequence (numpy/random/bit_generator.pyx), pool of 4 uint32 words.
_MASK32 = 0xFFFFFFFF
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715


def _word_columns(keys: np.ndarray) -> np.ndarray | None:
    """``keys`` (n × k, integers ≥ 0) as uint32 words (uint64 columns: a product of two words
    fits before masking), each key spread over as many columns as it has words (SeedSequence:
    at least one, little-endian); None where a column's rows differ in that number."""
    columns = []
    for j in range(keys.shape[1]):
        values = [int(v) for v in keys[:, j]]
        if min(values) < 0:
            return None
        counts = {max(1, (v.bit_length() + 31) // 32) for v in values}
        if len(counts) > 1:
            return None
        for word in range(counts.pop()):
            columns.append([(v >> (32 * word)) & _MASK32 for v in values])
    return np.array(columns, dtype=np.uint64).T


def stream_seeds(keys: np.ndarray) -> np.ndarray:
    """``stream_seed(*row)`` for every row of ``keys`` (n × k), vectorised over the rows:
    ``generate_state(1, uint64)`` of each row's pool (``pools``), its first two uint32 words."""
    pool = pools(keys).astype(np.uint64)
    hash_const, words = _INIT_B, []
    for word in (pool[:, 0], pool[:, 1]):
        value = word ^ np.uint64(hash_const)
        hash_const = (hash_const * _MULT_B) & _MASK32
        value = (value * np.uint64(hash_const)) & np.uint64(_MASK32)
        words.append(value ^ (value >> np.uint64(16)))
    return words[0] | (words[1] << np.uint64(32))


def pools(keys: np.ndarray) -> np.ndarray:
    """The pool of ``SeedSequence(row)`` (n × 4, uint32) for every row of ``keys`` (n × k),
    vectorised over the rows.

    This is SeedSequence's entropy mixing step for step, on columns of uint32 words: its hash
    constants do not depend on the data, so every row follows the same sequence of
    operations. A key of several words (a seed ≥ 2³², such as a sweep trial's
    ``stream_seed``) is its little-endian words, as SeedSequence reads it; a column whose rows
    differ in their number of words (or hold a negative key) takes SeedSequence row by row.
    Bit-identical to it (``tests/test_rng.py``)."""
    keys = np.asarray(keys, dtype=object)
    if keys.shape[0] == 0:
        return np.zeros((0, 4), dtype=np.uint32)
    words = _word_columns(keys)
    if words is None:
        return np.stack([np.random.SeedSequence([int(v) for v in row]).pool for row in keys])
    return _pool(words).astype(np.uint32)


def _pool(words: np.ndarray) -> np.ndarray:
    """SeedSequence's pool (n × 4) after mixing in each row's entropy ``words`` (n × k)."""
    n, k = words.shape
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint64(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = (value * np.uint64(hash_const)) & np.uint64(_MASK32)
        return value ^ (value >> np.uint64(16))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = (np.uint64(_MIX_MULT_L) * x - np.uint64(_MIX_MULT_R) * y) & np.uint64(_MASK32)
        return result ^ (result >> np.uint64(16))

    zeros = np.zeros(n, dtype=np.uint64)
    pool = [hashmix(words[:, i] if i < k else zeros) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, k):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(words[:, src]))
    return np.stack(pool, axis=1)
