"""``stop_at_bytes``: DPSFL's communication budget (spec 002 §4). The run ends after the round
whose cumulative bytes up and down, over all clients, reach it; it ends as a completed run does
(final evaluation, checkpoint, terminal line), with the ε of the rounds that ran; a resume
runs no further round unless ``--set stop_at_bytes`` raises the budget."""

import pytest
import torch
from helpers import small_config

from cluster.cli.main import main
from cluster.config import ConfigError
from cluster.runtime.checkpoint import open_checkpoint
from cluster.runtime.experiment import run_experiment

# dp_fedavg on the 410-parameter logistic model, 5 clients a round: each downloads the float32
# model and uploads a float32 update, 2·5·410·4 bytes a round.
PER_ROUND = 2 * 5 * 410 * 4
DP = (
    "algorithm.name=dp_fedavg",
    "algorithm.clip_norm=0.5",
    "algorithm.noise_multiplier=1.0",
    "cohort.sampling=fixed",
    "eval_every=4",
)


def test_the_run_stops_after_the_round_that_reaches_the_budget(store_root, tmp_path, capsys):
    ckpt = f"checkpoint.dir={tmp_path}"
    budget = f"stop_at_bytes={2.5 * PER_ROUND}"
    stopped = run_experiment(small_config(store_root, *DP, ckpt, "rounds=10", budget))
    history = stopped.result.history
    assert [r.metrics["communication_bytes"] for r in history] == [PER_ROUND * t for t in (1, 2, 3)]
    assert stopped.result.stop_reason == (
        f"communication budget spent: {3 * PER_ROUND:,} bytes up and down after round 3 "
        f"(stop_at_bytes = {2.5 * PER_ROUND:,.0f})"
    )
    assert history[-1].test_accuracy is not None  # the last round is evaluated (eval_every 4)
    # What ran is the 3-round run, its ε included: the accountant charged 3 rounds.
    three = run_experiment(
        small_config(store_root, *DP, f"checkpoint.dir={tmp_path}/3", "rounds=3")
    )
    assert torch.equal(stopped.result.params, three.result.params)
    assert stopped.epsilon == three.epsilon and stopped.claim.dp_valid

    path = str(stopped.checkpoint)
    assert main(["resume", path]) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "--set stop_at_bytes=B" in out
    assert open_checkpoint(path)[0]["simulation"]["rounds_done"] == 3  # left as it was


def test_a_raised_budget_continues_the_run_to_it(store_root, tmp_path, capsys):
    ckpt = f"checkpoint.dir={tmp_path}"
    first = run_experiment(
        small_config(store_root, *DP, ckpt, "rounds=10", f"stop_at_bytes={PER_ROUND}")
    )
    assert not first.interrupted  # ended as a completed run: MLflow status FINISHED
    path = str(first.checkpoint)
    assert main(["resume", path, "--set", f"stop_at_bytes={3 * PER_ROUND}"]) == 0
    assert "done: communication budget spent" in capsys.readouterr().out
    history = open_checkpoint(path)[0]["simulation"]["history"]
    assert [r["metrics"]["communication_bytes"] for r in history] == [
        PER_ROUND * t for t in (1, 2, 3)
    ]


@pytest.mark.parametrize("value", [0, -1, -1.0e9])
def test_a_budget_must_be_positive(store_root, value):
    with pytest.raises(ConfigError) as error:
        small_config(store_root, f"stop_at_bytes={value}")
    assert error.value.field_path == "stop_at_bytes" and "must be > 0" in str(error.value)
