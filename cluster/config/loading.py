"""YAML → typed config: every value checked against its field's annotation, then ``validate``.

``a.b=value`` overrides (``--set``) are applied to the raw mapping first, parsed as YAML. Both
are parsed strictly: a key given twice in one mapping is an error (PyYAML keeps the last).
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
import stat
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from cluster.config.checks import validate
from cluster.config.errors import FLOAT_LIMIT, FLOAT_TINY, ConfigError
from cluster.config.experiment import ExperimentConfig

MAX_CONFIG_BYTES = 1 << 20  # a config is a few kB; this bounds what a wrong path makes us read
_PASS_A_FILE = "pass a YAML config file, e.g. configs/quickstart.yaml"

# Float fields where .inf has a meaning the README documents, and that meaning. Everywhere else
# only finite numbers are accepted; .nan never.
INFINITY_MEANS = {"algorithm.clip_norm": "no clipping, allowed only with noise_multiplier: 0"}
INT_LIMIT = 2**63  # int64, as numpy and torch hold integers


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
        # by type too: 1 == True and 0.0 == False, but neither is the choice true/false
        if not any(type(value) is type(c) and value == c for c in choices):
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
        if not -INT_LIMIT <= value < INT_LIMIT:
            raise ConfigError(path, value, "must be an integer of magnitude below 2**63")
        return value
    if tp is float:
        return _finite_float(value, path)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "must be a string")
        if "\0" in value or not _is_utf8(value):
            raise ConfigError(path, value, "must be UTF-8 text without NUL characters")
        return value
    raise TypeError(f"unsupported config type {_type_name(tp)} at {path}")


def _finite_float(value: Any, path: str) -> float:
    """``value`` as a float: 0 or of a magnitude in [``FLOAT_TINY``, ``FLOAT_LIMIT``], or +inf
    where ``INFINITY_MEANS`` allows (an integer too large for a float is not .inf: refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(path, value, "must be a number")
    number = _number(value, path)
    if number == 0 or FLOAT_TINY <= abs(number) <= FLOAT_LIMIT:
        return number
    if number == math.inf and path in INFINITY_MEANS:
        return number
    allowed = f"0 or a finite number of magnitude in [{FLOAT_TINY:g}, {FLOAT_LIMIT:g}]"
    if path in INFINITY_MEANS:
        allowed += f", or .inf ({INFINITY_MEANS[path]})"
    raise ConfigError(path, value, f"must be {allowed}; .nan is never accepted")


def _number(value: int | float | str, path: str) -> float:
    """The float a YAML number or numeric string stands for (YAML 1.1 reads "1e-5" and a
    quoted ".inf" as strings); NaN for an integer beyond the float range."""
    if isinstance(value, str):
        text = re.sub(r"^([-+]?)\.(inf|nan)$", r"\1\2", value.strip(), flags=re.IGNORECASE)
        try:
            return float(text)
        except ValueError:
            raise ConfigError(path, value, "must be a number") from None
    try:
        return float(value)
    except OverflowError:
        return math.nan


def _is_utf8(text: str) -> bool:
    """False for lone surrogates (a YAML "\\ud800" escape): no file name or log can hold them."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


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


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping names one key twice; ``fix`` says which lines to reconcile."""

    def __init__(self, key: Any, first: yaml.Mark, again: yaml.Mark):
        super().__init__(problem=f"duplicate key {key!r}", problem_mark=again)
        self.key, self.first = key, first
        self.fix = f"{key!r} is also on line {first.line + 1}; keep one of them"

    def __reduce__(self):  # as the package's other errors: fields, then later state
        return (self.__class__, (self.key, self.first, self.problem_mark), self.__dict__)


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (``<<`` merges may
    still be overridden, as YAML intends)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            # Non-scalar keys are unhashable: the base constructor refuses them.
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise DuplicateKeyError(key, seen[key], key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def _load_yaml(text: str) -> Any:
    """One YAML document, strictly (``_StrictLoader``). What PyYAML raises for a document it
    cannot represent (nesting too deep to recurse, an integer of over 4,300 digits) is raised
    as a ``yaml.YAMLError``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except ValueError as error:
        raise yaml.YAMLError(str(error)) from None


def override_text(value: Any) -> str:
    """``value`` as the right side of a ``--set`` writes it (one line of YAML flow style), so
    that ``apply_override`` reads it back as ``value``."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=2**31 - 1)
    return text.strip().removesuffix("...").strip()


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
        node[parts[-1]] = _load_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError(
            "--set",
            assignment,
            f"the value is not valid YAML ({_yaml_problem(error)}); {_yaml_fix(error, 'fix it')}",
        ) from None


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(error, "problem", None) or error)


def _yaml_fix(error: yaml.YAMLError, default: str) -> str:
    """The fix a ``DuplicateKeyError`` carries, else ``default``."""
    return getattr(error, "fix", default)


def _read_config_text(path: Path) -> str:
    """The file's text, refused unless it is a regular file of at most ``MAX_CONFIG_BYTES`` in
    UTF-8. Opened without blocking and checked on the open descriptor, so a FIFO or a device
    (``/dev/zero``) is refused without waiting on it or reading it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError("CONFIG", str(path), f"no such file; {_PASS_A_FILE}") from None
    except OSError as error:
        raise _unreadable(path, error) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError("CONFIG", str(path), f"is a directory; {_PASS_A_FILE}")
        if not stat.S_ISREG(mode):
            raise ConfigError(
                "CONFIG",
                str(path),
                f"is not a regular file (a device, FIFO or socket); {_PASS_A_FILE}",
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise _unreadable(path, error) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            "CONFIG", str(path), f"larger than {MAX_CONFIG_BYTES >> 20} MB; {_PASS_A_FILE}"
        )
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        raise _unreadable(path, error) from None


def _unreadable(path: Path, error: Exception) -> ConfigError:
    return ConfigError(
        "CONFIG", str(path), f"unreadable as a YAML text file ({error}); pass the config file"
    )


def read_yaml_mapping(path: Path) -> dict:
    """The file's top-level mapping, read strictly (size, type, duplicate keys), or a
    ``ConfigError`` saying what the file holds instead (configs and ``compare`` specs)."""
    try:
        raw = _load_yaml(_read_config_text(path))
    except yaml.YAMLError as error:
        raise ConfigError(
            "CONFIG",
            str(path),
            f"not valid YAML ({_yaml_problem(error)}); {_yaml_fix(error, 'fix that line')}",
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            "CONFIG",
            str(path),
            "must hold a YAML mapping of config fields (lines like `rounds: 10`); it holds "
            + _yaml_kind(raw),
        )
    return raw


# What a file that is no mapping holds, in words: never its content (a wrong path, say a spec's
# ``base: ../../etc/passwd``, must not print the file it names).
_YAML_KINDS = {bool: "true or false", int: "a number", float: "a number", str: "a string"}


def _yaml_kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return _YAML_KINDS.get(type(value), f"a {type(value).__name__}")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> ExperimentConfig:
    """Read YAML (or start from defaults), apply overrides, then validate everything."""
    raw = {} if path is None else read_yaml_mapping(Path(path))
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict, overrides: list[str] = ()) -> ExperimentConfig:
    """Build and validate a config from a mapping (e.g. one stored in a checkpoint)."""
    raw = copy.deepcopy(raw)
    for assignment in overrides:
        apply_override(raw, assignment)
    config = _from_dict(ExperimentConfig, raw)
    validate(config)
    return config
