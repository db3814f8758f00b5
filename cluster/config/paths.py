"""Paths a config names that an environment variable may override (``$DPFL_*``)."""

from __future__ import annotations

import os
from pathlib import Path


def configured_path(variable: str, value: str) -> Path:
    """``$variable`` if set, else ``value``; ``$VARS`` and ``~`` expanded, not resolved (a
    relative path stays relative: where it resolves is the caller's decision)."""
    return Path(os.path.expandvars(os.environ.get(variable, value))).expanduser()
