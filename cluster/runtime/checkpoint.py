"""Driver checkpoints: the Simulation's state plus the config and the MLflow run to continue.

A checkpoint (format 4) is a ``torch.save`` file holding only plain data: dicts, lists,
strings, numbers, None and CPU tensors::

    format_version      4 (formats 2 and 3 held the same fields, written by code that computed
                        otherwise: format 2 seeded a CPU stream's generator with 32 bits (SHAKE-256
                        for secret streams) and clipped by float32 norms; format 3 standardised
                        synthetic data with pooled statistics, padded crops with the mean pixel,
                        ran DP-FedSAM's EMNIST at 28×28 and DP-SCAFFOLD's warm start without the
                        weight decay: a resume here would continue otherwise, so both are refused
                        with the reason, ``_WHY_NOT_READ``)
    sketch_hash_family  the count-sketch hash its sketches were made with (algorithms/sketch.py)
    config              the run's config as a plain dict (after privacy calibration)
    run_id              its MLflow run, or None (untracked)
    simulation
      rounds_done       rounds completed, warm-up rounds included
      params            the model's flat float32 parameters
      extras            {name: tensor}: the server state beyond the model (SCAFFOLD's c,
                        momentum, sketches, the adaptive clip norm C_t)
      accountant        {"history": [[σ, q, rounds], …]}, or None for a run without an ε
      history           one dict per round (RoundRecord's fields; update_norms a float32 tensor)
      client_states     {"client_ids": int64 (n,), name: (n, width) per client state (c_i)}
      streams_secret    with privacy.secret_streams only: the key of the run's streams, 32
                        hexadecimal digits (``cluster.runtime.stream_key``); whoever holds
                        the checkpoint can regenerate the run's noise

It is read with torch's weights-only unpickler (``torch.load(weights_only=True)``, nothing
added to its allowlist), which builds tensors and plain containers and nothing else, so
loading a checkpoint never runs code: a file naming any other class or function (a NumPy
array, as format 1 held, or a crafted object) is refused and none of it is built. The
Simulation's NumPy client states and ``array('f')`` update norms become tensors when written
(``_encode``) and again arrays when read (``_decode``), byte for byte.

``open_checkpoint`` also checks the content against the config before any work: the params
against the model the config builds, the server state's names and shapes against a fresh one,
the client states' ids and widths, the accountant against what the config charges, the history
against the rounds done (``cluster.runtime.checkpoint_match``). A mismatch is a ``ConfigError``
(field CHECKPOINT) naming what differs.

A checkpoint is a local file or an object in an object store (``checkpoint.dir`` an
``s3://`` URI; ``datasets.locations``). Written atomically (a temporary file renamed, or a
temporary object copied, over it), so a crash mid-write never leaves a corrupt checkpoint
behind; an object is read whole into memory and unpickled from there, by the same loader
(``torch.load`` copies the tensors out: about twice the checkpoint's size held while it is
read). Above ``locations.MULTIPART_COPY_THRESHOLD`` the temporary object is copied in parts,
so checkpoints larger than S3's 5 GiB single-copy limit are written too.
Resuming restores the server state, the accountant, the round history and every client's
state (e.g. SCAFFOLD c_i) and reaches bit-identical parameters, because all randomness is
keyed by (seed, round, client) rather than carried in generator state.
"""

from __future__ import annotations

import io
import pickle
import re
import shlex
import warnings
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch

from algorithms.presets import SKETCH_PRESETS
from algorithms.sketch import HASH_FAMILY
from cluster.config import ConfigError, config_from_dict
from cluster.config.paths import location_error
from cluster.runtime.checkpoint_match import check_state
from cluster.runtime.stream_key import CHECKPOINT_FIELD, SECRET_DIGITS, parsed_key
from datasets import locations
from datasets.locations import Location, LocationError, ObjectLocation

if TYPE_CHECKING:
    from cluster.config import ExperimentConfig

FORMAT_VERSION = 4

# What an older format's run would lose if this code continued it.
_WHY_NOT_READ = {
    2: " (its run's CPU generators were seeded otherwise, with 32 bits, or under "
    "privacy.secret_streams from SHAKE-256, and its clips scaled by float32 norms: a resume "
    "would continue with other batches and noise than the run's)",
    3: " (its run computed some configs otherwise: synthetic data standardised with all users' "
    "pooled statistics, which its ε did not cover; crops padded with the mean pixel rather than "
    "black; DP-FedSAM's EMNIST task at 28×28; DP-SCAFFOLD's warm start without the weight "
    "decay: a resume would continue it with other data or another model)",
}
_RESUME_FIX = (
    "resume it with the version of the code that wrote it (its MLflow run's git_commit tag), "
    "or start the run afresh"
)


