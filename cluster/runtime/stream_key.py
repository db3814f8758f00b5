"""The key of a run's random streams: its config's seed, or a secret (``privacy.secret_streams``).

Every stream but the data's and the model initialisation's (cohorts, local batches, noise,
dropout, augmentation: ``algorithms.rng``) is keyed by it. A secret key is 127 bits from the
operating system's entropy (``secrets``) above ``algorithms.secret_streams.SECRET_FLOOR``
(which keys streams cryptographically), drawn when a run starts and kept in its checkpoint
(hex, so that a resume continues the same streams and a replayed round releases nothing new):
not in the config, the MLflow run or the terminal.
"""

from __future__ import annotations

import re
import secrets

from algorithms.secret_streams import SECRET_BITS, SECRET_FLOOR, is_secret
from cluster.config import ConfigError, ExperimentConfig

SECRET_DIGITS = SECRET_BITS // 4  # hexadecimal, as the checkpoint holds it
CHECKPOINT_FIELD = "streams_secret"  # in the checkpoint's simulation state


def streams_key(config: ExperimentConfig, resumed: dict | None = None) -> int:
    """The key of the run of ``config``: ``config.streams_seed``, or with secret streams the
    one the ``resumed`` simulation state holds, else a new secret."""
    if not config.privacy.secret_streams:
        return config.streams_seed
    if resumed is not None:
        key = parsed_key(resumed.get(CHECKPOINT_FIELD))
        if key is None:
            raise ConfigError(
                "privacy.secret_streams",
                True,
                "the checkpoint resumed holds no secret key of its streams: resume it with "
                "the config it was written with",
            )
        return key
    return SECRET_FLOOR | secrets.randbits(SECRET_BITS - 1)


def parsed_key(saved: object) -> int | None:
    """The secret key a checkpoint holds as ``saved`` (``saved_key``'s text), None where that
    is no key: not ``SECRET_DIGITS`` hexadecimal digits, or below ``SECRET_FLOOR``."""
    if not isinstance(saved, str) or not re.fullmatch(f"[0-9a-f]{{{SECRET_DIGITS}}}", saved):
        return None
    key = int(saved, 16)
    return key if is_secret(key) else None


def saved_key(config: ExperimentConfig, key: int) -> dict[str, str]:
    """What a checkpoint's simulation state keeps of ``key``: the secret, else nothing (the
    config's seed is in the checkpoint's config)."""
    if not config.privacy.secret_streams:
        return {}
    return {CHECKPOINT_FIELD: f"{key:0{SECRET_DIGITS}x}"}
