"""`python -m cluster sweep`: spec checks, seeded search, selection by the mean over seeds, and
(slow) a 4 × 2 sweep on the embedded Ray, two trials at once, against the same runs alone."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from benchmarks.sweep import SPACE, tiny_base
from cluster.analysis.sweep_plan import plan
from cluster.analysis.sweep_report import TrialRecord, summarize
from cluster.analysis.sweep_spec import FOLD, SweepTrial, load
from cluster.analysis.trials import calibrate
from cluster.cli.main import main
from cluster.config import ConfigError
from cluster.runtime.checkpoint import load_checkpoint
from tests.helpers import run_local


def _base(store_root, tmp_path) -> dict:
    return tiny_base(store_root, tmp_path / "ck")


def _write(tmp_path, name: str, spec: dict) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# ------------------------------------------------------------------------- fast: the spec


@pytest.mark.parametrize(
    "space, extra, named",
    [
        ({"algorithm.lrr": [0.1]}, {}, ["algorithm.lrr", "unknown key", "trial lrr=0.1"]),
        ({"algorithm.local.lr": []}, {}, ["space.algorithm.local.lr", "empty list"]),
        ({}, {}, ["space", "mapping"]),
        (
            {"algorithm.local.lr": [0.1, -1.0], "algorithm.clip_norm": [0.5]},
            {},
            ["algorithm.local.lr", "-1.0", "trial lr=-1-clip_norm=0.5, seed 0"],
        ),
        (
            {"algorithm.local.lr": {"distribution": "uniform", "low": 0.1, "high": 0.2}},
            {},
            ["space.algorithm.local.lr", "a grid needs a list"],
        ),
        ({"algorithm.local.lr": [0.1]}, {"select": {"metric": "accuracy"}}, ["select.metric"]),
        ({"algorithm.local.lr": [0.1]}, {"seeds": 0}, ["seeds = 0"]),
        (
            {"algorithm.local.lr": [0.1]},
            {"search": {"method": "random", "seed": 1}},
            ["search", "num_samples"],
        ),
        (
            {"algorithm.local.lr": [0.1]},
            {"search": {"method": "random", "seed": 1, "num_trials": {"distribution": "poisson"}}},
            ["search.num_trials", "mean"],
        ),
        (
            {"data.partition": [{"method": "natural"}, {"method": "dirichlet", "alpha": 0.3}]},
            {},
            ["space.data.partition", "sweep the mapping's own fields"],
        ),
        ({"algorithm.local.lr": [0.1, 0.2, 0.1]}, {}, ["space.algorithm.local.lr = 0.1", "twice"]),
        (
            {"algorithm.local.lr": [0.1], "data.validation.fold": [0, 1]},
            {"search": {"method": "random", "seed": 1, "num_samples": 2}},
            ["space.data.validation.fold", "every fold"],
        ),
    ],
)
def test_bad_specs_exit_2_naming_field_value_and_trial(
    tmp_path, store_root, capsys, space, extra, named
):
    spec = _write(tmp_path, "bad", {"base": _base(store_root, tmp_path), "space": space, **extra})
    assert main(["sweep", str(spec)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("sweep: config error:")
    for text in named:
        assert text in error


def test_selecting_on_validation_needs_validation_data(tmp_path, store_root, capsys):
    base = _base(store_root, tmp_path)
    del base["data"]["validation"]
    spec = _write(tmp_path, "noval", {"base": base, "space": {"algorithm.local.lr": [0.1]}})
    assert main(["sweep", str(spec)]) == 2
    assert "select.metric = 'validation_accuracy'" in capsys.readouterr().err


def test_grid_and_seeded_random_search(tmp_path, store_root):
    base = _base(store_root, tmp_path)
    grid = {"algorithm.local.lr": [0.05, 0.1], "algorithm.clip_norm": [0.5, 1.0]}
    planned = plan(_write(tmp_path, "g", {"base": base, "space": grid, "seeds": [3, 7]}), [])
    names = [r.name for r in planned.records]
    key = [r.trial.key for r in planned.records]
    assert names[:3] == [
        f"sweep-g-lr=0.05-clip_norm=0.5-{key[0]}-seed3",
        f"sweep-g-lr=0.05-clip_norm=0.5-{key[1]}-seed7",
        f"sweep-g-lr=0.05-clip_norm=1-{key[2]}-seed3",
    ]
    assert key[0] == key[1] != key[2] and key[2].startswith("c1-")
    assert len(names) == 8 and len({r.digest for r in planned.records}) == 8
    config = planned.configs[names[1]]
    assert (config.seed, config.algorithm.clip_norm, config.tracking.run_name) == (
        7,
        0.5,
        names[1],
    )
    space = {
        "algorithm.local.lr": {"distribution": "loguniform", "low": 0.01, "high": 1.0},
        "algorithm.rho": {"distribution": "choice", "values": [0.01, 0.1]},
    }
    search = {"method": "random", "seed": 5, "num_trials": {"distribution": "poisson", "mean": 4}}
    spec = {"base": base, "space": space, "search": search}
    first, again = (load(_write(tmp_path, "r", spec)).configurations() for _ in range(2))
    assert first == again and len(first) >= 1  # seeded: the same draw, count included
    assert all(0.01 <= dict(v)["algorithm.local.lr"] <= 1.0 for v in first)
    assert {dict(v)["algorithm.rho"] for v in first} <= {0.01, 0.1}
    other = load(_write(tmp_path, "r", spec | {"search": search | {"seed": 6}}))
    assert other.configurations() != first


def test_every_trial_draws_its_own_noise_and_cohorts(tmp_path, store_root, monkeypatch):
    """Composition (and Papernot–Steinke) assume independent trials. At one shared seed the
    noise of two trials was the same draw: the difference of their released models was the
    noiseless difference (the review's 1.8e-7 against 0.159). Each trial now has its own
    ``stream_seed``; the validation split stays the seed's, and a plan made again, or a
    trial repeated by selected.yaml, has the same streams (the same computation)."""
    from dataclasses import replace

    from actors.client_host import ClientHost
    from cluster.analysis.sweep import selected_yaml
    from cluster.runtime import simulation
    from cluster.runtime.experiment import run_experiment
    from cluster.runtime.store import open_store

    base = _base(store_root, tmp_path)
    base["privacy"] = {"accountant": "rdp"}
    base["algorithm"] |= {"noise_multiplier": 1.0}
    space = {"algorithm.local.lr": [0.05, 0.5]}
    path = _write(tmp_path, "n", {"base": base, "space": space, "seeds": [0, 1]})
    planned = plan(path, [])
    configs = [planned.configs[r.name] for r in planned.records]
    streams = [c.streams_seed for c in configs]
    assert len(set(streams)) == 4 and all(0 <= s < 2**63 for s in streams)
    assert [c.streams_seed for c in plan(path, []).configs.values()] == streams
    assert streams[0] != plan(path, ["rounds=2"]).configs[planned.records[0].name].streams_seed
    chosen = yaml.safe_load(selected_yaml(planned, (("algorithm.local.lr", 0.5),)))
    assert (chosen["seed"], chosen["stream_seed"]) == (0, configs[2].streams_seed)

    seeds: list[tuple] = []  # what the run's own path hands the cohorts and the hosts
    real_cohort, real_host = simulation.sample_cohort, ClientHost.__init__

    def cohort(sampling, num_clients, size, seed, round_index):
        seeds.append(("cohort", seed))
        return real_cohort(sampling, num_clients, size, seed, round_index)

    def host(self, *args, **kwargs):
        seeds.append(("host", args[3], kwargs["data_seed"]))
        real_host(self, *args, **kwargs)

    monkeypatch.setattr(simulation, "sample_cohort", cohort)
    monkeypatch.setattr(ClientHost, "__init__", host)

    def released(config, sigma):  # as a trial runs: run_experiment
        config = replace(config, rounds=1, executor=replace(config.executor, kind="local"))
        config = replace(config, algorithm=replace(config.algorithm, noise_multiplier=sigma))
        config = replace(config, tracking=replace(config.tracking, enabled=False))
        seeds.clear()
        params = run_experiment(config).result.params
        assert seeds == [("host", config.streams_seed, 0), ("cohort", config.streams_seed)]
        return params

    a, b = configs[0], configs[2]  # lr 0.05 and 0.5, both at seed 0
    assert a.seed == b.seed == 0
    runs = {(c.algorithm.local.lr, s): released(c, s) for c in (a, b) for s in (1.0, 0.0)}
    noise = {lr: runs[lr, 1.0] - runs[lr, 0.0] for lr in (0.05, 0.5)}
    assert noise[0.05].norm() > 0.1 and noise[0.5].norm() > 0.1
    assert (noise[0.05] - noise[0.5]).norm() > 0.5 * noise[0.05].norm()  # independent draws
    # The data's randomness is shared: the same store of held-out validation rows for both.
    held = [open_store(c)[0] for c in (a, b)]
    assert held[0].location == held[1].location and held[0].num_validation > 0
    # With secret streams each trial draws its own key as it starts; selected.yaml cannot
    # repeat one and says so.
    secret = base | {"privacy": {"accountant": "rdp", "secret_streams": True}}
    kept = plan(_write(tmp_path, "s", {"base": secret, "space": space, "seeds": [0, 1]}), [])
    assert all(c.stream_seed is None and c.privacy.secret_streams for c in kept.configs.values())
    text = selected_yaml(kept, (("algorithm.local.lr", 0.5),))
    assert yaml.safe_load(text)["stream_seed"] is None and "a fresh secret key" in text


@pytest.mark.parametrize("given", ["seed=7", "stream_seed=3"])
def test_seeds_are_the_sweeps_to_set(tmp_path, store_root, capsys, given):
    space = {"algorithm.local.lr": [0.1]}
    path = _write(tmp_path, "s", {"base": _base(store_root, tmp_path), "space": space})
    assert main(["sweep", str(path), "--set", given]) == 2
    assert f"--set = '{given}'" in capsys.readouterr().err
    base = _base(store_root, tmp_path)
    bad = _write(tmp_path, "s2", {"base": base, "space": {"stream_seed": [1]}})
    assert main(["sweep", str(bad)]) == 2
    assert "space.stream_seed" in capsys.readouterr().err


def test_selection_is_by_the_mean_over_seeds_never_the_best_seed(tmp_path, store_root):
    spec = load(
        _write(tmp_path, "s", {"base": _base(store_root, tmp_path), "space": {"x": [1]}})
    )  # the space is not built here: only the records are summarised

    def record(value, seed, metric, status="FINISHED"):
        trial = SweepTrial((("algorithm.local.lr", value),), seed, int(value * 10))
        return TrialRecord(trial, trial.name("s"), "", status, metric=metric, test_accuracy=0.5)

    records = [
        record(0.1, 0, 0.95), record(0.1, 1, 0.15),  # the best seed, a poor mean (0.55)
        record(0.2, 0, 0.60), record(0.2, 1, 0.62),  # mean 0.61: selected
        record(0.3, 0, 0.99), record(0.3, 1, None, "FAILED"),  # incomplete: never selected
    ]  # fmt: skip
    rows = summarize(spec, records)
    assert [r["selected"] for r in rows] == [False, True, False]
    assert rows[0]["validation_accuracy_mean"] == pytest.approx(0.55)
    assert (rows[2]["trials_finished"], rows[2]["trials"]) == (1, 2)


def test_a_trial_computed_by_earlier_code_has_another_identity(tmp_path, store_root):
    """The code of 2026-11-28 computes some configs otherwise (synthetic standardisation, crop
    padding, ...): a resumed sweep must not adopt a finished trial of the earlier code, whose
    identity was the configuration's hash marked own-streams/ alone."""
    import hashlib

    from cluster.analysis.sweep_spec import trial_digest
    from privacy.tuning import configuration_key

    spec = {"base": _base(store_root, tmp_path), "space": {"algorithm.local.lr": [0.1]}}
    planned = plan(_write(tmp_path, "ids", spec), [])
    config = planned.configs[planned.records[0].name]
    earlier = f"own-streams/{configuration_key(config.to_dict())}"
    earlier = f"{hashlib.sha256(earlier.encode()).hexdigest()[:16]}-seed{config.seed}"
    assert planned.records[0].digest == trial_digest(config) != earlier


def test_a_random_choice_drawn_twice_is_a_trial_of_its_own(tmp_path, store_root):
    """6 draws of 3 values: 6 trials under 6 names (a repeated draw its own run, tagged
    ``-repeat<n>``), and a row of its own: Papernot–Steinke's bound covers the best of K
    draws each ranked by its own score, so the best draw is selected even where the mean of its
    value's draws is not the best, and selected.yaml repeats that draw."""
    from cluster.analysis.sweep import _chosen_values, selected_yaml

    space = {"algorithm.local.lr": [0.01, 0.05, 0.1]}
    search = {"method": "random", "seed": 0, "num_samples": 6}
    spec = {"base": _base(store_root, tmp_path), "space": space, "search": search}
    planned = plan(_write(tmp_path, "rc", spec), [])
    records = planned.records
    drawn = [dict(r.trial.values)["algorithm.local.lr"] for r in records]
    assert len(records) == 6 and len(set(drawn)) < 6  # the repro: values drawn more than once
    assert len({r.name for r in records}) == 6 and set(planned.configs) == {r.name for r in records}
    assert len({r.digest for r in records}) == 6
    assert len({planned.configs[r.name].checkpoint.dir for r in records}) == 1  # tracked: by id
    repeated = next(v for v in drawn if drawn.count(v) > 1)
    for r, value in zip(records, drawn, strict=True):  # the repeated value's first draw best,
        best = value == repeated and r.repeat == 0  # its mean below every other value's
        r.status, r.metric = "FINISHED", 0.9 if best else (0.6 if value != repeated else 0.0)
    rows = summarize(planned.spec, records)
    assert [r["trials"] for r in rows] == [1] * 6  # one seed: a draw a row
    (chosen,) = [r for r in rows if r["selected"]]
    assert chosen[planned.spec.select.metric + "_mean"] == 0.9
    values = _chosen_values(planned)
    first = next(r for r in records if dict(r.trial.values)["algorithm.local.lr"] == repeated)
    text = selected_yaml(planned, values)
    assert f"stream_seed: {planned.configs[first.name].stream_seed}" in text
    assert "draw" not in text.splitlines()[0]  # the header names no draw count


def test_grid_values_alike_to_4_figures_are_distinct_trials_and_selections(tmp_path, store_root):
    """0.123451 and 0.123459 read 0.1235 both: two trials, two labels, and the selection is the
    exact value that scored best (selected.yaml too), never the first of that label."""
    from cluster.analysis.sweep import _chosen_values, selected_yaml

    base = _base(store_root, tmp_path)
    base["tracking"] = {"enabled": False}  # untracked: each trial's checkpoint folder by name
    space = {"algorithm.local.lr": [0.123451, 0.123459]}
    planned = plan(_write(tmp_path, "near", {"base": base, "space": space}), [])
    a, b = planned.records
    assert a.name != b.name and a.digest != b.digest
    assert [planned.configs[r.name].algorithm.local.lr for r in (a, b)] == [0.123451, 0.123459]
    assert planned.configs[a.name].checkpoint.dir != planned.configs[b.name].checkpoint.dir
    a.status, a.metric, b.status, b.metric = "FINISHED", 0.5, "FINISHED", 0.9
    rows = summarize(planned.spec, planned.records)
    assert [r["configuration"] for r in rows] == ["lr=0.123451", "lr=0.123459"]
    assert [r["selected"] for r in rows] == [False, True]
    assert _chosen_values(planned) == (("algorithm.local.lr", 0.123459),)
    chosen = yaml.safe_load(selected_yaml(planned, _chosen_values(planned)))
    assert chosen["algorithm"]["local"]["lr"] == 0.123459


def test_a_trial_that_started_and_did_not_finish_leaves_the_sweep_without_epsilon(
    tmp_path, store_root
):
    """A FAILED or KILLED trial trained on the private data: its rounds are not accounted, so
    the tuning statement has no ε, and says which trial."""
    from cluster.analysis.sweep import statement

    space = {"algorithm.local.lr": [0.05, 0.1, 0.2]}
    planned = plan(
        _write(tmp_path, "st", {"base": _base(store_root, tmp_path), "space": space}), []
    )
    done, failed, killed = planned.records
    done.status, done.privacy = "FINISHED", {
        "label": done.name, "unit": "client", "dp_valid": True, "delta": 1e-5, "epsilon": 1.0,
    }  # fmt: skip
    failed.status, killed.status = "FAILED", "KILLED"
    tuning = statement(planned, planned.records)
    assert tuning.epsilon is None and tuning.delta == 1e-5
    assert f"{failed.name} FAILED" in tuning.reason and f"{killed.name} KILLED" in tuning.reason
    assert "not accounted" in tuning.line()
    killed.status = "NOT RUN"  # never started: nothing to account
    assert (
        f"trial {failed.name} FAILED: its rounds are not accounted"
        in statement(planned, planned.records).reason
    )


def _tracked_plan(tmp_path, store_root, sqlite_store, name: str, space: dict):
    """The plan of a sweep ``name`` over ``space``, tracked in a new SQLite store: (planned,
    its client, the experiment ``sweep``'s id)."""
    planned = plan(
        _write(tmp_path, name, {"base": _base(store_root, tmp_path), "space": space}), []
    )
    uri = sqlite_store(tmp_path / "mlflow.db")
    planned.tracking = (uri, "sweep")
    client = MlflowClient(uri)
    return planned, client, client.create_experiment("sweep")


def test_a_resumed_sweep_accounts_for_its_earlier_attempts(tmp_path, store_root, sqlite_store):
    """A trial killed (or failed) in an earlier attempt and run again since: its run, a child
    of the parent run that no trial holds, trained on the private data: no ε."""
    from cluster.analysis.sweep import statement
    from cluster.analysis.sweep_runs import earlier_attempts

    planned, client, experiment = _tracked_plan(
        tmp_path, store_root, sqlite_store, "ea", {"algorithm.local.lr": [0.05]}
    )
    parent = client.create_run(experiment).info.run_id
    children = {}
    for status in ("KILLED", "FINISHED"):
        run = client.create_run(experiment, tags={"mlflow.parentRunId": parent}, run_name=status)
        client.set_terminated(run.info.run_id, status)
        children[status] = run.info.run_id
    record = planned.records[0]
    record.status, record.run_id = "FINISHED", children["FINISHED"]  # the rerun
    record.privacy = {"label": record.name, "unit": "client", "dp_valid": True, "delta": 1e-5,
                      "epsilon": 1.0}  # fmt: skip
    earlier = earlier_attempts(planned, parent)
    assert earlier == [f"KILLED KILLED (an earlier attempt, run {children['KILLED']})"]
    tuning = statement(planned, planned.records, earlier)
    assert tuning.epsilon is None and "KILLED KILLED (an earlier attempt" in tuning.reason


def test_a_tracked_rerun_counts_the_ledgers_attempts_that_mlflow_does_not_hold(
    tmp_path, store_root, sqlite_store
):
    """Tracking on, a rerun against a store whose parent run holds none of the attempts the
    local ledger recorded (another directory's sqlite:///mlflow.db, a deleted child run): a
    SUBMITTED entry (its run unknown) and a FAILED one whose run is no child of the parent are
    earlier attempts (no ε); a KILLED one whose run is a child is MLflow's earlier attempt,
    counted once."""
    from cluster.analysis.sweep import statement
    from cluster.analysis.sweep_ledger import FOLDER, Ledger
    from cluster.analysis.sweep_runs import MlflowLedger
    from cluster.analysis.trials import Trial, TrialResult

    space = {"algorithm.local.lr": [0.05, 0.1, 0.2]}
    planned = plan(
        _write(tmp_path, "tl", {"base": _base(store_root, tmp_path), "space": space}), []
    )
    trials = [Trial(r.name, planned.configs[r.name]) for r in planned.records]
    uri = sqlite_store(tmp_path / "mlflow.db")
    planned.tracking = (uri, "sweep")
    client = MlflowClient(uri)
    experiment = client.create_experiment("sweep")
    parent = client.create_run(experiment).info.run_id
    killed = _child_run(client, experiment, parent, trials[2].config, "KILLED", 1)
    ledger = Ledger(tmp_path / "out" / FOLDER, planned.spec.name, True)
    ledger.read(planned.records)
    for trial, record, run_id, status in zip(
        trials,
        planned.records,
        [None, "0123456789abcdef", killed],
        ["SUBMITTED", "FAILED", "KILLED"],
        strict=True,
    ):
        ledger.submitting(trial)
        if status != "SUBMITTED":
            record.status, record.run_id = status, run_id
            ledger.record(record, TrialResult(trial), None)

    planned = plan(
        _write(tmp_path, "tl", {"base": _base(store_root, tmp_path), "space": space}), []
    )
    planned.tracking = (uri, "sweep")
    rerun = MlflowLedger(
        planned, parent, Ledger(tmp_path / "out" / FOLDER, planned.spec.name, True)
    )
    rerun.find_finished(planned.records)
    submitted, failed, _ = planned.records
    folder = tmp_path / "out" / FOLDER
    assert rerun.earlier_attempts() == [
        f"{trials[2].name} KILLED (an earlier attempt, run {killed})",
        f"{submitted.name} SUBMITTED (an earlier attempt in {folder / submitted.digest}.json, its "
        f"run unknown: not under the parent run {parent})",
        f"{failed.name} FAILED (an earlier attempt in {folder / failed.digest}.json, run "
        f"0123456789abcdef: not under the parent run {parent})",
    ]
    assert statement(planned, [], rerun.earlier_attempts()).epsilon is None


def _child_run(client, experiment, parent, config, status, start, params=None) -> str:
    """A run of ``config`` (its params, or ``params``) under ``parent``, ended ``status``."""
    from mlflow.entities import Param

    from cluster.tracking.process import flatten

    tags = {"mlflow.parentRunId": parent}
    run_id = client.create_run(experiment, start, tags, config.tracking.run_name).info.run_id
    logged = [Param(k, v) for k, v in (params or flatten(config.to_dict())).items()]
    for first in range(0, len(logged), 100):
        client.log_batch(run_id, params=logged[first : first + 100])
    client.set_terminated(run_id, status)
    return run_id


def test_a_rerun_resumes_a_killed_trial_only_from_its_own_matching_checkpoint(
    tmp_path, store_root, sqlite_store
):
    """Under the sweep's parent run, a KILLED run whose params are the trial's and whose
    checkpoint is that run's, of the trial's config, is continued; a KILLED run without a
    checkpoint, with another run's checkpoint, with another config's, whose params differ, or
    whose completed rounds are not all in its checkpoint (tagged ``rounds_not_in_checkpoint``
    by a second stop signal), is not (the trial runs from round 0; a line says why), nor a
    FAILED run or one under another parent. The continued run is no earlier attempt; the
    others stay ones (no ε)."""
    from dataclasses import replace

    from cluster.analysis.sweep_resume import resume_killed
    from cluster.analysis.sweep_runs import earlier_attempts
    from cluster.analysis.trials import Trial
    from cluster.runtime.checkpoint import checkpoint_path, save_checkpoint
    from cluster.tracking.process import flatten

    space = {"algorithm.local.lr": [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}
    planned = plan(
        _write(tmp_path, "rk", {"base": _base(store_root, tmp_path), "space": space}), []
    )
    trials = [Trial(r.name, calibrate(planned.configs[r.name], lambda line: None))
              for r in planned.records]  # fmt: skip
    resumed, missing, other_run, other_config, other_params, failed, abandoned = trials
    uri = sqlite_store(tmp_path / "mlflow.db")
    planned.tracking = (uri, "sweep")
    client = MlflowClient(uri)
    experiment = client.create_experiment("sweep")
    parent, elsewhere = (client.create_run(experiment).info.run_id for _ in range(2))

    def run(trial, status="KILLED", start=2, under=parent, params=None) -> str:
        return _child_run(client, experiment, under, trial.config, status, start, params)

    def checkpoint(trial, run_id, config=None) -> Path:
        path = checkpoint_path(trial.config, run_id)
        save_checkpoint(path, state, (config or trial.config).to_dict(), run_id)
        return path

    config = resumed.config
    state = run_local(_local(replace(config, rounds=1))).state_dict()  # a round of the trial
    older = run(resumed, start=1)
    ids = {t.name: run(t) for t in (resumed, missing, other_run, other_config)}
    changed = flatten(other_params.config.to_dict()) | {"algorithm.clip_norm": "0.7"}
    ids[other_params.name] = run(other_params, params=changed)
    ids[failed.name] = run(failed, status="FAILED")
    ids[abandoned.name] = run(abandoned)
    client.set_tag(ids[abandoned.name], "rounds_not_in_checkpoint", "3")
    elsewhere_id = run(resumed, under=elsewhere, start=3)
    path = checkpoint(resumed, ids[resumed.name])
    client.set_tag(ids[resumed.name], "sweep_seconds", "12.500")  # what it ran before its kill
    checkpoint(resumed, elsewhere_id)
    checkpoint_path(config, ids[other_run.name]).write_bytes(path.read_bytes())
    checkpoint(other_config, ids[other_config.name], other_run.config)
    for trial in (other_params, failed, abandoned):
        checkpoint(trial, ids[trial.name])

    said = []
    after = resume_killed(trials, planned.tracking, parent, said.append)
    assert [t.resume for t in after] == [path, None, None, None, None, None, None]
    assert [t.config for t in after] == [t.config for t in trials]
    assert [t.seconds_before for t in after] == [12.5, 0, 0, 0, 0, 0, 0]  # its seconds add up
    why = {
        older: f"the trial resumes its newer run {ids[resumed.name]}",
        ids[missing.name]: f"no checkpoint at {checkpoint_path(config, ids[missing.name])}",
        ids[other_run.name]: f"continues run {ids[resumed.name]}, not this one",
        ids[other_config.name]: "written for another config (algorithm.local.lr differs)",
        ids[other_params.name]: "its param algorithm.clip_norm is '0.7', the trial's is '0.5'",
        ids[abandoned.name]: "3 round(s) it completed are in no checkpoint",
    }
    for run_id, reason in why.items():
        assert any(f"KILLED run {run_id} is not resumed (" in line and reason in line
                   for line in said), (run_id, said)  # fmt: skip
    continued = f"{resumed.name}: resuming its KILLED run {ids[resumed.name]} after round 1 "
    assert f"{continued}from {path} (12 s before)" in said
    assert f"{missing.name}: runs again from round 0" in said
    assert not any(failed.name in line or elsewhere_id in line for line in said)
    assert len(said) == len(why) + 1 + 5  # a line per refused run, the resumed, the reruns

    for record, trial in zip(planned.records, trials, strict=True):  # as the rerun holds them
        record.run_id = ids[trial.name] if trial is resumed else None
    earlier = {line.split("run ")[-1].rstrip(")") for line in earlier_attempts(planned, parent)}
    assert earlier == set(ids.values()) - {ids[resumed.name]} | {older}


class _Ray:
    """What ``RayTrials`` asks Ray as trials run: a poll for an ended task (``ends``: one a
    poll, in order; a cancelled one is added), a task's result (``results``: a value, or an error
    it raises), a placement group's state (``created``; with ``create_on_cancel``, a task's group
    is created as the task is cancelled: the race of a cancel with its group's creation). It logs
    the launches (``log``, where the callbacks may log too) and the cancels (``cancelled``)."""

    def __init__(self, create_on_cancel: bool = False):
        import ray.exceptions

        self.exceptions = ray.exceptions
        self.create_on_cancel = create_on_cancel
        self.created, self.results = set(), {}
        self.ends, self.cancelled, self.log = [], [], []
        self.util = SimpleNamespace(
            placement_group_table=self._table, remove_placement_group=lambda group: None
        )

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 100.0}  # room for every trial of a test

    def wait(self, refs, num_returns, timeout):
        assert num_returns == 1 and timeout > 0  # a poll for an ended task: the next of ``ends``
        ended = [r for r in self.ends if r in refs][:1]
        return ended, [r for r in refs if r not in ended]

    def cancel(self, ref, recursive):
        assert not recursive  # the trial's task, not its actor calls
        self.cancelled.append(ref)
        self.results[ref] = self.exceptions.TaskCancelledError()
        self.ends += [ref] if ref not in self.ends else []
        if self.create_on_cancel:
            self.created.add(ref.replace("task", "group"))

    def get(self, ref):
        if isinstance(self.results[ref], Exception):
            raise self.results[ref]
        return self.results[ref]

    def _table(self, group) -> dict:
        return {"state": "CREATED" if group in self.created else "PENDING"}


def _three_trials(tmp_path, store_root) -> list:
    """Three trials of one spec, as the engine gets them."""
    from cluster.analysis.trials import Trial

    space = {"algorithm.local.lr": [0.05, 0.1, 0.2]}
    spec = _write(tmp_path, "en", {"base": _base(store_root, tmp_path), "space": space})
    planned = plan(spec, [])
    return [Trial(r.name, planned.configs[r.name]) for r in planned.records]


def _engine_on(ray: _Ray, placed: list[int], on_launch=lambda trial: None):
    """A ``RayTrials`` on ``ray`` whose i-th launched trial is ``task<i>`` in ``group<i>``, its
    group created at once where i is in ``placed`` (``on_launch`` called with it); each task ends
    as ``ray.ends`` says, returning its trial's ``TrialResult`` (KILLED: no outcome) unless
    cancelled first."""
    from cluster.analysis.trials import RayTrials, TrialResult

    engine = RayTrials(0, None, None)
    engine._ray = ray

    def launch(trial):
        i = len(ray.results)
        ray.results[f"task{i}"] = TrialResult(trial)
        ray.log.append(f"launch {trial.name}")
        if i in placed:
            ray.created.add(f"group{i}")
        on_launch(trial)
        return f"task{i}", f"group{i}"

    engine._launch = launch
    return engine


def on_fake_ray(placed: list[int], ends: list[int], on_launch=lambda trial: None):
    """``run_concurrently`` as ``RayTrials.run`` runs the trials, on a stand-in Ray
    (``_engine_on``): the trials at ``placed`` start, those at ``ends`` end in that order."""

    def run_concurrently(trials, concurrent, parent_run_id, on_done, on_submit=None):
        ray = _Ray()
        ray.ends = [f"task{i}" for i in ends]
        engine = _engine_on(ray, placed, on_launch)
        return engine.run(trials, lambda r: on_done(r, None), on_submit)

    return run_concurrently


@pytest.mark.timeout(60)
def test_a_trials_start_is_recorded_before_its_task_is_submitted(tmp_path, store_root):
    """``on_submit`` runs before a trial's task is submitted (from then on it may run), so
    that every trial that may have run was recorded first. Where it raises (a full disk), that
    trial is never submitted, nor any after it; the one running ends recorded, then
    ``RecordingFailed`` names the trial, the error and that it did not start."""
    from cluster.analysis.trials import RecordingFailed

    trials = _three_trials(tmp_path, store_root)
    ray, done = _Ray(), []
    ray.ends = ["task0"]
    engine = _engine_on(ray, placed=[0])

    def on_submit(trial) -> None:
        ray.log.append(f"submit {trial.name}")
        if trial is trials[1]:
            raise OSError(28, "No space left on device")

    with pytest.raises(RecordingFailed) as raised:
        engine.run(trials, done.append, on_submit)
    first, second, _ = (t.name for t in trials)
    assert ray.log == [f"submit {first}", f"launch {first}", f"submit {second}"]
    assert [(r.trial, r.started) for r in done] == [(trials[0], True)]
    assert str(raised.value) == (
        f"{second}: recording its start failed (OSError: [Errno 28] No space left on device): "
        "not started; no trial started after that (2 not started), the others running then ran "
        "to their end"
    )
    assert ray.cancelled == [] and engine._running == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("created_as_cancelled", [False, True])
def test_a_failed_recording_of_an_end_withholds_the_trials_not_placed(
    tmp_path, store_root, created_as_cancelled
):
    """``on_done`` raising for the first trial: the second, placed, still runs to its end and
    is passed to ``on_done``; the third, whose placement group is not created, is cancelled.
    It never ran (NOT RUN, ``started`` False: the ledger puts its entry back) unless its group
    was created as it was cancelled: then it may have started, and it ends as a trial that ran
    (KILLED, a rerun's earlier attempt), named so by ``RecordingFailed``."""
    from cluster.analysis.trials import RecordingFailed

    trials = _three_trials(tmp_path, store_root)
    ray, done = _Ray(create_on_cancel=created_as_cancelled), []
    ray.ends = ["task0", "task1"]
    engine = _engine_on(ray, placed=[0, 1])

    def on_done(result) -> None:
        if result.trial is trials[0]:
            raise OSError(28, "No space left on device")
        done.append(result)

    with pytest.raises(RecordingFailed) as raised:
        engine.run(trials, on_done, lambda trial: None)
    counts = "0 not started, 1 stopped while starting" if created_as_cancelled else "1 not started"
    assert str(raised.value) == (
        f"{trials[0].name}: recording its end failed (OSError: [Errno 28] No space left on "
        f"device); no trial started after that ({counts}), the others running then ran to "
        "their end"
    )
    ended = [(r.trial, r.status) for r in done]
    assert ended == [
        (trials[1], "KILLED"),
        (trials[2], "KILLED" if created_as_cancelled else "NOT RUN"),
    ]
    assert ray.cancelled == ["task2"] and engine._running == {}


@pytest.mark.timeout(60)
def test_a_failed_recording_while_a_stop_signal_ends_the_trials_ends_the_others(
    tmp_path, store_root
):
    """``on_done`` raising as the first stopped trial ends: the others still end and are
    passed to ``on_done`` (each has written its checkpoint), and ``Interrupted`` names the
    failure beside the stop."""
    from cluster.runtime.interrupts import Interrupted, StopSignals

    trials = _three_trials(tmp_path, store_root)
    ray, done = _Ray(), []
    engine = _engine_on(ray, placed=[0, 1, 2])

    def on_done(result) -> None:
        if result.trial is trials[0]:
            raise ValueError("no privacy")
        done.append(result.trial)

    def signal_comes(trial) -> None:  # as the last trial is submitted
        if trial is trials[-1]:
            stop.reason, stop.signum = "interrupted by SIGINT", signal.SIGINT

    with StopSignals(lambda line: None) as stop, pytest.raises(Interrupted) as raised:
        engine.run(trials, on_done, signal_comes)
    assert done == trials[1:] and ray.cancelled == ["task0", "task1", "task2"]
    assert str(raised.value) == (
        f"interrupted by SIGINT: 3 trial(s) stopped, 0 not started; {trials[0].name}: "
        "recording its end failed (ValueError: no privacy); rerun the same command to resume"
    )
    assert engine._running == {}


@pytest.mark.timeout(60)
def test_a_first_stop_signal_leaves_the_round_of_a_withheld_trial_that_started(
    tmp_path, store_root
):
    """A trial withheld after a failed recording, its group created as it was cancelled, may
    be in its first round, stopping after it: a first Ctrl-C then leaves it be (a second
    cancel would make it abandon that round) and stops the others only."""
    from cluster.runtime.interrupts import Interrupted, StopSignals

    trials = _three_trials(tmp_path, store_root)
    ray = _Ray(create_on_cancel=True)
    ray.ends = ["task0", "task1"]
    engine = _engine_on(ray, placed=[0, 1])

    def on_done(result) -> None:
        if result.trial is trials[0]:
            raise OSError(28, "No space left on device")
        stop.reason, stop.signum = "interrupted by SIGINT", signal.SIGINT

    with StopSignals(lambda line: None) as stop, pytest.raises(Interrupted) as raised:
        engine.run(trials, on_done)
    assert ray.cancelled == ["task2"]  # once, by the withholding
    assert str(raised.value).startswith("interrupted by SIGINT: 1 trial(s) stopped, 0 not ")
    assert engine._running == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unsaved", [0, 3])
def test_a_trial_whose_rounds_are_not_all_in_its_checkpoint_ends_abandoned(
    tmp_path, store_root, monkeypatch, unsaved
):
    """A second cancel abandons a trial's round (``Interrupted`` out of its run): where rounds
    it completed are in no checkpoint (checkpoint.every 5, rounds 6-8 run, round 9 abandoned)
    it ends ABANDONED, never continued by a rerun; else KILLED, its checkpoint holding every
    round it ran. Either way its MLflow run is passed on."""
    from cluster.analysis.trials import run_one
    from cluster.runtime import experiment
    from cluster.runtime.interrupts import Interrupted

    trial = _three_trials(tmp_path, store_root)[0]

    def abandoning(config, **options):
        error = Interrupted(signal.SIGINT, "second SIGINT: the round in progress abandoned")
        error.unsaved_rounds, error.run_id = unsaved, "run-of-the-trial"
        raise error

    monkeypatch.setattr(experiment, "run_experiment", abandoning)
    result = run_one(trial, None, None)
    assert result.status == ("ABANDONED" if unsaved else "KILLED") and result.error is None
    assert result.run_id == "run-of-the-trial"  # its ledger entry names it (its checkpoint's)


@pytest.mark.parametrize(
    ("ran", "written", "resumed", "unsaved"),
    [(8, 5, None, 3), (8, 8, None, 0), (8, None, 5, 3), (5, None, 5, 0), (None, None, 5, 0),
     (3, None, None, 3)],
)  # fmt: skip
def test_the_rounds_a_run_completed_beyond_its_checkpoint(ran, written, resumed, unsaved):
    """Its last checkpoint written, else the one it resumed from (unchanged), else none."""
    from cluster.runtime.experiment import unsaved_rounds

    kept = None if written is None else ("checkpoint.pt", written)
    resume = None if resumed is None else {"simulation": {"rounds_done": resumed}}
    assert unsaved_rounds(ran, kept, resume) == unsaved


class _Stubborn(_Ray):
    """A Ray whose tasks end only when cancelled by force (their rounds never end)."""

    def cancel(self, ref, recursive=False, force=False):
        self.log.append(f"cancel {ref}{' force' if force else ''}")
        if force:
            super().cancel(ref, recursive)


@pytest.mark.timeout(60)
def test_a_trial_cancelled_by_force_ends_abandoned(tmp_path, store_root, monkeypatch):
    """After a second stop signal the trials that did not end within ``ABANDON_WAIT_S`` are
    cancelled by force: how many rounds each ran past its checkpoint is unknown, so each ends
    ABANDONED (never continued), not KILLED."""
    from cluster.analysis import trials as engine_module
    from cluster.runtime.interrupts import Interrupted, StopSignals

    monkeypatch.setattr(engine_module, "ABANDON_WAIT_S", 0.0)
    trials = _three_trials(tmp_path, store_root)[:1]
    ray, done = _Stubborn(), []
    engine = _engine_on(ray, placed=[0])

    def two_signals(trial) -> None:
        stop.reason, stop.signum, stop._abort = "interrupted by SIGINT", signal.SIGINT, 2

    with StopSignals(lambda line: None) as stop, pytest.raises(Interrupted):
        engine.run(trials, done.append, two_signals)
    assert [r.status for r in done] == ["ABANDONED"]
    assert ray.log[-1] == "cancel task0 force" and engine._running == {}


@pytest.mark.timeout(60)
def test_a_stop_signal_while_trials_are_submitted_submits_no_more(tmp_path, store_root):
    """With no limit on trials at once all are submitted in one pass: a stop signal during it
    (here as the first trial's start is recorded) submits no more; the one submitted is
    cancelled, the others are not started."""
    from cluster.runtime.interrupts import Interrupted, StopSignals

    trials = _three_trials(tmp_path, store_root)
    ray = _Ray()
    engine = _engine_on(ray, placed=[0])

    def signal_comes(trial) -> None:
        stop.reason, stop.signum = "interrupted by SIGINT", signal.SIGINT

    with StopSignals(lambda line: None) as stop, pytest.raises(Interrupted) as raised:
        engine.run(trials, lambda result: None, signal_comes)
    assert ray.log == [f"launch {trials[0].name}"] and ray.cancelled == ["task0"]
    assert "1 trial(s) stopped, 2 not started" in str(raised.value)


@pytest.mark.timeout(60)
def test_with_no_cap_a_trial_is_submitted_once_the_cluster_can_hold_it(tmp_path, store_root):
    """``concurrent`` 0 on a cluster that holds two of the trials: two are submitted (each
    written SUBMITTED first), the third only once one of them ended, so that a crash never
    leaves a trial that could not have run as an earlier attempt."""
    from cluster.analysis.trials import bundles

    trials = _three_trials(tmp_path, store_root)
    ray = _Ray()
    need = sum(b["CPU"] for b in bundles(trials[0].config))
    ray.cluster_resources = lambda: {"CPU": 2 * need}
    ray.ends = ["task0", "task1", "task2"]
    engine = _engine_on(ray, placed=[0, 1, 2])
    engine.run(trials, lambda result: ray.log.append(f"end {result.trial.name}"))
    first, second, third = (t.name for t in trials)
    assert ray.log == [f"launch {first}", f"launch {second}", f"end {first}",
                       f"launch {third}", f"end {second}", f"end {third}"]  # fmt: skip


@pytest.mark.timeout(60)
def test_a_stop_counts_the_trials_waiting_for_their_groups_as_not_started(tmp_path, store_root):
    """Three trials submitted, one placed: a stop signal stops 1 and leaves 2 not started (they
    end NOT RUN), in its first line and in ``Interrupted``."""
    from cluster.runtime.interrupts import Interrupted, StopSignals

    trials, said = _three_trials(tmp_path, store_root), []
    ray = _Ray()
    engine = _engine_on(ray, placed=[0])

    def signal_comes(trial) -> None:
        if trial is trials[-1]:
            stop.reason, stop.signum = "interrupted by SIGINT", signal.SIGINT

    with StopSignals(said.append) as stop, pytest.raises(Interrupted) as raised:
        engine.run(trials, lambda result: None, signal_comes)
    assert said == [
        "sweep: stopping 1 running trial(s) after their round (each writes its checkpoint); "
        "2 not started"
    ]
    assert str(raised.value).startswith("interrupted by SIGINT: 1 trial(s) stopped, 2 not started")


@pytest.mark.timeout(60)
def test_an_error_out_of_the_engine_ends_the_running_trials_recorded_first(tmp_path, store_root):
    """A launch that raises (Ray's error) once the first trial runs and the second waits for
    its group: both are cancelled and passed to ``on_done`` (the second NOT RUN, its earlier
    ledger entry put back) before the error is raised again; none is left to the disconnect."""
    trials = _three_trials(tmp_path, store_root)
    ray, done = _Ray(), []

    def failing(trial) -> None:
        if trial is trials[2]:
            raise RuntimeError("GCS unreachable")

    engine = _engine_on(ray, placed=[0], on_launch=failing)
    with pytest.raises(RuntimeError, match="GCS unreachable"):
        engine.run(trials, done.append, lambda trial: None)
    assert [(r.trial, r.status) for r in done] == [(trials[0], "KILLED"), (trials[1], "NOT RUN")]
    assert ray.cancelled == ["task0", "task1"] and engine._running == {}


@pytest.mark.timeout(60)
def test_a_group_the_gcs_has_no_state_for_counts_as_placed(tmp_path, store_root):
    """``placement_group_table`` gives {} for a group it does not know (ray's ``state.py``):
    the trial may have run, so it is recorded as one that ran, not lost to a KeyError."""
    trials = _three_trials(tmp_path, store_root)[:1]
    ray, done = _Ray(), []
    ray.ends = ["task0"]
    ray.util.placement_group_table = lambda group: {}
    engine = _engine_on(ray, placed=[])
    engine.run(trials, done.append)
    assert [(r.trial, r.started) for r in done] == [(trials[0], True)]


# ------------------------------------------------------------------------- slow: on Ray


def _params(checkpoint: Path) -> torch.Tensor:
    return load_checkpoint(checkpoint)["simulation"]["params"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sweep_runs_trials_concurrently_selects_resumes(tmp_path, store_root, monkeypatch, capfd):
    """4 configurations × 2 seeds, two trials at once on 2 CPUs through one MLflow server:
    every trial's final parameters are those of the same config run alone; the table lists the
    8; the selected config reruns to the same numbers; a rerun runs nothing; a failing trial is
    recorded and stops no other."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    spec = {"base": _base(store_root, tmp_path), "space": SPACE, "seeds": 2}
    spec_path = _write(tmp_path, "t", spec)
    out = tmp_path / "out"
    assert main(["sweep", str(spec_path), "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert "[8/8] sweep-t-" in printed and "tuning privacy:" in printed
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    trials = [r for r in rows if r["trial"]]
    assert len(trials) == 8 and {r["status"] for r in trials} == {"FINISHED"}
    assert sum(r["selected"] == "True" for r in rows if not r["trial"]) == 1

    client = MlflowClient(uri)
    runs = client.search_runs(
        [client.get_experiment_by_name("sweep").experiment_id], "tags.sweep = 't'"
    )
    assert len(runs) == 8  # nothing lost: every trial's run, finished, with all its rounds
    parent_id = runs[0].data.tags["mlflow.parentRunId"]
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parent_id
        assert len(client.get_metric_history(run.info.run_id, "test_accuracy")) == 3
        logged = client.download_artifacts(run.info.run_id, "trial_privacy.json", str(tmp_path))
        assert json.loads(Path(logged).read_text())["unit"] == "client"
    planned = plan(spec_path, [])
    for run in runs:  # bit for bit the run alone (one in-process host = one Ray actor)
        config = calibrate(planned.configs[run.data.params["tracking.run_name"]], lambda line: None)
        alone = run_local(_local(config))
        assert torch.equal(_params(tmp_path / "ck" / f"{run.info.run_id}.pt"), alone.state.params)
    parent = client.get_run(parent_id)
    assert parent.data.tags["selected_on_test"] == "false"
    logged = {Path(a.path).name for a in client.list_artifacts(parent_id, "sweep")}
    assert {"sweep.md", "sweep.csv", "sweep_params.png", "selected.yaml"} <= logged
    assert {"tuning_privacy.json", "children.json"} <= logged

    chosen = next(r for r in rows if r["selected"] == "True")
    first = next(r for r in trials if r["configuration"] == chosen["configuration"])
    assert main(["run", str(out / "selected.yaml"), "--executor", "local"]) == 0
    rerun = capfd.readouterr().out
    assert f"final test accuracy {float(first['test_accuracy']):.4f}" in rerun

    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    assert main(["sweep", str(spec_path), "--out", str(out)]) == 0  # resumed: nothing to run
    resumed = capfd.readouterr()
    assert "8 finished before (resumed), 0 to run" in resumed.out
    assert "Downloading artifacts" not in resumed.out + resumed.err  # no progress bar per trial
    assert len(client.search_runs([runs[0].info.experiment_id], "tags.sweep = 't'")) == 8


def _local(config):
    from dataclasses import replace

    return replace(config, executor=replace(config.executor, kind="local"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_failing_trial_is_recorded_and_stops_no_other(tmp_path, store_root, monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    # 10,000 test rows per client: more than the store holds, found only by the trial's run
    space = {"data.test_per_client": [None, 10_000]}
    spec_path = _write(tmp_path, "f", {"base": _base(store_root, tmp_path), "space": space})
    out = tmp_path / "out"
    assert main(["sweep", str(spec_path), "--out", str(out)]) == 1
    with open(out / "sweep.csv") as f:
        trials = {r["configuration"]: r for r in csv.DictReader(f) if r["trial"]}
    assert trials["test_per_client=None"]["status"] == "FINISHED"
    assert trials["test_per_client=10000"]["status"] == "FAILED"
    assert "test_per_client" in trials["test_per_client=10000"]["error"]
    assert "FAILED" in (out / "sweep.md").read_text()


def test_the_cpu_dpfedsam_grid_plans_its_18_trials():
    planned = plan(Path("configs/cpu/sweep_dpfedsam.yaml"), [])
    assert len(planned.records) == 18 and planned.spec.select.metric == "validation_accuracy"
    config = planned.configs[planned.records[0].name]
    assert config.data.validation.fraction == 0.1 and config.algorithm.name == "dp_fedsam"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_compare_concurrent_gives_the_same_table(tmp_path, store_root, monkeypatch):
    """``compare --concurrent 2`` runs its runs on the sweep's engine: the same table."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    base = _base(store_root, tmp_path) | {"executor": {"kind": "local", "num_actors": 1}}
    runs = {"a": {"algorithm.local.lr": 0.05}, "b": {"algorithm.local.lr": 0.2}}
    spec = _write(tmp_path, "cmp", {"base": base, "runs": runs})
    tables = []
    for concurrent in ("0", "2"):
        out = tmp_path / f"out{concurrent}"
        args = ["--seeds", "2", "--out", str(out), "--baseline", "a", "--concurrent", concurrent]
        assert main(["compare", str(spec), *args]) == 0
        tables.append((out / "compare.csv").read_text())
    assert tables[0] == tables[1]


def _child_runs(client, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    parents = client.search_runs([found.experiment_id], "tags.sweep_parent = 'stop'")
    if not parents:
        return []
    query = f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'"
    return client.search_runs([found.experiment_id], query)


STOPPED_ROUNDS = 500  # a trial's rounds: both mid-run at the SIGINT (with 150, one had ended)


def stop_sweep(command: list[str], env: dict, ready, every_s: float) -> str:
    """Start the sweep ``command``; once ``ready()`` (asked every ``every_s``, 900 s at most),
    SIGINT it. Its output; it stopped its 2 running trials and exited 130."""
    sweep = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and sweep.poll() is None:
        time.sleep(every_s)
        if ready():
            break
    sweep.send_signal(signal.SIGINT)
    printed = sweep.communicate(timeout=600)[0].decode()
    assert sweep.returncode == 130, printed
    assert "stopping 2 running trial(s)" in printed, printed
    return printed


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_ctrl_c_stops_every_running_trial_cleanly_and_a_rerun_resumes_them(tmp_path, store_root):
    """SIGINT to the sweep: both running trials stop after their round, each writes its
    checkpoint and ends its run KILLED; the sweep exits 130. Rerun, the sweep continues both runs
    from their checkpoints: no other run, every round logged once and charged in the run's
    accountant, each trial's final parameters those of its config run uninterrupted, and (its
    validation on held-out clients) the sweep states an ε."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = _base(store_root, tmp_path) | {"rounds": STOPPED_ROUNDS, "eval_every": 1}
    base["data"]["validation"] = {"clients": 0.2}  # public validation: the sweep has an ε
    spec = _write(tmp_path, "stop", {"base": base, "space": {"algorithm.local.lr": [0.05, 0.2]}})
    env = os.environ | {"MLFLOW_TRACKING_URI": uri}
    out = tmp_path / "o"
    command = [sys.executable, "-m", "cluster", "sweep", str(spec), "--out", str(out)]
    client = MlflowClient(uri)

    def both_evaluated() -> bool:
        runs = _child_runs(client, "sweep")
        return len(runs) == 2 and all("test_accuracy" in r.data.metrics for r in runs)

    # few reads: the store's one writer is the sweep's server
    printed = stop_sweep(command, env, both_evaluated, every_s=10)
    runs = _child_runs(client, "sweep")
    assert [r.info.status for r in runs] == ["KILLED", "KILLED"], printed
    done = {
        r.info.run_id: load_checkpoint(tmp_path / "ck" / f"{r.info.run_id}.pt")["simulation"][
            "rounds_done"
        ]
        for r in runs
    }
    assert all(0 < rounds < STOPPED_ROUNDS for rounds in done.values()), done
    killed_seconds = {r.info.run_id: float(r.data.tags["sweep_seconds"]) for r in runs}

    rerun = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    printed = rerun.stdout.decode()
    assert rerun.returncode == 0, printed
    for run_id, rounds in done.items():
        assert f"resuming its KILLED run {run_id} after round {rounds} from " in printed, printed
        assert f" ({killed_seconds[run_id]:.0f} s before)" in printed, printed
    with open(out / "sweep.csv") as f:  # a trial's seconds: its killed part and the rest
        seconds = {r["run_id"]: float(r["seconds"]) for r in csv.DictReader(f) if r["trial"]}
    assert all(seconds[run_id] > killed_seconds[run_id] for run_id in done), seconds
    assert "tuning privacy: ε = " in printed, printed
    assert json.loads((out / "tuning_privacy.json").read_text())["epsilon"] > 0
    runs = _child_runs(client, "sweep")
    assert {r.info.run_id: r.info.status for r in runs} == dict.fromkeys(done, "FINISHED")
    planned = plan(spec, [])
    for run in runs:
        run_id = run.info.run_id
        assert float(run.data.tags["sweep_seconds"]) == pytest.approx(seconds[run_id], abs=0.01)
        steps = [m.step for m in client.get_metric_history(run_id, "test_accuracy")]
        assert sorted(steps) == list(range(1, STOPPED_ROUNDS + 1))
        logged = client.download_artifacts(run_id, "trial_privacy.json", str(tmp_path))
        (charged,) = json.loads(Path(logged).read_text())["mechanism"]["runs"]
        assert charged[2] == STOPPED_ROUNDS
        config = calibrate(planned.configs[run.data.params["tracking.run_name"]], lambda line: None)
        alone = run_local(_local(config))  # uninterrupted
        assert torch.equal(_params(tmp_path / "ck" / f"{run_id}.pt"), alone.state.params)


def test_cross_validation_averages_the_folds_and_retrains_on_all_rows():
    """DP-SCAFFOLD's η₀ by 5-fold CV: a configuration is η₀ alone (its score the mean over the
    folds), and the selected one is retrained with data.validation: null."""
    from cluster.analysis.sweep import selected_yaml

    planned = plan(Path("configs/cpu/sweep_dpscaffold_cv.yaml"), [])
    assert len(planned.records) == 15 and planned.spec.cross_validated
    for record in planned.records:  # η₀ = 1.0 best on average, η₀ = 3.0 on one fold
        eta, fold = (dict(record.trial.values)[k] for k in ("algorithm.local.lr", FOLD))
        record.status, record.metric = "FINISHED", {0.3: 0.5, 1.0: 0.7, 3.0: 0.6}[eta]
        record.metric += 0.25 * (eta == 3.0 and fold == 0)
    rows = summarize(planned.spec, planned.records)
    assert [r["configuration"] for r in rows] == ["lr=0.3", "lr=1", "lr=3"]
    assert [r["selected"] for r in rows] == [False, True, False]
    assert rows[2]["trials"] == 5 and rows[2]["validation_accuracy_mean"] == pytest.approx(0.65)
    chosen = yaml.safe_load(selected_yaml(planned, (("algorithm.local.lr", 1.0),)))
    assert chosen["data"]["validation"] is None and chosen["algorithm"]["local"]["lr"] == 1.0


def test_a_retrainings_config_error_names_the_retraining(tmp_path, store_root, monkeypatch, capsys):
    """After cross-validation each configuration is retrained on all training rows (checked
    before any trial runs): a config error there names that retraining, not a fold trial."""
    import cluster.analysis.sweep_plan as sweep_plan
    from cluster.config import ConfigError

    build_config = sweep_plan.build_config

    def refusing_the_retraining(base, overrides, changes, extra):
        if "data.validation" in changes:  # only the retraining changes it (to null)
            raise ConfigError("data.validation", None, "needs validation data")
        return build_config(base, overrides, changes, extra)

    monkeypatch.setattr(sweep_plan, "build_config", refusing_the_retraining)
    base = _base(store_root, tmp_path)
    base["data"]["validation"] = {"folds": 2, "fold": 0}
    space = {"algorithm.local.lr": [0.1], "data.validation.fold": [0, 1]}
    spec = _write(tmp_path, "cvr", {"base": base, "space": space})
    assert main(["sweep", str(spec)]) == 2
    assert capsys.readouterr().err == (
        "sweep: config error: data.validation = None: needs validation data (the retraining "
        "of lr=0.1 on all training rows, seed 0)\n"
    )


def test_papernot_steinke_needs_every_mechanism_the_space_can_draw(tmp_path, store_root):
    """The review's space: rounds ∈ {50, 500} × a loguniform lr, K ~ Poisson. A draw of only
    50-round configurations ran one mechanism, but ε(λ) must bound the 500-round ones too (by
    the review's computation 4.795 stated against 13.0 with them): refused unless every
    combination of the fields that may change the mechanism finished; the lr never matters."""
    from cluster.analysis.sweep_spec import mechanism_may_vary

    lr = {"distribution": "loguniform", "low": 0.01, "high": 1.0}
    search = {"method": "random", "seed": 1, "num_trials": {"distribution": "poisson", "mean": 6}}
    base = _base(store_root, tmp_path)

    def spec(space):
        return load(_write(tmp_path, "ps", {"base": base, "space": space, "search": search}))

    neutral = spec({"algorithm.local.lr": lr, "algorithm.clip_norm": [0.5, 1.0]})
    assert mechanism_may_vary(neutral, []) is None
    rounds = spec({"rounds": [50, 500], "algorithm.local.lr": lr})
    at = [SweepTrial((("rounds", r), ("algorithm.local.lr", 0.1)), 0) for r in (50, 50)]
    why = mechanism_may_vary(rounds, at)
    assert why == "rounds may change the privacy mechanism, and no finished trial ran rounds=500"
    both = [*at, SweepTrial((("rounds", 500), ("algorithm.local.lr", 0.3)), 0)]
    assert mechanism_may_vary(rounds, both) is None  # then privacy.tuning compares the curves
    drawn = spec({"cohort.size": {"distribution": "uniform", "low": 2, "high": 8}})
    assert "cohort.size may change the privacy mechanism and is drawn from a continuous" in (
        mechanism_may_vary(drawn, [])
    )


def test_a_loss_is_minimised_unless_told_otherwise(tmp_path, store_root, capsys):
    base = _base(store_root, tmp_path)
    space = {"algorithm.local.lr": [0.1]}

    def selection(select):
        return load(_write(tmp_path, "sel", {"base": base, "space": space, "select": select}))

    assert selection({"metric": "validation_loss"}).select.mode == "min"
    assert selection({"metric": "validation_accuracy"}).select.mode == "max"
    with pytest.raises(ConfigError, match="select.mode = 'max': selects the worst validation_loss"):
        selection({"metric": "validation_loss", "mode": "max"})


def test_the_parameter_plot_takes_a_field_with_a_null_value(tmp_path, store_root):
    from cluster.analysis.sweep_report import plot_parameters

    space = {"privacy.noise_cohort_size": [10, None]}
    spec = load(_write(tmp_path, "plot", {"base": _base(store_root, tmp_path), "space": space}))
    records = [
        TrialRecord(t, f"t{i}", "d", status="FINISHED", metric=0.5 + i / 10)
        for i, t in enumerate(spec.trials())
    ]
    plot_parameters(spec, records, tmp_path / "p.png")  # '<' between None and int before
    assert (tmp_path / "p.png").stat().st_size > 0


def test_finished_trials_are_found_beyond_one_page_of_runs(
    tmp_path, store_root, sqlite_store, monkeypatch
):
    """A sweep may hold more trials than one page of MLflow's search (1,000 by default): every
    page is read (one run a page here), and a trial's newest finished run is its result."""
    from cluster.analysis import sweep_runs

    planned, client, experiment = _tracked_plan(
        tmp_path, store_root, sqlite_store, "pg", {"algorithm.local.lr": [0.05, 0.1, 0.2]}
    )
    privacy = tmp_path / "trial_privacy.json"
    for start, record in enumerate([*planned.records, planned.records[0]]):  # newest wins
        tags = {"sweep": "pg", sweep_runs.RECORDED: "true", "sweep_trial": record.digest,
                sweep_runs.SECONDS: "1.5"}  # fmt: skip
        run_id = client.create_run(experiment, 1000 + start, tags).info.run_id
        privacy.write_text(json.dumps({"label": run_id}))
        client.log_artifact(run_id, str(privacy))
        client.set_terminated(run_id, "FINISHED")
    monkeypatch.setattr(sweep_runs, "SEARCH_PAGE", 1)
    records = [TrialRecord(r.trial, r.name, r.digest) for r in planned.records]
    sweep_runs.find_finished(planned, records)
    assert [r.status for r in records] == ["FINISHED"] * 3
    assert records[0].privacy == {"label": run_id}


def test_untracked_trials_keep_their_own_checkpoints_under_dpfl_checkpoint_dir(
    tmp_path, store_root, monkeypatch
):
    """``$DPFL_CHECKPOINT_DIR`` (the k8s manifests set it) replaces each trial's own folder:
    its checkpoint is still its own, named by the trial (all four shared one file before)."""
    from cluster.runtime.checkpoint import checkpoint_path

    base = _base(store_root, tmp_path) | {"tracking": {"enabled": False}}
    space = {"algorithm.local.lr": [0.05, 0.5]}
    planned = plan(_write(tmp_path, "k", {"base": base, "space": space, "seeds": 2}), [])
    monkeypatch.setenv("DPFL_CHECKPOINT_DIR", str(tmp_path / "shared"))
    paths = [checkpoint_path(c, None) for c in planned.configs.values()]
    assert len(set(paths)) == 4 and {p.parent for p in paths} == {tmp_path / "shared"}
    assert {p.name for p in paths} == {
        f"dpfl-dp_fedavg-seed{r.trial.seed}-{r.name}.pt" for r in planned.records
    }


def test_a_long_label_is_left_out_of_the_trials_names(tmp_path, store_root):
    """Four random fields made names over the 100 bytes a run name may have, refused with a fix
    naming tracking.run_name, which the user never set: the label goes, the key stays."""
    uniform = {"distribution": "loguniform", "low": 0.001, "high": 1.0}
    fields = ("local.lr", "clip_norm", "server_lr", "local.momentum")
    space = {f"algorithm.{f}": uniform for f in fields}
    search = {"method": "random", "seed": 0, "num_samples": 2}
    spec = {"base": _base(store_root, tmp_path), "space": space, "search": search}
    planned = plan(_write(tmp_path, "sweep_client_level_mnist_tuning", spec), [])
    names = [r.name for r in planned.records]
    assert all(len(n.encode()) <= 100 for n in names) and len(set(names)) == 2
    assert names[0] == f"sweep-sweep_client_level_mnist_tuning-{planned.records[0].trial.key}-seed0"


def test_a_trial_whose_bundle_fits_no_single_node_is_refused(tmp_path, store_root):
    """Two nodes of one CPU hold two CPUs in all, but not a local-executor trial's one bundle of
    two (the review's sweep waited for good): refused before any trial, naming the largest."""
    from dataclasses import replace

    from cluster.analysis.trials import Trial, check_fits

    config = _one_trial_config(store_root, tmp_path)
    local = replace(config, executor=replace(config.executor, kind="local", num_actors=2,
                                             cpus_per_actor=1.0))  # fmt: skip
    nodes = [{"CPU": 1.0}, {"CPU": 1.0}]
    with pytest.raises(ConfigError, match=r"needs 2 CPU, 0 GPU on one node.*largest: 1 CPU"):
        check_fits([Trial("t", local)], {"CPU": 2.0}, nodes)
    check_fits([Trial("t", local)], {"CPU": 3.0}, [*nodes, {"CPU": 2.0}])  # fits on the third


def _one_trial_config(store_root, tmp_path):
    space = {"algorithm.local.lr": [0.1]}
    planned = plan(_write(tmp_path, "b", {"base": _base(store_root, tmp_path), "space": space}), [])
    return planned.configs[planned.records[0].name]


def test_a_trial_the_preflight_refuses_is_refused_before_any_trial_starts(
    tmp_path, store_root, capsys
):
    """The review's checkpoint.dir under a plain file: both trials started and FAILED (exit 1),
    then counted as trained on the private data; now exit 2 before any work, as `run` does."""
    (tmp_path / "afile").write_text("")
    base = _base(store_root, tmp_path) | {"tracking": {"enabled": False}}
    base["executor"] = {"kind": "local"}  # the examples' executor: trials on this machine too
    base["checkpoint"] = {"dir": str(tmp_path / "afile" / "ck")}
    path = _write(tmp_path, "pf", {"base": base, "space": {"algorithm.local.lr": [0.1, 0.2]}})
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "checkpoint.dir" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_parent_says_which_epsilon_covers_the_logged_trials(tmp_path, store_root):
    """Papernot–Steinke bounds the selected model only; the sweep logs every trial's model and
    metrics, which the composition covers: both are tags, and a statement without ε writes
    ``none`` over a resumed parent's earlier values."""
    from cluster.analysis.sweep import _parent_tags
    from privacy.tuning import TuningStatement

    spec = load(_write(tmp_path, "t", {"base": _base(store_root, tmp_path),
                                       "space": {"algorithm.local.lr": [0.1]}}))  # fmt: skip
    both = TuningStatement(4.8, 1e-5, "Papernot–Steinke, poisson", "a", None, 5.8)
    tags = _parent_tags(spec, None, "", both)
    assert (tags["tuning_epsilon"], tags["tuning_epsilon_all_trials"]) == ("4.8", "5.8")
    composed = TuningStatement(5.8, 1e-5, "composition", "a", None)
    assert _parent_tags(spec, None, "", composed)["tuning_epsilon_all_trials"] == "5.8"
    none = _parent_tags(spec, None, "", TuningStatement(None, None, "none", "a", "why"))
    assert (none["tuning_epsilon"], none["tuning_epsilon_all_trials"]) == ("none", "none")
