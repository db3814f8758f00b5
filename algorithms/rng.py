"""Explicit, seeded randomness.

Every random draw in a simulation comes from a generator keyed by
``SeedSequence([seed, round, client_id, purpose, ...])``. Nothing reads global RNG state, so
results depend neither on the number of actors nor on the order in which clients are scheduled.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch


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


def _seed_words(seed: int, keys: tuple[int, ...]) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(seed), *(int(k) for k in keys)])


def numpy_rng(seed: int, *keys: int) -> np.random.Generator:
    """A NumPy generator for the stream ``(seed, *keys)``."""
    return np.random.default_rng(_seed_words(seed, keys))


def stream_seed(seed: int, *keys: int) -> int:
    """The 64-bit seed of the stream ``(seed, *keys)`` (for APIs that take a seed, not a
    generator, such as ``torch.manual_seed`` for dropout and model init)."""
    return int(_seed_words(seed, keys).generate_state(1, np.uint64)[0])


def torch_generator(seed: int, *keys: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator on ``device`` for the stream ``(seed, *keys)``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed, *keys))
    return generator
