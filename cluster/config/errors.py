"""The one error a config check raises: the field, the bad value and the fix."""

from __future__ import annotations

import difflib
from typing import Any


class ConfigError(ValueError):
    def __init__(self, field_path: str, value: Any, fix: str):
        self.field_path, self.value, self.fix = field_path, value, fix
        super().__init__(f"config error: {field_path} = {value!r}: {fix}")


def choice(path: str, value: str, choices, what: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, list(choices), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(path, value, f"unknown {what}; {hint}known: {', '.join(sorted(choices))}")


def positive(path: str, value: float | int | None, example: str) -> None:
    if value is None or not value > 0:
        raise ConfigError(path, value, f"must be > 0 (e.g. {example})")