def resume_command(path: Location) -> str:
    """The command that resumes the checkpoint at ``path``, the path quoted for a POSIX shell
    (a directory name may hold ``$(…)``: pasted, it must not run)."""
    return f"uv run python -m cluster resume {shlex.quote(str(path))}"


def checkpoint_path(config: ExperimentConfig, run_id: str | None) -> Location:
    """A tracked run's checkpoint is named by its MLflow run; an untracked one by what it runs
    (experiment, preset, seed), and its ``tracking.run_name`` where it has one (a sweep's
    trials: each its own file, also where ``$DPFL_CHECKPOINT_DIR`` puts all in one directory)."""
    t = config.tracking
    name = f"{t.experiment}-{config.algorithm.name}-seed{config.seed}"
    if t.run_name is not None:
        name += f"-{t.run_name}"
    return config.checkpoint_dir / f"{run_id or name}.pt"


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint the file system or object store would not take (a full disk, an endpoint
    that failed): the one there before, if any, is whole (writes are atomic)."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"checkpoint {path} could not be written ({reason}); the one written before, if "
            "any, is whole: free the space or mend the store, then resume"
        )

    def __reduce__(self):
        return (self.__class__, (self.path, self.reason), self.__dict__)


def save_checkpoint(
    path: Location, simulation_state: dict, config: dict, run_id: str | None
) -> None:
    """Write ``Simulation.state_dict()`` with the run's config and MLflow run id to ``path``
    (atomically: ``locations.write_atomic``); ``CheckpointWriteFailed`` where the storage
    refuses it."""
    payload = {
        "format_version": FORMAT_VERSION,
        "sketch_hash_family": HASH_FAMILY,
        "config": config,
        "run_id": run_id,
        "simulation": _encode(simulation_state),
    }
    try:
        locations.write_atomic(path, lambda file: torch.save(payload, file))
    except OSError as error:
        raise CheckpointWriteFailed(str(path), locations.first_line(error)) from error


def _encode(state: dict) -> dict:
    """The Simulation's state with its arrays as tensors of the same bytes."""
    history = [{**r, "update_norms": _norms_tensor(r["update_norms"])} for r in state["history"]]
    clients = {n: torch.from_numpy(a) for n, a in state["client_states"].items()}
    return {**state, "history": history, "client_states": clients}


def _norms_tensor(norms: array) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(norms, dtype=np.float32).copy())


def _decode(state: dict) -> dict:
    """``_encode``'s inverse: the state as ``Simulation.load_state_dict`` takes it."""
    history = [
        {**r, "update_norms": array("f", r["update_norms"].numpy().tobytes())}
        for r in state["history"]
    ]
    clients = {n: t.numpy() for n, t in state["client_states"].items()}
    return {**state, "history": history, "client_states": clients}


# --------------------------------------------------------------------------------- reading


def open_checkpoint(
    path: str | Location, overrides: list[str] = ()
) -> tuple[dict, ExperimentConfig]:
    """The checkpoint at ``path`` (``load_checkpoint``) and its config with ``overrides``,
    its state checked against that config (``check_state``). Reads the file and builds the
    config's model on the CPU; no data, no Ray, no MLflow."""
    checkpoint = load_checkpoint(path)
    _written_before_statistics_from(checkpoint["config"])
    try:
        config_from_dict(checkpoint["config"])
    except ConfigError as error:
        raise ConfigError(
            f"{path}: {error.field_path}",
            error.value,
            f"{error.fix} (this checkpoint's config; written by another version of this code? "
            f"{_RESUME_FIX})",
        ) from None
    config = config_from_dict(checkpoint["config"], overrides)
    check_state(path, checkpoint["simulation"], config)
    return checkpoint, config


def _written_before_statistics_from(config: dict) -> None:
    """A checkpoint written before ``data.statistics_from`` existed fitted its PCA and
    standardisation to the training rows: it resumes so (its default would now be the source's
    test split where ``client_test_fraction`` is set: another store, another claim)."""
    data = config.get("data")
    if not isinstance(data, dict) or "statistics_from" in data:
        return
    if data.get("pca_components") is not None or data.get("standardize_unit_norm") is True:
        data["statistics_from"] = "training"


def load_checkpoint(path: str | Location) -> dict:
    """The checkpoint at ``path`` (a local path or an object-store URI), its arrays as the
    Simulation holds them. A ``ConfigError`` (field CHECKPOINT, or the AWS variable at fault)
    when there is none or its object store cannot be reached, the file holds anything but plain
    data and tensors (it is then not unpickled), it is of another format or its structure is
    not a checkpoint's."""
    path = _existing(path)
    payload = _read(path)
    try:
        _check_version(path, payload)
        _check_structure(payload)
    except _Malformed as error:
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"not a checkpoint of this project: {error}; pass a file written by `run`",
        ) from None
    family = payload["sketch_hash_family"]
    if family != HASH_FAMILY and _algorithm_name(payload["config"]) in SKETCH_PRESETS:
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"its sketches were hashed with the {family} count-sketch hash, this code hashes "
            f"with {HASH_FAMILY} (algorithms/sketch.py): its momentum and error sketches "
            f"cannot be continued; {_RESUME_FIX}",
        )
    return {**payload, "simulation": _decode(payload["simulation"])}


