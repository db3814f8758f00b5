"""Property tests of the checks the command line runs before any work: parse the YAML, build the
typed config (``config_from_dict``), ``validate`` it, ``preflight`` it. Whatever a config file
or its values hold, the outcome is a config that passed or one of the errors the CLI turns into
exit 2 (``cluster.cli.main._input_errors``): never another exception (exit 1), never a hang.

Two strategies: (a) the schema, every field of ``ExperimentConfig`` by its annotation, hostile
numbers (NaN, ±inf, huge, tiny, negative) and junk (wrong types, nested lists and mappings)
mixed in, written over a small valid base; (b) YAML text: arbitrary text, dumped random
structures keyed by the schema's own field names, and lines of ``key: value`` that may repeat a
key. Preflight runs for real except its network connects, which fail as if nothing answered;
the base runs on the local executor with tracking off, so neither Ray nor MLflow starts.
"""

from __future__ import annotations

import copy
import math
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cluster.claims.calibration
import cluster.runtime.preflight
from algorithms.presets import PRESETS
from cluster.cli.main import _input_errors, main
from cluster.config import ConfigError, ExperimentConfig, config_from_dict, load_config
from cluster.runtime.preflight import preflight
from datasets.partition import PARTITION_METHODS
from datasets.sources import SOURCES
from datasets.tasks import TASKS

BASE = {
    "rounds": 2,
    "data": {"num_clients": 10, "synthetic": {"samples_per_user": 20}},
    "algorithm": {
        "name": "dp_fedavg",
        "local": {"lr": 0.1, "batch_size": 8, "local_steps": 1},
        "clip_norm": 1.0,
        "noise_multiplier": 1.0,
    },
    "cohort": {"size": 5},
    "executor": {"kind": "local", "num_actors": 1},
    "tracking": {"enabled": False},
}

HOSTILE_NUMBERS = st.sampled_from(
    [math.nan, math.inf, -math.inf, 1e39, -1e39, 1e-300, -0.0, 0, -1, 2**63, -(2**63) - 1, 10**400]
)
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
# Names a valid config uses, so that examples reach the checks behind the name lookups.
CHOICES = {
    "task": sorted(TASKS),
    "data.source": sorted(SOURCES),
    "algorithm.name": sorted(PRESETS),
    "data.partition.method": sorted(PARTITION_METHODS),
}
STRINGS = st.sampled_from(["", ".", "..", "../x", "a/b", "a\\b", "ok-name", "x" * 101, "a\nb"])


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, annotation) of every field of ``cls`` that is not itself a section."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in fields(cls):
        path, tp = f"{prefix}{f.name}", hints[f.name]
        found += _leaves(tp, f"{path}.") if is_dataclass(tp) else [(path, tp)]
    return found


FIELDS = _leaves(ExperimentConfig)
SECTIONS = ["data", "data.synthetic", "data.partition", "algorithm", "algorithm.local", "cohort"]


