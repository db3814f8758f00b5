"""`python -m cluster compare`: presets at the same ε over seeds, one table, MLflow parent run."""

import csv
import json

import pytest
import yaml
from mlflow.tracking import MlflowClient

from cluster.cli.main import main


def test_compare_runs_presets_at_the_same_epsilon(tmp_path, store_root, monkeypatch, capfd):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # a fresh store: created quietly (below)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_LOGGING_LEVEL", raising=False)  # the tracking processes' default
    base = {
        "rounds": 3,
        "eval_every": 1,
        "data": {
            "num_clients": 20,
            "store_root": str(store_root),
            "synthetic": {"samples_per_user": 100},
        },
        "cohort": {"size": 5, "sampling": "fixed"},
        "algorithm": {
            "name": "dp_fedavg",
            "clip_norm": 0.5,
            "local": {"local_steps": 3, "batch_size": 16},
        },
        "privacy": {
            "target_epsilon": 5.0,
            "calibrate": "sigma",
            "accountant": "rdp",
        },
        "executor": {"kind": "local"},
        "tracking": {"experiment": "cmp"},
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    spec = tmp_path / "spec.yaml"
    runs = {
        "dp_fedavg": {"algorithm.name": "dp_fedavg"},
        "dp_fedsam": {"algorithm.name": "dp_fedsam", "algorithm.rho": 0.05},
        "fedavg": {"algorithm.name": "fedavg"},  # the no-noise reference: privacy dropped
    }
    spec.write_text(yaml.safe_dump({"base": base, "runs": runs}))
    out = tmp_path / "out"
    args = [
        "--seeds",
        "2",
        "--out",
        str(out),
        "--target-accuracy",
        "0.01",
        "--target-accuracy",
        "1",
    ]
    assert main(["compare", str(spec), *args]) == 0
    printed, errors = capfd.readouterr()  # the runs' tracking processes' output too
    assert "| dp_fedsam |" in printed and "± " in printed
    assert "INFO mlflow" not in printed + errors  # a fresh store, quietly
    with open(out / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["dp_fedavg", "dp_fedsam", "fedavg"]
    assert all(r["seeds"] == "2" for r in rows)
    eps = [float(r["epsilon"]) for r in rows[:2]]
    assert eps[0] == eps[1] and 4.9 <= eps[0] <= 5.0  # same calibrated budget
    assert rows[2]["epsilon"] == "" and rows[2]["sigma"] == ""
    # Paired by seed against dp_fedavg: itself exactly 0, the others their mean difference.
    assert float(rows[0]["diff_vs_baseline_mean"]) == 0.0
    assert float(rows[0]["diff_vs_baseline_std"]) == 0.0
    for r in rows[1:]:
        diff = float(r["final_acc_mean"]) - float(rows[0]["final_acc_mean"])
        assert abs(float(r["diff_vs_baseline_mean"]) - diff) < 1e-12
    for r in rows:  # 3 rounds: the last 10% is round 3, the final evaluation
        assert float(r["last10pct_acc_mean"]) == float(r["final_acc_mean"])
        assert 0 < float(r["train_acc_mean"]) <= 1  # the clients' local accuracy, last round
        gap = float(r["train_acc_mean"]) - float(r["final_acc_mean"])
        assert float(r["train_test_gap_mean"]) == pytest.approx(gap)
        # 1% test accuracy is reached at the first evaluation (round 1), 100% never.
        assert r["rounds_to_1pct_mean"] == "1" and r["rounds_to_1pct_reached"] == "2"
        assert r["rounds_to_1pct_speedup"] == "1.0" and r["rounds_to_100pct_speedup"] == ""
        assert r["rounds_to_100pct_mean"] == "" and r["rounds_to_100pct_reached"] == "0"
    assert "rounds to 1% (reached) | rounds to 100% (reached) |" in printed
    assert "| 1 ± 0 (2/2), 1.00× the baseline's speed | — (0/2) |" in printed
    assert "Δ final acc vs dp_fedavg, paired over seeds" in printed
    assert "| 0 (baseline) |" in printed and "95% CI [" in printed
    assert "| fedavg |" in printed and "| ∞ | — |" in printed
    assert (out / "compare_accuracy.png").stat().st_size > 0
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("cmp")
    found = client.search_runs([experiment.experiment_id])
    assert len(found) == 7  # 3 presets × 2 seeds + the parent
    parent = [r for r in found if r.data.tags.get("compare") == "spec"]
    assert len(parent) == 1
    parent_id = parent[0].info.run_id
    names = {a.path for a in client.list_artifacts(parent_id, "compare")}
    expected = ("compare.md", "compare.csv", "compare_accuracy.png", "children.json")
    expected += ("compare_communication.png",)  # the runs logged their bytes
    assert names == {f"compare/{name}" for name in expected}
    children = {r.info.run_id for r in found if r.data.tags.get("mlflow.parentRunId") == parent_id}
    listed = json.loads((out / "children.json").read_text())
    assert set(listed.values()) == children and len(children) == 6
    for run in found:  # cluster.runtime.run_names: the child's own name, then what ran
        if run.info.run_id in children:
            p = run.data.params
            parts = (p["tracking.run_name"], p["algorithm.name"], p["task"], f"s{p['seed']}")
            assert run.info.run_name == " · ".join((*parts, run.info.run_id[:6]))
            assert p["tracking.run_name"] == f"spec-{p['algorithm.name']}-seed{p['seed']}"
    assert parent[0].info.status == "FINISHED"


def test_a_bad_run_is_rejected_before_any_work(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"base": {}, "runs": {"x": {"algorithm.name": "dp_fedsgd"}}}))
    assert main(["compare", str(spec)]) == 2
    assert "algorithm.name" in capsys.readouterr().err


