"""Whether a checkpoint's state is what a run of its own config would hold (``check_state``):
the params against the model the config builds, the server state's names and shapes against a
fresh one, the client states' ids and widths, the accountant against what the config charges.
Checked by ``cluster.runtime.checkpoint.open_checkpoint`` before any work."""

from __future__ import annotations

import numpy as np
import torch

from cluster.config import ConfigError, ExperimentConfig
from datasets.locations import Location
from privacy.accountant import append_rounds


def check_state(path: str | Location, state: dict, config: ExperimentConfig) -> None:
    """A ``ConfigError`` (field CHECKPOINT) naming the first part of the checkpoint's ``state``
    that a run of ``config`` would not hold: the params (length, dtype), the server state's
    names and shapes, the client states' ids and widths, the accountant's history."""
    problem = _state_problem(state, config)
    if problem is not None:
        raise ConfigError(
            "CHECKPOINT",
            str(path),
            f"{problem}; this checkpoint does not match its own config (edited, or assembled "
            "from two runs?): pass the file the run wrote",
        )


def _state_problem(state: dict, config: ExperimentConfig) -> str | None:
    # Imported here: reading a checkpoint (preflight's overwrite check) needs none of this.
    from algorithms.layout import ParamLayout
    from cluster.claims.privacy_plan import privacy_claim
    from cluster.runtime.initial_state import initial_model, initial_state

    model, params = initial_model(config, *_model_input(config))
    algorithm, fresh = initial_state(config, ParamLayout.of(model), params)
    claim = privacy_claim(config, algorithm)
    return (
        _params_problem(state["params"], params, config)
        or _extras_problem(state["extras"], fresh.extras, config)
        or _clients_problem(state["client_states"], algorithm.client_state_widths(params), config)
        or _accountant_problem(state["accountant"], claim, state["rounds_done"])
    )


def _model_input(config: ExperimentConfig) -> tuple[tuple[int, ...], int]:
    """(row shape, classes) the run's model is built for: a given store's, else what the
    config's data options make (``source_shape``; no data read or generated)."""
    from cluster.runtime.storage_checks import check_object_store
    from cluster.runtime.store import unreadable_store
    from datasets.sources import source_shape
    from datasets.store import ShardStore, StoreError

    d = config.data
    if d.store is None:
        return source_shape(*config.store_parameters[:2])
    check_object_store("data.store", d.store_location())  # the AWS variable at fault, if any
    try:
        manifest = ShardStore.open(d.store).manifest
    except StoreError as error:
        raise unreadable_store(
            d.store,
            error,
            "the checkpoint's run reads this store: restore it, or rebuild it with `uv run "
            "python -m cluster partition ...`",
        ) from None
    return tuple(manifest["x_shape"]), manifest["num_classes"]


def _params_problem(saved: torch.Tensor, fresh: torch.Tensor, config) -> str | None:
    if saved.numel() != fresh.numel():
        return (
            f"its params hold {saved.numel()} values, the config's model ({config.task}, "
            f"{_data_text(config)}) has {fresh.numel()}: written for another task or feature size"
        )
    if saved.dtype != fresh.dtype:
        return f"its params are {saved.dtype}, the config's model's are {fresh.dtype}"
    return None


def _data_text(config) -> str:
    d = config.data
    return f"data.store {d.store}" if d.store is not None else f"data.source {d.source}"


def _extras_problem(saved: dict, fresh: dict, config) -> str | None:
    name = config.algorithm.name
    if saved.keys() != fresh.keys():
        return (
            f"its server state holds {_names(saved)}, the config's algorithm ({name}) keeps "
            f"{_names(fresh)}: written by another algorithm or options"
        )
    for key, value in saved.items():
        if value.shape != fresh[key].shape or value.dtype != fresh[key].dtype:
            return (
                f"its server state {key!r} is {_shape(value)}, the config's algorithm ({name}) "
                f"keeps {_shape(fresh[key])}: written for another model or options"
            )
    return None


def _names(mapping: dict) -> str:
    return ", ".join(sorted(mapping)) or "nothing"


def _shape(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype}"


def _clients_problem(states: dict, widths: dict[str, int], config) -> str | None:
    ids = states["client_ids"]
    clients = config.data.num_clients
    outside = ids[(ids < 0) | (ids >= clients)]
    if len(outside):
        return (
            f"it holds the state of client {outside[0]}, the config has {clients} clients "
            "(data.num_clients): written for another number of clients"
        )
    if len(np.unique(ids)) != len(ids):
        return "it holds some client's state twice"
    names = {n: a for n, a in states.items() if n != "client_ids"}
    if names.keys() != (widths.keys() if len(ids) else set()):  # no client: no state at all
        return (
            f"its clients keep {_names(names)}, under the config's algorithm "
            f"({config.algorithm.name}) they keep {_names(widths)}: written by another algorithm"
        )
    for name, rows in names.items():
        if rows.shape[1] != widths[name]:
            return (
                f"its clients' {name!r} hold {rows.shape[1]} values each, the config's model "
                f"has {widths[name]} parameters"
            )
    return None


def _accountant_problem(saved: dict | None, claim, rounds_done: int) -> str | None:
    if not claim.dp_valid:
        if saved is not None:
            return "it holds a privacy accountant, the config's run has no ε to account"
        return None
    if saved is None:
        return f"it holds no privacy accountant, the config's run accounts ε ({claim.preset})"
    charged = _Charges()
    for round_index in range(rounds_done):
        claim.charge(charged, round_index)
    runs = [tuple(run) for run in saved["history"]]
    if runs != charged.history:
        return (
            f"its accountant charged {_runs(runs)}, the config's {rounds_done} rounds charge "
            f"{_runs(charged.history)}: another σ, cohort or number of clients"
        )
    return None


class _Charges:
    """Records what ``claim.charge`` charges, merged as the accountants merge their history."""

    def __init__(self):
        self.history: list[tuple[float, float, int]] = []

    def step(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> None:
        append_rounds(self.history, noise_multiplier, sample_rate, rounds)


def _runs(runs: list[tuple]) -> str:
    return "; ".join(f"{n} rounds at σ {s:g}, q {q:g}" for s, q, n in runs) or "nothing"