def for_annotation(tp: Any, path: str) -> st.SearchStrategy:
    """Values of the annotation's type (hostile ones among them), rarely junk of any type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        typed = st.none() | st.one_of(*(for_annotation(a, path) for a in inner))
    elif origin is Literal:
        typed = st.sampled_from(typing.get_args(tp))
    elif tp is bool:
        typed = st.booleans()
    elif tp is int:
        typed = st.integers(-2, 40) | HOSTILE_NUMBERS
    elif tp is float:
        typed = st.floats(-2, 10) | HOSTILE_NUMBERS
    elif path in CHOICES:
        typed = st.sampled_from(CHOICES[path])
    elif path == "data.store":  # a local path: a URI (s3://...) would reach for the network
        typed = st.text(st.characters(blacklist_characters=":"), max_size=12)
    else:
        typed = STRINGS | st.text(max_size=12)
    return st.integers(0, 9).flatmap(lambda i: JUNK if i == 0 else typed)


@st.composite
def schema_configs(draw) -> dict:
    """BASE with 1 to 4 fields (or whole sections) replaced by drawn values."""
    raw = copy.deepcopy(BASE)
    for path, tp in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4)):
        _put(raw, path, draw(for_annotation(tp, path)))
    if draw(st.integers(0, 9)) == 0:
        _put(raw, draw(st.sampled_from(SECTIONS)), draw(JUNK))
    return raw


def _put(raw: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


KEYS = st.sampled_from(sorted({part for path, _ in FIELDS for part in path.split(".")}))
SCALARS = st.sampled_from(
    ["0", "-1", ".inf", ".nan", "~", "true", "''", "1e999", "99999999999999999999", "[]", "{}"]
)


@st.composite
def yaml_texts(draw) -> str:
    """Arbitrary text, a dumped random structure keyed by field names, or ``key: value`` lines
    at drawn indents (repeats and bad nesting included)."""
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(st.text(max_size=60))
    if kind == 1:
        tree = st.recursive(
            SCALARS.map(yaml.safe_load) | st.text(max_size=6),
            lambda inner: st.dictionaries(KEYS, inner, max_size=4) | st.lists(inner, max_size=2),
            max_leaves=10,
        )
        return yaml.safe_dump(draw(tree))
    values = SCALARS | st.sampled_from(["", "9" * 5000, "[" * 600 + "]" * 600])  # int, depth
    lines = st.tuples(st.sampled_from([0, 0, 2, 4]), KEYS, values)
    return "".join(f"{' ' * i}{k}: {v}\n" for i, k, v in draw(st.lists(lines, max_size=8)))


@pytest.fixture
def checked_world(tmp_path, monkeypatch):
    """A working directory and environment for preflight: the store and checkpoint roots in
    ``tmp_path``, MLflow on an SQLite file there, and every TCP connect failing at once."""
    monkeypatch.chdir(tmp_path)
    for name in ("DPFL_STORE_ROOT", "DPFL_CHECKPOINT_DIR", "DPFL_DATA_ROOT", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")

    def nothing_answers(field: str, value: str, host: str, port: int, fix: str) -> None:
        raise ConfigError(field, value, f"nothing answers at {host}:{port} (not tried); {fix}")

    monkeypatch.setattr(cluster.runtime.preflight, "_connect_or_fail", nothing_answers)
    return tmp_path


def _check_before_work(build) -> None:
    """``build()`` a config, then preflight it: either passes or raises an exit-2 error."""
    try:
        preflight(build())
    except _input_errors():
        pass


PROPERTY = settings(
    derandomize=True,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.timeout(120)
@PROPERTY
@given(raw=schema_configs())
def test_any_schema_value_is_accepted_or_refused_with_exit_2(raw, checked_world):
    _check_before_work(lambda: config_from_dict(raw))


@pytest.mark.timeout(120)
@PROPERTY
@given(text=yaml_texts())
def test_any_yaml_document_is_accepted_or_refused_with_exit_2(text, checked_world):
    path = checked_world / "config.yaml"
    path.write_text(text)
    _check_before_work(lambda: load_config(path))


@pytest.mark.timeout(120)
@settings(PROPERTY, max_examples=20)
@given(raw=schema_configs())
def test_the_command_line_exits_0_or_2_before_any_work(raw, checked_world, monkeypatch, capsys):
    """``cluster.cli.main.main`` on a generated file: exit 2, or the point where work would begin
    (the σ calibration after preflight) is reached; no traceback, nothing written."""

    class WorkWouldStart(Exception):
        pass

    def stop(*_args, **_kwargs):
        raise WorkWouldStart

    monkeypatch.setattr(cluster.claims.calibration, "calibrate_with_message", stop)
    path = checked_world / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    before = sorted(p.name for p in Path(checked_world).iterdir())
    try:
        code = main(["run", str(path)])
    except WorkWouldStart:
        code = 0
    err = capsys.readouterr().err
    assert code in (0, 2), err
    assert "Traceback" not in err
    assert sorted(p.name for p in Path(checked_world).iterdir()) == before
