"""torch CPU generators given MT19937's whole state, not a 32-bit seed.

torch's CPU generator is MT19937, and ``manual_seed`` keeps only the low 32 bits of a seed
(``init_genrand``): a run's streams would have 2³² possible states, so two of its n streams
would draw the same values with probability ≈ n²/2³³ (≈ 1.2 pairs expected over 100 clients a
round for 1,000 rounds). Two clients' noise drawn alike would make the difference of their
uploads noiseless to the server. Here every stream's generator gets its 624 state words
instead (from the stream's SeedSequence, as NumPy seeds its own MT19937: ``mt19937_key``; from
a secret: ``algorithms.secret_streams``), written through the state that ``get_state``
returns, at the layout checked once against torch's own seeding (``seeded_template``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

MT_WORDS = 624
_OFFSET = 24  # MT19937's words, a uint64 each, from byte 24 of torch's saved state
_TOP_BIT = 0x80000000


def mt19937_key(words: np.ndarray) -> np.ndarray:
    """MT19937 states (n × 624), in place, from n rows of 624 words of a stream's
    ``SeedSequence`` (uint32), as
    NumPy's ``MT19937`` seeds itself: the first word's top bit set and the rest zero (only
    that bit of it enters the twist; setting it keeps the state nonzero), the others as
    drawn. A pool of 128 bits makes each state, so two streams coincide only where their
    pools do (≈ n²/2¹²⁹), not their seeds' low 32 bits (≈ n²/2³³)."""
    words[:, 0] = _TOP_BIT
    return words


def cpu_generators(words: np.ndarray) -> list[torch.Generator]:
    """One CPU generator per row of ``words`` (n × 624, values < 2³²), whose MT19937 state is
    that row; the first draw twists it, as after ``manual_seed``."""
    template = seeded_template()
    states = np.empty((len(words), template.size), dtype=np.uint8)
    states[:] = template
    states.view("<u8")[:, _OFFSET // 8 : _OFFSET // 8 + MT_WORDS] = words
    generators = []
    for state in states:
        generator = torch.Generator()
        # A row of its own: set_state reads a tensor from the start of its storage.
        generator.set_state(torch.from_numpy(state))
        generators.append(generator)
    return generators


@functools.cache
def seeded_template() -> np.ndarray:
    """A CPU generator's state just after ``manual_seed`` (``left`` 1, ``next`` 0: the first
    draw twists the words ``cpu_generators`` sets), made once. Its layout is checked: after
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
    return state.numpy()
