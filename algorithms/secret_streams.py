"""Streams keyed by a run's secret (``privacy.secret_streams``), derived cryptographically.

A public seed keys its streams through NumPy's SeedSequence, which suits reproducibility but
not secrecy: SeedSequence is no cryptographic function. Keyed by it, a 128-bit key's CPU streams
once hung on one 32-bit word of its pool (torch's ``manual_seed`` kept the low 32 bits), which a
search of 2³² candidates recovered from released models alone (a review did so). A secret key
K (``SECRET_FLOOR`` ≤ K < 2¹²⁸) is used otherwise:

- each stream's material is BLAKE2b-256 keyed by K of the stream's ids (round, client,
  purpose, ...): a pseudorandom function, so streams are independent and none reveals K;
- a CPU torch generator gets MT19937's whole state (624 words) from SHAKE-128 of the
  material (``algorithms.mt_state``); a GPU one (Philox) 64 bits of it as its seed, all that
  torch takes there;
- a NumPy generator (cohorts) is PCG64 seeded with the material (256 bits into SeedSequence's
  128-bit pool); a seed for ``torch.manual_seed`` (dropout) 64 bits of it.

None of these generators is cryptographically secure (MT19937's state follows from 624 of its
raw outputs, which a run never releases raw); docs/privacy.md says what that leaves.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from algorithms.mt_state import cpu_generator, mt_words

SECRET_BITS = 128
# A secret key has its top bit set: every key at or above this is a secret, and a config's seed
# (below 2**63) never is.
SECRET_FLOOR = 1 << (SECRET_BITS - 1)


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
    if torch.device(device).type != "cpu":
        generator = torch.Generator(device=device)
        generator.manual_seed(int.from_bytes(stream[:8], "little"))
        return generator
    return cpu_generator(mt_words(stream))


def numpy_rng(key: int, ids: tuple[int, ...]) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(material(key, ids), "little"))


def stream_seed(key: int, ids: tuple[int, ...]) -> int:
    """64 bits of the stream's material, for ``torch.manual_seed`` (dropout)."""
    return int.from_bytes(material(key, ids)[:8], "little")
