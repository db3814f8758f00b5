"""The one error a config check raises: the field, the bad value and the fix."""

from __future__ import annotations

import difflib
import reprlib
from typing import Any

from cluster.redaction import redact_credentials

# The value as the message shows it: bounded, since a hostile config can hold a 1 MB string or
# YAML aliases that nest a list exponentially (a plain repr would not finish).
_VALUE_REPR = reprlib.Repr()
_VALUE_REPR.maxstring = _VALUE_REPR.maxother = 300
_VALUE_REPR.maxlong = 60
_VALUE_REPR.maxlevel = 2
_VALUE_REPR.maxlist = _VALUE_REPR.maxtuple = _VALUE_REPR.maxdict = _VALUE_REPR.maxset = 4


def short_repr(value: Any) -> str:
    """``repr(value)``, bounded in length and depth."""
    return _VALUE_REPR.repr(value)


# float32's normal range: the model computes in float32, so a larger magnitude overflows, and
# squaring or inverting a smaller one (1e-300) underflows to 0 or overflows in float64 too
FLOAT_LIMIT, FLOAT_TINY = 3.4e38, 1.2e-38


class ConfigError(ValueError):
    """A bad value: ``str`` names the field, the value (bounded; a URI's credentials masked)
    and the fix."""

    def __init__(self, field_path: str, value: Any, fix: str):
        self.field_path, self.value, self.fix = field_path, value, fix
        message = f"config error: {field_path} = {short_repr(value)}: {fix}"
        super().__init__(redact_credentials(message))

    def __reduce__(self):  # as Ray sends it from an actor: fields, then later state
        return (self.__class__, (self.field_path, self.value, self.fix), self.__dict__)


def choice(path: str, value: str, choices, what: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, list(choices), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(path, value, f"unknown {what}; {hint}known: {', '.join(sorted(choices))}")


def positive(path: str, value: float | int | None, example: str) -> None:
    if value is None or not value > 0:
        raise ConfigError(path, value, f"must be > 0 (e.g. {example})")


EXAMPLES_DIR = "configs/examples"  # one starting config per preset, <preset>.yaml


def example_path(preset: str) -> str:
    """The starting config of ``preset`` (``python -m cluster presets`` lists them all)."""
    return f"{EXAMPLES_DIR}/{preset}.yaml"


def start_from(preset: str) -> str:
    """The end of the fix for a field that ``preset`` refuses or lacks: a config whose fields
    are the preset's (the usual cause is a config written for another preset)."""
    return f"; or start from {example_path(preset)}"


SEED_LIMIT = 2**63  # numpy and torch take any seed below it


def check_seed(path: str, value: int | None) -> None:
    if value is not None and not 0 <= value < SEED_LIMIT:
        raise ConfigError(path, value, "a seed must be in [0, 2**63), e.g. 0")