def test_paper_and_cpu_configs_validate():
    from pathlib import Path

    from cluster.analysis.compare import load_spec
    from cluster.claims.calibration import calibrated
    from cluster.config import load_config

    for path in sorted(Path("configs/papers").glob("*.yaml")):
        calibrated(load_config(path)).build_algorithm()
    base, runs = load_spec(Path("configs/cpu/client_level.yaml"), [])
    assert len(runs) == 16 and base["privacy"]["calibrate"] == "sigma"
    # A paper's literal top-k runs at its accounted twin's calibrated σ, with no budget.
    from cluster.analysis.run_configs import run_setup

    literal_base, overrides = run_setup(base, [], runs["fed_smp_topk_kept"])
    assert literal_base["privacy"]["calibrate"] == "none"
    assert "target_epsilon" not in literal_base["privacy"]
    twin = calibrated(load_config(None, [f"{k}={v}" for k, v in _flat(base).items()]))
    assert overrides == [f"algorithm.noise_multiplier={twin.algorithm.noise_multiplier!r}"]


def test_only_selects_runs_and_names_unknown_ones(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"base": {}, "runs": {"a": {}, "b": {}}}))
    assert main(["compare", str(spec), "--only", "c"]) == 2
    assert "no such run; known: a, b" in capsys.readouterr().err
    assert main(["compare", str(spec), "--baseline", "c"]) == 2
    assert "--baseline = 'c': not among the runs: a, b" in capsys.readouterr().err


def test_non_private_runs_start_from_the_base_without_privacy():
    from cluster.analysis.run_configs import run_setup

    base = {
        "algorithm": {"name": "dp_fedavg", "clip_norm": 1.0, "noise_placement": "client"},
        "privacy": {"target_epsilon": 2.0},
        "rounds": 4,
    }
    overrides = ["privacy.target_epsilon=3", "algorithm.clip_norm=0.5", "rounds=2"]
    assert run_setup(base, overrides, {"algorithm.name": "dp_fedsam"}) == (base, overrides)
    reference, kept = run_setup(base, overrides, {"algorithm.name": "fedsam"})
    assert reference == {"algorithm": {"name": "dp_fedavg"}, "rounds": 4}
    assert kept == ["rounds=2"]  # --set privacy settings do not reach the reference run
    assert run_setup(base, ["algorithm.name=fedavg"], {})[0]["algorithm"] == {"name": "dp_fedavg"}
    assert "privacy" not in run_setup(base, [], {"algorithm": {"name": "fedavg"}})[0]


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def test_sketch_spec_runs_the_papers_noise_at_the_budgets_epsilon():
    from pathlib import Path

    from cluster.analysis.compare import load_spec
    from cluster.analysis.run_configs import run_setup

    base, runs = load_spec(Path("configs/cpu/sketch.yaml"), [])
    assert len(runs) == 9 and runs["dpsfl"]["algorithm.sketch_cols"] == 44000  # x- anchor
    paper_base, overrides = run_setup(base, [], runs["dpsfl_paper"])
    assert paper_base["privacy"]["calibrate"] == "none"
    assert "target_epsilon" not in paper_base["privacy"]
    assert overrides == ["algorithm.paper_epsilon=4.0"]


