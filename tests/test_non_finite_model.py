"""A round whose server step overflows float32 stops the run: no inf model is evaluated,
reported with an ε, or checkpointed."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config

from algorithms.algorithm import Algorithm
from algorithms.server import ServerState
from cluster.runtime.checkpoint import checkpoint_path, load_checkpoint
from cluster.runtime.experiment import run_experiment
from cluster.runtime.simulation import NonFiniteModel, finite_step


def test_an_overflowing_round_stops_the_run_and_keeps_the_last_checkpoint(store_root, monkeypatch):
    config = small_config(store_root, "rounds=3", "checkpoint.every=1", "seed=7")
    step, steps = Algorithm.server_step, []

    def overflow_in_round_2(self, state, total, ctx):
        new = step(self, state, total, ctx)
        steps.append(ctx)
        if len(steps) == 2:
            new.params[0] = torch.inf
        return new

    monkeypatch.setattr(Algorithm, "server_step", overflow_in_round_2)
    rounds = []
    with pytest.raises(NonFiniteModel) as error:
        run_experiment(config, on_round=rounds.append)
    message = str(error.value)
    path = checkpoint_path(config, None)
    assert "round 2: the server step left 1 of the " in message and "of its parameters" in message
    assert f"its last checkpoint, of round 1: {path}" in message
    assert [r.round for r in rounds] == [1]
    kept = load_checkpoint(path)["simulation"]
    assert kept["rounds_done"] == 1 and bool(torch.isfinite(kept["params"]).all())


def test_a_non_finite_server_extra_stops_the_step_that_made_it():
    """An inf momentum (or c, or sketch table) reaches the parameters a round later; it is
    refused in the round that produced it."""
    momentum = torch.zeros(4)
    momentum[2] = torch.nan
    state = ServerState(torch.zeros(4), {"momentum": momentum})
    with pytest.raises(NonFiniteModel, match="round 5: .* 1 of the 4 numbers of its momentum"):
        finite_step(state, 4)
    fine = ServerState(torch.zeros(4), {"momentum": torch.ones(4)})
    assert finite_step(fine, 4) is fine
