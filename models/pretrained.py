"""Pretrained weights from a local folder in the Hugging Face / timm on-disk layout.

A folder holds ``config.json`` and the weights as ``model.safetensors`` (read first when both
are present) or ``pytorch_model.bin``. Nothing is executed or unpickled: safetensors is parsed
here (8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range, then the raw little-endian bytes), and ``pytorch_model.bin`` goes through
``torch.load(weights_only=True)``. Sharded checkpoints (``*.index.json``) are not read.

``load_checked`` copies a checkpoint into a model and refuses, naming the file and the key, a
missing tensor, a tensor of another shape, or a key the model does not have; the classifier
head (``head_prefixes``) is never taken from the checkpoint: it keeps the model's own seeded
initialisation, sized for the task's classes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from math import prod
from pathlib import Path

import torch
from torch import nn

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
}


class PretrainedError(ValueError):
    """A pretrained folder that cannot initialise the model: the message names the file."""

    def __init__(self, path: Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"pretrained weights {path}: {problem}")

    def __reduce__(self):  # as Ray sends it from an actor: fields, then later state
        return (self.__class__, (self.path, self.problem), self.__dict__)


def weights_file(folder: Path) -> Path:
    """The folder's weights: ``model.safetensors``, else ``pytorch_model.bin``."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise PretrainedError(folder, f"holds neither {' nor '.join(WEIGHT_FILES)}")


def read_config(folder: Path) -> dict:
    """``config.json`` of the folder as a dict."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise PretrainedError(path, "missing (the model's hyperparameters are checked against it)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PretrainedError(path, f"unreadable ({error})") from None
    if not isinstance(config, dict):
        raise PretrainedError(path, "is not a JSON object")
    return config


def check_config(path: Path, found: dict, expected: dict) -> None:
    """Every ``expected`` key is in ``found`` with the same value."""
    for key, value in expected.items():
        if key not in found:
            raise PretrainedError(path, f"lacks {key!r} (expected {value!r})")
        if found[key] != value:
            raise PretrainedError(
                path, f"{key} is {found[key]!r} but the model is built with {value!r}"
            )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` or ``pytorch_model.bin`` file."""
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise PretrainedError(path, f"not a weights-only torch file ({error})") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise PretrainedError(path, "is not a flat {name: tensor} state dict")
    return state


MAX_SAFETENSORS_HEADER = 100_000_000  # bytes, the safetensors library's own limit
MAX_DIMENSION = 2**40  # no real tensor comes near; keeps prod(shape) and torch.empty sane


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Parse a safetensors file. As the format requires, the tensors' byte ranges must tile the
    body exactly (sorted, no overlap, no gap): a header cannot make several tensors share bytes,
    so what is copied is never more than the file."""
    data = path.read_bytes()
    if len(data) < 8:
        raise PretrainedError(path, "shorter than the 8-byte header length")
    (header_length,) = struct.unpack("<Q", data[:8])
    if header_length > MAX_SAFETENSORS_HEADER or 8 + header_length > len(data):
        raise PretrainedError(path, f"header length {header_length} is too large for the file")
    try:
        header = json.loads(data[8 : 8 + header_length])
    except ValueError as error:
        raise PretrainedError(path, f"header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise PretrainedError(path, "header is not a JSON object")
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + header_length :]
    entries = {name: _safetensor_entry(path, name, entry) for name, entry in header.items()}
    _check_tiling(path, entries, len(body))
    return {
        name: torch.frombuffer(bytearray(body[begin:end]), dtype=dtype).reshape(shape)
        if end > begin
        else torch.empty(shape, dtype=dtype)
        for name, (dtype, shape, begin, end) in entries.items()
    }


def _safetensor_entry(path: Path, name: str, entry) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, begin, end) of one header entry, its byte count matching dtype × shape."""

    def whole(n) -> int:
        if type(n) is not int or not 0 <= n < MAX_DIMENSION:
            raise ValueError(n)
        return n

    try:
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        shape = [whole(n) for n in entry["shape"]]
        begin, end = (whole(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise PretrainedError(path, f"tensor {name!r}: malformed header entry {entry!r}") from None
    if end - begin != prod(shape) * dtype.itemsize:
        raise PretrainedError(
            path, f"tensor {name!r}: bytes {begin}:{end} do not hold {entry['dtype']} {shape}"
        )
    return dtype, shape, begin, end


def _check_tiling(path: Path, entries: dict, body_length: int) -> None:
    position = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin != position:
            raise PretrainedError(
                path, f"tensor {name!r} starts at byte {begin}, expected {position} (gap/overlap)"
            )
        position = end
    if position != body_length:
        raise PretrainedError(
            path, f"the tensors end at byte {position}, the body at {body_length}"
        )


def load_checked(
    model: nn.Module,
    path: Path,
    state: dict[str, torch.Tensor],
    head_prefixes: Sequence[str],
    ignored_prefixes: Sequence[str] = (),
) -> None:
    """Copy ``state`` (read from ``path``) into ``model``'s parameters, except the head.

    Keys under ``head_prefixes`` or ``ignored_prefixes`` (pretraining-only parts such as a
    masked-LM head) are skipped; every other model tensor must be in ``state`` with its shape,
    and ``state`` may hold nothing else.
    """
    skipped = (*head_prefixes, *ignored_prefixes)
    wanted = {k: v for k, v in model.state_dict().items() if not k.startswith(tuple(head_prefixes))}
    given = {k: v for k, v in state.items() if not k.startswith(skipped)}
    unknown = sorted(set(given) - set(wanted))
    if unknown:
        raise PretrainedError(path, f"unknown key(s) {unknown[:5]} (the model has no such tensor)")
    missing = sorted(set(wanted) - set(given))
    if missing:
        raise PretrainedError(path, f"missing key(s) {missing[:5]}")
    for key, target in wanted.items():
        if tuple(given[key].shape) != tuple(target.shape):
            raise PretrainedError(
                path, f"{key} has shape {tuple(given[key].shape)}, the model {tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name in given:
                tensor.copy_(given[name].to(tensor.dtype))
