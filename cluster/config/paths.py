"""Paths a config names that an environment variable may override (``$DPFL_*``)."""

from __future__ import annotations

import os
from pathlib import Path

from cluster.config.errors import ConfigError


def configured_path(field: str, variable: str, value: str) -> Path:
    """``$variable`` if set, else ``value`` (the config's ``field``); ``$VARS`` and ``~``
    expanded, not resolved (a relative path stays relative: where it resolves is the caller's
    decision). A ``~user`` naming no user is a ``ConfigError`` naming where the path came from."""
    source, text = (variable, os.environ[variable]) if variable in os.environ else (field, value)
    try:
        return Path(os.path.expandvars(text)).expanduser()
    except RuntimeError as error:  # pathlib: no home directory for that ~user
        raise ConfigError(
            source, text, f"{error} ({text.split('/')[0]}); write the path without ~"
        ) from None


def resolved_path(field: str, variable: str, value: str) -> Path:
    """``configured_path``, resolved (``resolve``)."""
    return resolve(field, configured_path(field, variable, value))


def resolve(field: str, path: Path) -> Path:
    """``path`` made absolute with symlinks resolved; a symlink loop is a ``ConfigError``."""
    try:
        return path.resolve()
    except RuntimeError as error:  # pathlib: a symlink loop
        raise ConfigError(field, str(path), f"{error}; point it at a real directory") from None