def _algorithm_name(config: dict) -> str | None:
    algorithm = config.get("algorithm")
    return algorithm.get("name") if isinstance(algorithm, dict) else None


def _existing(path: str | Location) -> Location:
    """``path`` parsed, its object store reachable (``locations.check_access``), a file there:
    else a ``ConfigError``."""
    try:
        location = locations.parse_location(path)
        if isinstance(location, ObjectLocation):
            locations.check_access(location)
        found = locations.exists(location)
    except LocationError as error:
        raise location_error("CHECKPOINT", str(path), error) from None
    except OSError as error:
        raise _unreadable(path, str(error).splitlines()[0]) from None
    if not found:
        raise ConfigError(
            "CHECKPOINT", str(path), "no such file; the run printed its checkpoint path at start"
        )
    return location


def _source(path: Location) -> Path | BinaryIO:
    """What ``torch.load`` reads: a local file by its path, an object read whole (one request)
    into memory. An object's bytes are then held in memory while it is unpickled, and
    ``torch.load`` copies each tensor out of them: reading a checkpoint from an object store
    peaks at about twice its size in this process's memory (a local file is read once)."""
    return path if isinstance(path, Path) else io.BytesIO(locations.read_bytes(path))


def _read(path: Location) -> object:
    """The unpickled content of ``path`` through torch's weights-only unpickler, which refuses
    every global outside its tensor/container allowlist before building anything."""
    try:
        source = _source(path)
    except OSError as error:
        raise _unreadable(path, str(error).splitlines()[0]) from None
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol: the refusal says enough
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        foreign = _foreign_objects(source)
        if not foreign:
            raise _unreadable(path, "a pickle torch's weights-only loader does not read") from None
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"it holds objects this code does not load ({', '.join(foreign[:4])}), so it was "
            "not unpickled: a checkpoint of an older format (format 1 held NumPy arrays; this "
            f"code reads format {FORMAT_VERSION}) or a file not written by this project; if it "
            "is an older checkpoint you trust, resume it with the version of the code that "
            "wrote it (its MLflow run's git_commit tag), else start the run afresh",
        ) from None
    except Exception as error:  # torch.load raises many types for a file it cannot read
        raise _unreadable(path, f"{type(error).__name__}: {error}") from None


def _foreign_objects(source: Path | BinaryIO) -> list[str]:
    """The classes and functions the file's pickle names outside the allowlist (read off its
    opcodes, nothing built); [] if it cannot be read that far."""
    if not isinstance(source, Path):
        source.seek(0)  # torch.load left it where it failed
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # not torch's zip format, or a pickle its scanner does not parse
        return []


def _unreadable(path: str | Location, reason: str) -> ConfigError:
    return ConfigError(
        "CHECKPOINT",
        str(path),
        f"not a checkpoint this code can read ({reason.split('. ')[0]}); pass a file written "
        "by `run` (checkpoints are written atomically, so a crash leaves the previous one "
        "intact)",
    )


# ------------------------------------------------------------------------------- structure


class _Malformed(Exception):
    """What makes a loaded file no checkpoint of this format (a phrase for the message)."""


_NUMBER = (int, float)
_OPTIONAL_NUMBER = (int, float, type(None))
_TOP = {
    "format_version": int,
    "sketch_hash_family": str,
    "config": dict,
    "run_id": (str, type(None)),
    "simulation": dict,
}
_SIMULATION = {
    "rounds_done": int,
    "params": torch.Tensor,
    "extras": dict,
    "accountant": (dict, type(None)),
    "history": list,
    "client_states": dict,
}
_RECORD = {
    "round": int,
    "seconds": _NUMBER,
    "cohort_size": int,
    "epsilon": _OPTIONAL_NUMBER,
    "test_accuracy": _OPTIONAL_NUMBER,
    "test_loss": _OPTIONAL_NUMBER,
    "metrics": dict,
    "update_norms": torch.Tensor,  # RoundRecord's fields: a field added there must be here
}


def _fields(mapping: dict, types: dict, where: str) -> None:
    """``mapping`` has exactly the keys of ``types``, each value of its type."""
    missing = sorted(types.keys() - mapping.keys())
    extra = sorted(str(k) for k in mapping.keys() - types.keys())
    if missing or extra:
        what = f"lacks {', '.join(missing)}" if missing else f"has unknown {', '.join(extra)}"
        raise _Malformed(f"{where} {what}")
    for key, kind in types.items():
        value = mapping[key]
        fits = _is_plain_tensor(value) if kind is torch.Tensor else isinstance(value, kind)
        _need(fits, f"{where}'s {key} is a {type(value).__name__}")


