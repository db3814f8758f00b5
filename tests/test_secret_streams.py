"""``privacy.secret_streams``: a run's streams keyed by a secret from the operating system,
fresh for every run, held by its checkpoint (a resume continues them). That no log holds it:
``tests/test_privacy_claims.py`` (``SECRET_STREAMS``)."""

import pytest
import torch
from helpers import small_config

from cluster.config import ConfigError
from cluster.runtime.checkpoint import open_checkpoint, save_checkpoint
from cluster.runtime.experiment import run_experiment
from cluster.runtime.simulation import Simulation

PRIVATE = (
    "algorithm.name=dp_fedavg",
    "algorithm.clip_norm=0.5",
    "algorithm.noise_multiplier=1",
    "cohort.sampling=poisson",
    "privacy.secret_streams=true",
)


def test_each_run_draws_its_own_secret_and_a_resume_continues_it(store_root, tmp_path):
    first, second = (
        run_experiment(small_config(store_root, *PRIVATE, f"checkpoint.dir={tmp_path / name}"))
        for name in ("first", "second")
    )
    keys = [
        open_checkpoint(r.checkpoint)[0]["simulation"]["streams_secret"] for r in (first, second)
    ]
    assert keys[0] != keys[1]
    assert not torch.equal(first.result.params, second.result.params)  # other noise, cohorts
    with pytest.raises(ValueError, match="the run's secret"):
        first.config.streams_seed  # noqa: B018  (never the logged seed in its place)
    saved, config = open_checkpoint(first.checkpoint, ["rounds=8"])
    key = saved["simulation"]["streams_secret"]
    resumed = [run_experiment(config, resume=open_checkpoint(first.checkpoint)[0])]
    resumed.append(run_experiment(config, resume=saved))
    assert torch.equal(resumed[0].result.params, resumed[1].result.params)
    other = f"{int(key, 16) ^ 1:032x}"
    saved["simulation"]["streams_secret"] = other
    elsewhere = run_experiment(config, resume=saved)
    assert not torch.equal(elsewhere.result.params, resumed[0].result.params)

    lacking = {k: v for k, v in saved["simulation"].items() if k != "streams_secret"}
    save_checkpoint(tmp_path / "lacking.pt", lacking, saved["config"], None)
    with pytest.raises(ConfigError, match="its simulation lacks streams_secret"):
        open_checkpoint(tmp_path / "lacking.pt")
    for wrong in ("ab", "0" * 31 + "1"):  # not 32 digits; a key below the secret floor
        save_checkpoint(
            tmp_path / "wrong.pt", {**lacking, "streams_secret": wrong}, saved["config"], None
        )
        with pytest.raises(ConfigError, match="streams' secret is not a key of 32 hexadecimal"):
            open_checkpoint(tmp_path / "wrong.pt")


def test_a_run_that_fails_before_its_first_checkpoint_resumes_its_streams(
    store_root, tmp_path, monkeypatch
):
    """The key is kept before round 1: a run stopped hard before its first periodic checkpoint
    (killed: no error handler runs, unlike an error in a round, whose last completed round is
    kept: tests/test_checkpoint.py), its round-1 metrics released, resumes the same streams (a
    new run would draw a new key, a second release no ε counts)."""
    config = small_config(
        store_root, *PRIVATE, f"checkpoint.dir={tmp_path}", "rounds=3", "checkpoint.every=10"
    )
    released = []
    real = Simulation.run_round

    class Killed(BaseException):
        """The process ending mid-round, as SIGKILL would (no ``Exception`` handler runs)."""

    def killed_in_round_2(self, index, *args, **kwargs):
        if index == 1:
            raise Killed
        return real(self, index, *args, **kwargs)

    monkeypatch.setattr(Simulation, "run_round", killed_in_round_2)
    with pytest.raises(Killed):
        run_experiment(config, on_round=released.append)
    monkeypatch.undo()
    (path,) = tmp_path.glob("*.pt")
    saved, again = open_checkpoint(path)
    assert saved["simulation"]["rounds_done"] == 0 and len(released) == 1
    resumed = run_experiment(again, resume=saved)
    assert resumed.result.history[0].test_loss == released[0].test_loss
