"""torch CPU generators given MT19937's whole state, not a 32-bit seed.

torch's CPU generator is MT19937, and ``manual_seed`` keeps only the low 32 bits of a seed
(``init_genrand``): a run's streams would have 2³² possible states, so two of its n streams
would draw the same values with probability ≈ n²/2³³ (≈ 1.2 pairs expected over 100 clients a
round for 1,000 rounds). Two clients' noise drawn alike would make the difference of their
uploads noiseless to the server. Here every stream's generator gets its 624 state words
instead, SHAKE-128 of the stream's 128-bit SeedSequence pool (``mt_words``; a secret stream's:
of its keyed digest, ``algorithms.secret_streams``), written through the state that
``get_state`` returns, at the layout checked once against torch's own seeding
(``seeded_template``). Two streams then coincide, wholly or in part, only where their pools do
(≈ n²/2¹²⁹).
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

MT_WORDS = 624
_OFFSET = 24  # MT19937's words, a uint64 each, from byte 24 of torch's saved state


def mt_words(material: bytes) -> np.ndarray:
    """MT19937's 624 state words for a stream: SHAKE-128 of its ``material`` (the 16 bytes of a
    public stream's SeedSequence pool, or a secret stream's keyed digest), so that every word
    depends on all of it. (Reading the pool's words in turn, as ``generate_state`` and
    NumPy's own MT19937 seeding do, makes each state word a function of one 32-bit pool word:
    two streams sharing one drew some equal float32 noise, a review found, ≈ n²/2³¹ pairs.)"""
    return np.frombuffer(hashlib.shake_128(material).digest(4 * MT_WORDS), dtype="<u4")


def cpu_generator(words: np.ndarray) -> torch.Generator:
    """A CPU generator whose MT19937 state is the 624 ``words`` (values < 2³²); its first draw
    twists them, as after ``manual_seed``. It reports ``initial_seed()`` 0, the template's:
    its state is not a seed's."""
    state = seeded_template().copy()  # a buffer of its own: set_state reads from its start
    state.view("<u8")[_OFFSET // 8 : _OFFSET // 8 + MT_WORDS] = words
    generator = torch.Generator()
    generator.set_state(torch.from_numpy(state))
    return generator


@functools.cache
def seeded_template() -> np.ndarray:
    """A CPU generator's state just after ``manual_seed`` (``left`` 1, ``next`` 0: the first
    draw twists the words ``cpu_generator`` sets), made once. Its layout is checked: after
    ``manual_seed(s)`` the words at ``_OFFSET`` are MT's ``init_genrand(s)``; a torch that
    lays its state out otherwise is refused, not seeded wrongly."""
    generator = torch.Generator()
    generator.manual_seed(0)
    state = generator.get_state()
    expected = [0]
    for i in range(1, MT_WORDS):
        previous = expected[-1]
        expected.append((1812433253 * (previous ^ (previous >> 30)) + i) & 0xFFFFFFFF)
    words = state.numpy()[_OFFSET : _OFFSET + 8 * MT_WORDS]
    if len(words) != 8 * MT_WORDS or not np.array_equal(words.view("<u8"), expected):
        raise RuntimeError(
            f"torch {torch.__version__} keeps its CPU generator's state in another layout than "
            "the torch this project is locked to (uv.lock): its random streams cannot be "
            "seeded; install the locked version (uv sync)"
        )
    template = state.numpy()
    template.flags.writeable = False  # shared by every generator made
    return template