def _outcome(rounds, evaluated, accuracy=lambda t: t / 100):
    """An Outcome whose history evaluates the given rounds at ``accuracy(round)``."""
    from types import SimpleNamespace

    from cluster.runtime.experiment import Outcome
    from cluster.runtime.records import RoundRecord
    from cluster.runtime.simulation import SimulationResult

    history = [
        RoundRecord(
            t,
            0.0,
            5,
            test_accuracy=accuracy(t) if t in evaluated else None,
            metrics={"train_accuracy": 0.9},
        )
        for t in range(1, rounds + 1)
    ]
    result = SimulationResult(None, history, "done")
    claim = SimpleNamespace(dp_valid=False, private=False, noise_multiplier=None)
    return Outcome(result, SimpleNamespace(rounds=rounds), None, None, None, claim)


def test_last_tenth_accuracy_averages_the_evaluations_of_the_last_10_percent_of_rounds():
    """DP-SCAFFOLD's tables: per run, the mean test accuracy over the last 10% of the rounds."""
    outcome = _outcome
    assert len(outcome(20, range(1, 21)).last_tenth_evaluations) == 2
    assert outcome(20, range(1, 21)).last_tenth_accuracy == pytest.approx(0.195)  # 19, 20
    assert outcome(20, (10, 20)).last_tenth_accuracy == pytest.approx(0.20)  # 20 only
    assert outcome(25, range(5, 26, 5)).last_tenth_accuracy == pytest.approx(0.25)  # 23–25
    assert outcome(30, (10,)).last_tenth_accuracy == pytest.approx(0.10)  # the last one alone
    assert outcome(30, ()).last_tenth_accuracy is None


def test_a_target_accuracy_outside_0_1_is_refused(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"base": {}, "runs": {"dp_fedavg": {}}}))
    assert main(["compare", str(spec), "--target-accuracy", "30"]) == 2
    assert "--target-accuracy = 30.0: must be in (0, 1]" in capsys.readouterr().err


def test_a_realised_denominator_runs_at_its_accounted_twins_sigma_with_no_budget(store_root):
    """A comparison at one ε: the realised-denominator run has no ε of its own, so it runs at
    the σ its nominal twin is calibrated to (as the papers' literal top-k variants do)."""
    from cluster.analysis.run_configs import run_setup
    from cluster.claims.calibration import calibrated
    from cluster.config import ConfigError, load_config

    base = {
        "data": {"num_clients": 20, "store_root": str(store_root)},
        "algorithm": {"name": "dp_fedavg_blurs", "clip_norm": 0.5},
        "privacy": {"target_epsilon": 4.0, "calibrate": "sigma"},
        "rounds": 3,
    }
    literal_base, overrides = run_setup(base, [], {"algorithm.mean_denominator": "realised"})
    assert literal_base["privacy"]["calibrate"] == "none"
    twin = calibrated(load_config(None, [f"{k}={v}" for k, v in _flat(base).items()]))
    assert overrides == [f"algorithm.noise_multiplier={twin.algorithm.noise_multiplier!r}"]
    with pytest.raises(ConfigError, match="mean_denominator: nominal"):
        load_config(
            None,
            [f"{k}={v}" for k, v in _flat(base).items()] + ["algorithm.mean_denominator=realised"],
        )


@pytest.mark.parametrize("name", ["dp_fedpgn", "dp_scaffold"])
def test_a_median_clip_runs_at_the_sigma_of_the_bases_fixed_clip(store_root, name):
    """The authors' median clips (client level: DP-FedPGN's; sample level: DP-SCAFFOLD's) have
    no ε; in a comparison at one ε they run at the σ the base's fixed clip is calibrated to."""
    from cluster.analysis.run_configs import run_setup
    from cluster.claims.calibration import calibrated
    from cluster.config import load_config

    base = {
        "data": {"num_clients": 20, "store_root": str(store_root)},
        "algorithm": {"name": name, "clip_norm": 0.5, "local": {"local_steps": 2}},
        "cohort": {"sampling": "fixed", "size": 5},
        "privacy": {"target_epsilon": 4.0, "calibrate": "sigma"},
        "rounds": 3,
    }
    median = {"algorithm.clip_rule": "median", "algorithm.clip_norm": None}
    literal_base, overrides = run_setup(base, [], median)
    assert literal_base["privacy"]["calibrate"] == "none"
    twin = calibrated(load_config(None, [f"{k}={v}" for k, v in _flat(base).items()]))
    sigma = twin.algorithm.noise_multiplier
    assert overrides == [f"algorithm.noise_multiplier={sigma!r}"]
    run = load_config(
        None,
        [f"{k}={v}" for k, v in _flat(literal_base).items()]
        + ["algorithm.clip_rule=median", "algorithm.clip_norm=null", *overrides],
    )
    assert run.unaccounted_reason is not None and run.algorithm.noise_multiplier == sigma


