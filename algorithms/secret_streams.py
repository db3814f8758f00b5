"""Streams keyed by a run's secret (``privacy.secret_streams``), derived cryptographically.

A public seed keys its streams through NumPy's SeedSequence and torch's ``manual_seed``, which
suits reproducibility but not secrecy: SeedSequence is no cryptographic function, and torch's
CPU generator (MT19937) keeps only the low 32 bits of a seed, so every CPU stream of a run
would hang on one 32-bit word that a search of 2³² candidates recovers (a review did so from
released models alone). A secret key K (``SECRET_FLOOR`` ≤ K < 2¹²⁸) is used otherwise:

- each stream's material is BLAKE2b-256 keyed by K of the stream's ids (round, client,
  purpose, ...): a pseudorandom function, so streams are independent and none reveals K;
- a CPU torch generator gets MT19937's whole state (624 words) from SHAKE-256 of the
  material, set through its saved state (the layout is checked once against torch's own
  seeding, ``_seeded_state``); a GPU one (Philox) 64 bits of it as its seed, all that
  torch takes there;
- a NumPy generator (cohorts) is PCG64 seeded with the material (256 bits into SeedSequence's
  128-bit pool); a seed for ``torch.manual_seed`` (dropout) 64 bits of it.

None of these generators is cryptographically secure (MT19937's state follows from 624 of its
raw outputs, which a run never releases raw); docs/privacy.md says what that leaves.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

SECRET_BITS = 128
# A secret key has its top bit set: every key at or above this is a secret, and a config's seed
# (below 2**63) never is.
SECRET_FLOOR = 1 << (SECRET_BITS - 1)
_MT_WORDS, _MT_OFFSET = 624, 24  # MT19937's words: uint64 each, from byte 24 of torch's state


def is_secret(seed: int) -> bool:
    return int(seed) >= SECRET_FLOOR


def material(key: int, ids: tuple[int, ...]) -> bytes:
    """BLAKE2b-256 keyed by the secret ``key`` of the stream's ``ids`` (each < 2⁶⁴)."""
    data = b"".join(int(i).to_bytes(8, "little") for i in ids)
    keyed = hashlib.blake2b(digest_size=32, key=int(key).to_bytes(SECRET_BITS // 8, "little"))
    keyed.update(data)
    return keyed.digest()


def torch_generator(key: int, ids: tuple[int, ...], device) -> torch.Generator:
    """The stream ``ids`` of ``key`` as a torch generator on ``device``."""
    stream = material(key, ids)
    generator = torch.Generator(device=device)
    if generator.device.type != "cpu":
        generator.manual_seed(int.from_bytes(stream[:8], "little"))
        return generator
    state = _seeded_state().clone()
    words = np.frombuffer(hashlib.shake_256(stream).digest(4 * _MT_WORDS), dtype="<u4")
    state[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS] = torch.from_numpy(
        words.astype("<u8").view(np.uint8)
    )
    generator.set_state(state)
    return generator


def numpy_rng(key: int, ids: tuple[int, ...]) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(material(key, ids), "little"))


def stream_seed(key: int, ids: tuple[int, ...]) -> int:
    """64 bits of the stream's material, for ``torch.manual_seed`` (dropout)."""
    return int.from_bytes(material(key, ids)[:8], "little")


@functools.cache
def _seeded_state() -> torch.Tensor:
    """A CPU generator's state just after ``manual_seed`` (``left`` 1, ``next`` 0: the first
    draw twists the words ``torch_generator`` sets), made once. Its layout is checked: after
    ``manual_seed(s)`` the words at ``_MT_OFFSET`` are MT's ``init_genrand(s)``; a torch that
    lays its state out otherwise is refused, not seeded wrongly."""
    generator = torch.Generator()
    generator.manual_seed(0)
    state = generator.get_state()
    expected = [0]
    for i in range(1, _MT_WORDS):
        previous = expected[-1]
        expected.append((1812433253 * (previous ^ (previous >> 30)) + i) & 0xFFFFFFFF)
    words = state.numpy()[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS]
    if len(words) != 8 * _MT_WORDS or not np.array_equal(words.view("<u8"), expected):
        raise RuntimeError(
            f"torch {torch.__version__} keeps its CPU generator's state in another layout: "
            "privacy.secret_streams cannot key its streams; run without it"
        )
    return state
