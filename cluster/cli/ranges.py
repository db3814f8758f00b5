"""A command's numeric arguments checked against their ranges before any work: a value outside
(NaN included, which fails every comparison) is a ``ValueError`` naming the flag, the value and
the range, which the command prints and exits 2 with."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# What a value must satisfy, and that requirement in words ("give ...").
Range = tuple[Callable[[float], bool], str]


def positive(value: float) -> bool:
    return 0.0 < value < math.inf


def rate(value: float) -> bool:
    return 0.0 < value <= 1.0


def at_least_one(value: float) -> bool:
    return value >= 1


def check_ranges(args: argparse.Namespace, ranges: dict[str, Range]) -> None:
    """Every argument of ``ranges`` that was given (not None) holds its range."""
    for name, (holds, requirement) in ranges.items():
        value = getattr(args, name)
        if value is not None and not holds(value):
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} = {value}: out of range; give {requirement}")