def _is_plain_tensor(value: object) -> bool:
    """A dense tensor without autograd, as ``torch.save`` wrote the Simulation's (not a
    Parameter, a sparse or a quantized tensor, which the weights-only loader also builds)."""
    return (
        type(value) is torch.Tensor
        and value.layout == torch.strided
        and not value.is_quantized
        and not value.requires_grad
    )


def _need(condition: bool, problem: str) -> None:
    if not condition:
        raise _Malformed(problem)


def _check_version(path: Location, payload: object) -> None:
    """``_Malformed`` for content without a format version, a ``ConfigError`` for another."""
    _need(isinstance(payload, dict), f"it holds a {type(payload).__name__}, not a mapping")
    _need("format_version" in payload, "it has no format_version")
    version = payload["format_version"]
    _need(isinstance(version, int), f"its format_version is a {type(version).__name__}")
    if version != FORMAT_VERSION:
        why = _WHY_NOT_READ.get(version, "")
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"checkpoint format {version}, this code reads format {FORMAT_VERSION}{why}: "
            f"{_RESUME_FIX}",
        )


def _check_structure(payload: dict) -> None:
    """Raise ``_Malformed`` unless ``payload`` has the layout the module doc lists."""
    _fields(payload, _TOP, "it")
    run_id = payload["run_id"]
    _need(
        run_id is None or re.fullmatch(r"[0-9a-f]{32}", run_id) is not None,
        f"its run_id {run_id!r} is not an MLflow run id (32 hexadecimal digits)",
    )
    state = payload["simulation"]
    privacy = payload["config"].get("privacy")
    secret = isinstance(privacy, dict) and privacy.get("secret_streams") is True
    _fields(state, _SIMULATION | ({CHECKPOINT_FIELD: str} if secret else {}), "its simulation")
    _need(
        not secret or parsed_key(state[CHECKPOINT_FIELD]) is not None,
        f"its streams' secret is not a key of {SECRET_DIGITS} hexadecimal digits, the first "
        "at least 8",
    )
    params = state["params"]
    _need(params.ndim == 1 and params.is_floating_point(), "its params are not a float vector")
    _need(
        all(isinstance(k, str) and _is_plain_tensor(v) for k, v in state["extras"].items()),
        "its server state is not a mapping of names to tensors",
    )
    if state["accountant"] is not None:
        _check_accountant(state["accountant"])
    for index, record in enumerate(state["history"]):
        _need(isinstance(record, dict), f"its history[{index}] is not a mapping")
        _fields(record, _RECORD, f"its history[{index}]")
        norms = record["update_norms"]
        _need(norms.ndim == 1 and norms.dtype == torch.float32, "its update norms are not float32")
        _need(
            all(
                isinstance(k, str) and isinstance(v, _NUMBER) for k, v in record["metrics"].items()
            ),
            f"its history[{index}] metrics are not named numbers",
        )
    rounds = [r["round"] for r in state["history"]]
    _need(
        rounds == list(range(1, len(rounds) + 1)) and len(rounds) == state["rounds_done"],
        f"its history holds rounds {_span(rounds)}, its rounds_done is {state['rounds_done']}",
    )
    _check_client_arrays(state["client_states"])


def _span(rounds: list[int]) -> str:
    return f"{rounds[0]}..{rounds[-1]} ({len(rounds)} records)" if rounds else "none"


def _check_accountant(accountant: dict) -> None:
    history = accountant.get("history")
    _need(
        set(accountant) == {"history"}
        and isinstance(history, list)
        and all(
            isinstance(run, list | tuple)
            and len(run) == 3
            and isinstance(run[0], _NUMBER)
            and isinstance(run[1], _NUMBER)
            and isinstance(run[2], int)
            for run in history
        ),
        "its accountant is not a history of [σ, q, rounds] runs",
    )


def _check_client_arrays(states: dict) -> None:
    ids = states.get("client_ids")
    _need(
        _is_plain_tensor(ids) and ids.ndim == 1 and ids.dtype == torch.int64,
        "its client_states lack an int64 client_ids vector",
    )
    for name, rows in states.items():
        _need(
            isinstance(name, str) and _is_plain_tensor(rows) and rows.ndim in (1, 2),
            f"its client state {name!r} is not a matrix",
        )
        _need(
            (rows.ndim == 1) == (name == "client_ids") and len(rows) == len(ids),
            f"its client state {name!r} is {tuple(rows.shape)} for {len(ids)} clients",
        )
