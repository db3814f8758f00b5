"""The project's exceptions cross process boundaries intact: Ray sends an error raised in an
actor (or a trial's task) to the driver by pickling it, and an exception whose ``__init__``
takes other arguments than its message cannot be rebuilt from ``args`` alone. The driver then
gets Ray's ``UnserializableException`` instead, which the CLI cannot tell from a crash (a
``StoreError`` is bad input: exit 2 with its message)."""

import ast
import pickle
from pathlib import Path

import pytest
import yaml

from cluster.config.errors import ConfigError
from cluster.config.loading import DuplicateKeyError
from datasets.femnist import FemnistFormatError
from datasets.locations import FolderInTheWay, LocationError
from datasets.partition import PartitionError
from datasets.store import StoreError, StoreReadFailed
from datasets.tokenizer import TokenizerFilesError
from datasets.vision import SourceMissingError
from models.pretrained import PretrainedError

ROOT = Path(__file__).resolve().parents[1]
# What actors, trials' tasks and the tracking process run (the driver's own errors stay in it).
WORKER_PACKAGES = ("actors", "algorithms", "cluster/config", "datasets", "models", "privacy")

ERRORS = [
    StoreError("s3://bucket/shards", "manifest.json unreadable (AccessDenied)", denied=True),
    LocationError("no credentials", "AWS_ACCESS_KEY_ID", ""),
    PretrainedError(Path("/weights"), "shape mismatch"),
    TokenizerFilesError(Path("/tok"), "vocab.json missing"),
    ConfigError("algorithm.clip_norm", -1.0, "must be > 0 (e.g. 1.0)"),
    DuplicateKeyError(
        "rounds", yaml.Mark("c.yaml", 0, 2, 0, None, None), yaml.Mark("c.yaml", 9, 5, 0, None, None)
    ),
    PartitionError("num_clients", "too few rows"),
    FemnistFormatError(Path("/femnist/train.json"), "not JSON"),
    SourceMissingError("mnist", Path("/data"), [(Path("/data/x"), "missing")], "fetch", "h", "n"),
    StoreReadFailed("s3://bucket/shards", "AWS Error NETWORK_CONNECTION"),
    FolderInTheWay(Path("mine"), ["notes", "thesis.txt"]),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: type(error).__name__)
def test_an_exception_survives_pickling_with_its_type_message_and_fields(error):
    error.add_note("a note added on the way")  # later state travels too
    again = pickle.loads(pickle.dumps(error))
    assert again.__notes__ == ["a note added on the way"]
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert {k: str(v) for k, v in vars(again).items()} == {
        k: str(v) for k, v in vars(error).items()
    }


def _exceptions_with_own_init(path: Path):
    """(class name, whether it defines ``__reduce__``) for each class in ``path`` that derives
    from an ``...Error``/``...Exception`` base and defines ``__init__``."""
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [getattr(base, "id", None) or getattr(base, "attr", "") for base in node.bases]
        if not any(name.endswith(("Error", "Exception")) for name in bases):
            continue
        methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
        if "__init__" in methods:
            yield node.name, "__reduce__" in methods


def test_every_exception_that_a_worker_may_raise_with_its_own_init_rebuilds_from_its_fields():
    """A new exception class with its own ``__init__`` in the packages the workers run needs a
    ``__reduce__`` (and a case above)."""
    missing = [
        f"{path.relative_to(ROOT)}:{name}"
        for package in WORKER_PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, reduces in _exceptions_with_own_init(path)
        if not reduces
    ]
    assert missing == []
    found = {
        name
        for package in WORKER_PACKAGES
        for path in (ROOT / package).rglob("*.py")
        for name, _ in _exceptions_with_own_init(path)
    }
    assert len(found) >= len(ERRORS)  # the scan still sees them (not passing on nothing)
    assert {type(error).__name__ for error in ERRORS} >= found


def _actor_died_in_constructor(error: Exception):
    """Ray's ``ActorDiedError`` for an actor whose constructor raised ``error``, as a call on
    that actor gets it."""
    import traceback

    from ray.exceptions import ActorDiedError, RayTaskError

    try:
        raise error
    except Exception as raised:  # noqa: BLE001  (a real traceback, as the actor formats it)
        text = "".join(traceback.format_exception(raised))
    return ActorDiedError(cause=RayTaskError("ClientHostActor.__init__", text, error))


def test_a_constructor_failure_is_read_whole_and_a_kill_is_not_one():
    """``ray_executor.constructor_failure``: the constructor's exception, type and every line of
    its message (a store error quoting an S3 reply over two lines, a note); None for an actor
    that died otherwise (killed, its node lost)."""
    from ray.exceptions import ActorDiedError

    from cluster.runtime.ray_executor import constructor_failure

    error = StoreError("s3://b/shards", "manifest.json unreadable (AccessDenied:\n  refused)")
    error.add_note("a note")
    assert constructor_failure(_actor_died_in_constructor(error)) == (
        f"datasets.store.StoreError: {str(error).replace(chr(10) + '  ', ' ')} a note"
    )
    assert constructor_failure(ActorDiedError()) is None  # no constructor's error in it
    assert constructor_failure(RuntimeError("creation task")) is None