def test_a_spec_is_refused_whole_before_any_run(tmp_path, capsys):
    """A label that cannot name a run, or a key given twice, is refused before the first run."""
    from cluster.cli.main import main

    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {task: synthetic_logreg}\nruns:\n  a/b: {algorithm.name: fedavg}\n")
    assert main(["compare", str(spec)]) == 2
    assert "tracking.run_name = 'spec-a/b-seed0'" in capsys.readouterr().err
    spec.write_text("base: {}\nruns: {a: {}}\nruns: {b: {}}\n")
    assert main(["compare", str(spec)]) == 2
    assert "duplicate key 'runs'" in capsys.readouterr().err


def test_paired_interval_matches_a_hand_computed_t_interval():
    """d = (1, 3, 2, 4, 0) points: mean 2, s = √2.5 = 1.5811, t(0.975, 4) = 2.776445 (tables),
    half-width 2.776445 · 1.5811 / √5 = 1.9632."""
    from cluster.analysis.compare import paired_t_interval

    low, high = paired_t_interval([0.01, 0.03, 0.02, 0.04, 0.00])
    assert low == pytest.approx(0.02 - 0.019632, abs=1e-6)
    assert high == pytest.approx(0.02 + 0.019632, abs=1e-6)
    assert paired_t_interval([0.5]) is None


def test_compare_table_gives_each_runs_paired_interval_and_warns_on_few_last_tenth_evaluations():
    from cluster.analysis.compare import last_tenth_warnings, markdown, summarize

    def runs(offset):  # 5 seeds, final accuracy 0.5 + seed/100 + offset(seed)
        return [_outcome(20, (10, 20), lambda t, k=k: 0.5 + k / 100 + offset(k)) for k in range(5)]

    results = {
        "base": runs(lambda k: 0.0),
        "better": runs(lambda k: (1, 3, 2, 4, 0)[k] / 100),  # the hand-computed differences
        "same": runs(lambda k: (1, -1, 1, -1, 0)[k] / 100),
    }
    rows = summarize(results, "base")
    better = rows[1]
    assert better["diff_vs_baseline_mean"] == pytest.approx(0.02)
    assert better["diff_vs_baseline_ci95_low"] == pytest.approx(0.000368, abs=1e-6)
    assert better["last10pct_evals"] == 1  # round 20 only: 19 and 18 were not evaluated
    table = markdown(rows, "base")
    assert "| 0 (baseline) |" in table
    assert "+2.00 ± 1.58, 95% CI [+0.04, +3.96] (excludes 0) |" in table
    assert "(includes 0) |" in table.splitlines()[-1]
    warnings = last_tenth_warnings(rows)
    assert len(warnings) == 3 and "averages only 1 evaluation(s)" in warnings[0]
    assert "eval_every to at most rounds/30" in warnings[0]
    dense = {"r": [_outcome(30, range(1, 31)) for _ in range(2)]}
    assert last_tenth_warnings(summarize(dense)) == []  # rounds 28, 29, 30


def test_compare_concurrent_exits_1_where_handling_a_runs_end_failed(
    tmp_path, store_root, monkeypatch, capsys
):
    """``compare --concurrent``'s engine raises ``RecordingFailed`` where handling a run's end
    raised (the others ran to their end): the command exits 1 saying so, no traceback."""
    import cluster.analysis.trials as trials
    from benchmarks.sweep import tiny_base

    def failing(runs, concurrent, parent_run_id, on_done, on_submit=None):
        raise trials.RecordingFailed([f"{runs[0].name}: recording its end failed (E)"], 1, 0)

    monkeypatch.setattr(trials, "run_concurrently", failing)
    base = tiny_base(store_root, tmp_path / "ck") | {"tracking": {"enabled": False}}
    spec = tmp_path / "rf.yaml"
    spec.write_text(yaml.safe_dump({"base": base, "runs": {"a": {}}}))
    assert main(["compare", str(spec), "--concurrent", "2", "--out", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == (
        "compare: rf-a-seed0: recording its end failed (E); no trial started after that (1 not "
        "started), the others running then ran to their end\n"
    )
