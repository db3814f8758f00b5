"""``privacy.secret_streams``: a run's streams keyed by a secret from the operating system,
fresh for every run, held by its checkpoint (a resume continues them). That no log holds it:
``tests/test_privacy_claims.py`` (``SECRET_STREAMS``)."""

import pytest
import torch
from helpers import small_config

from cluster.config import ConfigError
from cluster.runtime.checkpoint import open_checkpoint, save_checkpoint
from cluster.runtime.experiment import run_experiment

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
    other = f"{(int(key, 16) + 1) % 2**128:032x}"
    saved["simulation"]["streams_secret"] = other
    elsewhere = run_experiment(config, resume=saved)
    assert not torch.equal(elsewhere.result.params, resumed[0].result.params)

    lacking = {k: v for k, v in saved["simulation"].items() if k != "streams_secret"}
    save_checkpoint(tmp_path / "lacking.pt", lacking, saved["config"], None)
    with pytest.raises(ConfigError, match="its simulation lacks streams_secret"):
        open_checkpoint(tmp_path / "lacking.pt")
    save_checkpoint(
        tmp_path / "short.pt", {**lacking, "streams_secret": "ab"}, saved["config"], None
    )
    with pytest.raises(ConfigError, match="streams' secret is not 32 hexadecimal digits"):
        open_checkpoint(tmp_path / "short.pt")
