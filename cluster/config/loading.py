"""YAML → typed config: every value checked against its field's annotation, then ``validate``.

``a.b=value`` overrides (``--set``) are applied to the raw mapping first, parsed as YAML.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from cluster.config.errors import ConfigError
from cluster.config.experiment import ExperimentConfig, validate


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (dataclass, Optional, Literal, scalar)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(path, value, f"must be one of {', '.join(map(repr, choices))}")
        return value
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(path, value, f"must be a mapping of {tp.__name__} fields")
        return _from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" and "inf" as strings
            try:
                return float(value.strip().lstrip("."))
            except ValueError:
                raise ConfigError(path, value, "must be a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, value, "must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "must be a string")
        return value
    raise TypeError(f"unsupported config type {_type_name(tp)} at {path}")


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in data:
        if key not in known:
            path = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            fix = (
                f"did you mean {close[0]!r}?"
                if close
                else f"known keys: {', '.join(sorted(known))}"
            )
            raise ConfigError(path, data[key], f"unknown key; {fix}")
    kwargs = {}
    for f in fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        if f.name in data:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], path)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(path, None, "is required")
    return cls(**kwargs)


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override (value parsed as YAML) to a raw config mapping."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ConfigError("--set", assignment, "write overrides as key.path=value, e.g. rounds=10")
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(key, assignment, f"{part!r} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(
            "--set", assignment, f"the value is not valid YAML ({_yaml_problem(error)})"
        ) from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(error, "problem", None) or error)


def _parse_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(
            "CONFIG", str(path), f"not valid YAML ({_yaml_problem(error)}); fix that line"
        ) from None
    except (UnicodeDecodeError, OSError) as error:
        raise ConfigError(
            "CONFIG", str(path), f"unreadable as a YAML text file ({error}); pass the config file"
        ) from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> ExperimentConfig:
    """Read YAML (or start from defaults), apply overrides, then validate everything."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                "CONFIG",
                str(path),
                "no such file; pass a YAML file such as configs/quickstart.yaml",
            )
        raw = _parse_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ConfigError("CONFIG", str(path), "the file must hold a YAML mapping")
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict, overrides: list[str] = ()) -> ExperimentConfig:
    """Build and validate a config from a mapping (e.g. one stored in a checkpoint)."""
    raw = copy.deepcopy(raw)
    for assignment in overrides:
        apply_override(raw, assignment)
    config = _from_dict(ExperimentConfig, raw)
    validate(config)
    return config
