"""The key of a run's random streams: its config's seed, or a secret (``privacy.secret_streams``).

Every stream but the data's and the model initialisation's (cohorts, local batches, noise,
dropout, augmentation: ``algorithms.rng``) is keyed by it. A secret key is 128 bits from the
operating system's entropy (``secrets``), drawn when a run starts, kept in its checkpoint (hex,
so that a resume continues the same streams and a replayed round releases nothing new) and
nowhere else: not in the config, the MLflow run or the terminal.
"""

from __future__ import annotations

import secrets

from cluster.config import ExperimentConfig

SECRET_BITS = 128
SECRET_DIGITS = SECRET_BITS // 4  # hexadecimal, as the checkpoint holds it
CHECKPOINT_FIELD = "streams_secret"  # in the checkpoint's simulation state


def streams_key(config: ExperimentConfig, resumed: dict | None = None) -> int:
    """The key of the run of ``config``: ``config.streams_seed``, or with secret streams the
    one the ``resumed`` simulation state holds, else a new secret."""
    if not config.privacy.secret_streams:
        return config.streams_seed
    if resumed is not None:
        return int(resumed[CHECKPOINT_FIELD], 16)
    return secrets.randbits(SECRET_BITS)


def saved_key(config: ExperimentConfig, key: int) -> dict[str, str]:
    """What a checkpoint's simulation state keeps of ``key``: the secret, else nothing (the
    config's seed is in the checkpoint's config)."""
    if not config.privacy.secret_streams:
        return {}
    return {CHECKPOINT_FIELD: f"{key:0{SECRET_DIGITS}x}"}
