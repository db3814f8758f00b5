"""``python -m cluster compare SPEC --seeds 3``: several presets, same ε, several seeds, one table.

A comparison spec is YAML with two keys::

    base: {…an experiment config…}          # or base: configs/some.yaml (relative to the spec)
    runs:                                    # label → overrides of the base (dotted keys)
      dp_fedavg: {algorithm.name: dp_fedavg}
      dp_fedsam: {algorithm.name: dp_fedsam, algorithm.rho: 0.5}

Keys starting with ``x-`` are ignored: they hold YAML anchors that runs share (``<<: *name``).

With ``privacy.calibrate: sigma`` and a ``privacy.target_epsilon`` in the base, every private
run is calibrated to the same ε (all presets here release one subsampled Gaussian per round,
so they get the same σ). A run of a non-private preset (``fedavg``, ``fedsam``: the no-noise
references) takes the base and ``--set`` without privacy settings and DP fields: ε = ∞. A run
of a paper's unaccounted variant (``noise_support: kept``, ``mask_source: noisy``) runs at the
σ its accounted twin is calibrated to, with no budget, and its ε reads "n/a (dp_valid=false)".
Each run × seed is a normal tracked run named
``<spec>-<label>-seed<k>``. The summary — final and best test accuracy, and the mean over the
last 10% of rounds' evaluations (DP-SCAFFOLD's metric), mean ± std over seeds,
ε, and the seed-by-seed difference of final accuracy to ``--baseline`` (default ``dp_fedavg``)
with its 95% t-interval over seeds — is printed as
markdown and written as ``compare.md``, ``compare.csv`` and
``compare_accuracy.png`` (mean test accuracy per round) to ``--out`` and to a parent MLflow run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
import sys
from pathlib import Path

import yaml

from cluster.analysis.run_configs import assignments, build_config, run_setup
from cluster.analysis.sweep_spec import read_base
from cluster.analysis.trials import RecordingFailed, RunsFailed
from cluster.claims.privacy_plan import format_sigma
from cluster.config import (
    ConfigError,
    config_from_dict,
    read_yaml_mapping,
)


def load_spec(
    path: Path, overrides: list[str], only: list[str] = ()
) -> tuple[dict, dict[str, dict]]:
    """The base config and the runs (only those labels, if given), each validated."""
    spec = read_yaml_mapping(path)
    shared = {key for key in spec if str(key).startswith("x-")}
    if set(spec) - shared != {"base", "runs"}:
        raise ConfigError(
            "SPEC",
            str(path),
            "needs exactly two keys, base and runs (plus x-… keys holding YAML anchors)",
        )
    base = spec["base"]
    if isinstance(base, str):
        base = read_base(path, base)
    runs = spec["runs"]
    if not isinstance(runs, dict) or not runs:
        raise ConfigError("runs", runs, "a mapping label → overrides, e.g. {dp_fedavg: {...}}")
    unknown = [label for label in only if label not in runs]
    if unknown:
        raise ConfigError("--only", unknown, f"no such run; known: {', '.join(runs)}")
    runs = {label: changes for label, changes in runs.items() if not only or label in only}
    for label, changes in runs.items():  # validate every run before any work
        run_base, run_overrides = run_setup(base, overrides, changes)
        name = run_name(path.stem, label, 0)  # a label reaches the runs' names: check it too
        config_from_dict(run_base, [*run_overrides, *assignments(changes), name])
    return base, runs


def run_name(spec_name: str, label: str, seed: int) -> str:
    """The override naming one run of the comparison (its MLflow run, a file name)."""
    return f"tracking.run_name={json.dumps(f'{spec_name}-{label}-seed{seed}')}"


def _baseline(requested: str | None, labels: list[str]) -> str | None:
    if requested is None:
        return "dp_fedavg" if "dp_fedavg" in labels else None
    if requested == "none":
        return None
    if requested not in labels:
        raise ConfigError("--baseline", requested, f"not among the runs: {', '.join(labels)}")
    return requested


MIN_LAST_TENTH_EVALUATIONS = 3  # fewer, and "last 10% of rounds" is one or two noisy points


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def paired_t_interval(differences: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Student's t interval for the mean of paired differences d_1..d_n (one per seed):
    d̄ ± t_{(1+level)/2, n−1} · s_d/√n, s_d the sample std (n − 1). It assumes the differences
    are i.i.d. normal across seeds; None for n < 2 (no spread to estimate)."""
    from scipy.stats import t

    n = len(differences)
    if n < 2:
        return None
    mean, sd = mean_std(differences)
    half = float(t.ppf((1 + level) / 2, n - 1)) * sd / math.sqrt(n)
    return mean - half, mean + half


def summarize(
    results: dict[str, list], baseline: str | None = None, targets: tuple[float, ...] = ()
) -> list[dict]:
    """One row per run; with a ``baseline`` label also the paired difference of final accuracy
    (run − baseline, seed by seed: the seeds share partition, cohorts and batches), whose spread
    is far smaller than the runs' own std when seeds differ mostly in difficulty. For each of
    ``targets``: the rounds to reach that test accuracy, mean ± std over the seeds that did, and
    how many did."""
    rows = []
    reference = [o.final_accuracy for o in results[baseline]] if baseline else None
    for label, outcomes in results.items():
        finals = [o.final_accuracy for o in outcomes]
        bests = [
            max(r.test_accuracy for r in o.result.history if r.test_accuracy is not None)
            for o in outcomes
        ]
        final, final_sd = mean_std(finals)
        best, best_sd = mean_std(bests)
        last_tenth, last_tenth_sd = mean_std([o.last_tenth_accuracy for o in outcomes])
        last_tenth_evals = min(len(o.last_tenth_evaluations) for o in outcomes)
        # DP-FedSAM's "Train" (its code: the clients' running accuracy during local training,
        # last round) and Train − Val, paired per seed against the final test accuracy.
        trains = [o.result.history[-1].metrics.get("train_accuracy", math.nan) for o in outcomes]
        train, train_sd = mean_std(trains)
        gap, gap_sd = mean_std([t - f for t, f in zip(trains, finals, strict=True)])
        first = outcomes[0]
        rows.append(
            {
                "run": label,
                "final_acc_mean": final,
                "final_acc_std": final_sd,
                "best_acc_mean": best,
                "best_acc_std": best_sd,
                "last10pct_acc_mean": last_tenth,
                "last10pct_acc_std": last_tenth_sd,
                "last10pct_evals": last_tenth_evals,  # the fewest any seed averaged
                "train_acc_mean": train,
                "train_acc_std": train_sd,
                "train_test_gap_mean": gap,
                "train_test_gap_std": gap_sd,
                # From the run's own PrivacyClaim: a number only where the mechanism has one.
                "epsilon": first.epsilon if first.claim.dp_valid else None,
                "epsilon_vs_server": first.epsilon_vs_server,
                "dp_valid": first.claim.dp_valid,
                "private": first.claim.private,
                "sigma": first.claim.noise_multiplier if first.claim.private else None,
                "seeds": len(outcomes),
            }
        )
        for target in targets:
            reached = [r for r in (o.rounds_to(target) for o in outcomes) if r is not None]
            mean, sd = mean_std(reached) if reached else (None, None)
            key = _target_key(target)
            rows[-1].update({f"{key}_mean": mean, f"{key}_std": sd, f"{key}_reached": len(reached)})
        if reference is not None:
            paired = [a - b for a, b in zip(finals, reference, strict=False)]
            diff, diff_sd = mean_std(paired)
            low, high = paired_t_interval(paired) if label != baseline else (None, None)
            rows[-1].update(
                {
                    "diff_vs_baseline_mean": diff,
                    "diff_vs_baseline_std": diff_sd,
                    "diff_vs_baseline_ci95_low": low,
                    "diff_vs_baseline_ci95_high": high,
                }
            )
    if baseline:  # DP-FedPGN's speed-up: the baseline's rounds to a target over the run's
        base = next(r for r in rows if r["run"] == baseline)
        for row in rows:
            for target in targets:
                key = _target_key(target)
                ours, theirs = row[f"{key}_mean"], base[f"{key}_mean"]
                row[f"{key}_speedup"] = theirs / ours if ours and theirs else None
    return rows


def _target_key(target: float) -> str:
    return f"rounds_to_{100 * target:g}pct"


def _targets(row: dict) -> list[str]:
    """The rounds-to-target keys of a summary row, in the order they were asked for."""
    return [key[: -len("_reached")] for key in row if key.endswith("_reached")]


def _rounds_cell(row: dict, key: str) -> str:
    reached = f"({row[f'{key}_reached']}/{row['seeds']})"
    if row[f"{key}_mean"] is None:
        return f"— {reached}"
    speedup = row.get(f"{key}_speedup")
    faster = "" if speedup is None else f", {speedup:.2f}× the baseline's speed"
    return f"{row[f'{key}_mean']:.0f} ± {row[f'{key}_std']:.0f} {reached}{faster}"


def _difference_cell(row: dict, baseline: str) -> str:
    """Paired Δ in points: mean ± std over seeds and its 95% t-interval (n ≥ 2)."""
    if row["run"] == baseline:
        return "0 (baseline)"
    diff, sd = 100 * row["diff_vs_baseline_mean"], 100 * row["diff_vs_baseline_std"]
    cell = f"{diff:+.2f} ± {sd:.2f}"
    if row["diff_vs_baseline_ci95_low"] is None:
        return cell + ", no CI (1 seed)"
    low, high = 100 * row["diff_vs_baseline_ci95_low"], 100 * row["diff_vs_baseline_ci95_high"]
    resolved = "excludes 0" if low > 0 or high < 0 else "includes 0"
    return cell + f", 95% CI [{low:+.2f}, {high:+.2f}] ({resolved})"


def last_tenth_warnings(rows: list[dict]) -> list[str]:
    """One line per run whose 'last 10% of rounds' mean rests on too few evaluations."""
    return [
        f"compare: warning: {r['run']}: the 'last 10% of rounds' accuracy averages only "
        f"{r['last10pct_evals']} evaluation(s); set eval_every to at most rounds/"
        f"{10 * MIN_LAST_TENTH_EVALUATIONS} for {MIN_LAST_TENTH_EVALUATIONS} or more"
        for r in rows
        if r["last10pct_evals"] < MIN_LAST_TENTH_EVALUATIONS
    ]


def epsilon_cell(row: dict) -> str:
    """ε as the run's claim allows: ∞ without noise, n/a for an unaccounted mechanism."""
    if not row["private"]:
        return "∞"
    if not row["dp_valid"]:
        return "n/a (dp_valid=false)"
    cell = f"{row['epsilon']:.3f}"
    if row["epsilon_vs_server"] is not None:
        cell += f" (vs server {row['epsilon_vs_server']:.3g})"
    return cell


def markdown(rows: list[dict], baseline: str | None = None) -> str:
    header = (
        "| run | final acc (%) | best acc (%) | last 10% of rounds, mean acc (%) (evals) "
        "| local train acc (%) | train − test (pts) | ε | σ |"
    )
    targets = _targets(rows[0]) if rows else []
    for key in targets:
        header += f" rounds to {key.removeprefix('rounds_to_').removesuffix('pct')}% (reached) |"
    if baseline:
        header += f" Δ final acc vs {baseline}, paired over seeds (pts) |"
    lines = [header, "|---" * header.count(" |") + "|"]
    for r in rows:
        sigma = "—" if r["sigma"] is None else format_sigma(r["sigma"])
        eps = epsilon_cell(r)
        line = (
            f"| {r['run']} | {100 * r['final_acc_mean']:.2f} ± {100 * r['final_acc_std']:.2f} "
            f"| {100 * r['best_acc_mean']:.2f} ± {100 * r['best_acc_std']:.2f} "
            f"| {100 * r['last10pct_acc_mean']:.2f} ± {100 * r['last10pct_acc_std']:.2f} "
            f"({r['last10pct_evals']}) "
            f"| {100 * r['train_acc_mean']:.2f} ± {100 * r['train_acc_std']:.2f} "
            f"| {100 * r['train_test_gap_mean']:+.2f} ± {100 * r['train_test_gap_std']:.2f} "
            f"| {eps} | {sigma} |"
        )
        line += "".join(f" {_rounds_cell(r, key)} |" for key in targets)
        if baseline:
            line += f" {_difference_cell(r, baseline)} |"
        lines.append(line)
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    """``rows`` as CSV, the columns every key in order of first appearance (blank where a row
    lacks one)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    writer.writeheader()
    writer.writerows(rows)
    path.write_text(buffer.getvalue())


def write_outputs(
    rows: list[dict], results: dict[str, list], out: Path, baseline: str | None = None
) -> list[Path]:
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(markdown(rows, baseline) + "\n")
    write_csv(rows, out / "compare.csv")
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for index, (label, outcomes) in enumerate(results.items()):
        per_round: dict[int, list[float]] = {}
        for o in outcomes:
            for r in o.result.history:
                if r.test_accuracy is not None:
                    per_round.setdefault(r.round, []).append(r.test_accuracy)
        xs = sorted(per_round)
        # The colour cycle has 10 entries: later runs get a new line style.
        style = ("-", "--", ":")[index // 10 % 3]
        means = [statistics.mean(per_round[x]) for x in xs]
        ax.plot(xs, means, marker=".", linestyle=style, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel(f"test accuracy (mean of {max(len(o) for o in results.values())} seeds)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "compare_accuracy.png", dpi=100)
    from cluster.analysis.compare_plots import accuracy_against_communication

    communication = accuracy_against_communication(results, out)  # None: no bytes logged
    paths = [out / "compare.md", out / "compare.csv", out / "compare_accuracy.png"]
    return paths + ([communication] if communication is not None else [])


def run(args: argparse.Namespace) -> int:
    try:
        base, runs = load_spec(Path(args.spec), args.set, args.only)
        if args.seeds < 1:
            raise ConfigError("--seeds", args.seeds, "must be >= 1")
        if args.concurrent < 0:
            raise ConfigError("--concurrent", args.concurrent, "0 (one after another) or more")
        labels = list(runs)
        baseline = _baseline(args.baseline, labels)
        for target in args.target_accuracy:
            if not 0 < target <= 1:
                raise ConfigError("--target-accuracy", target, "must be in (0, 1], e.g. 0.3")
    except (ConfigError, OSError, yaml.YAMLError) as error:
        print(f"compare: {error}", file=sys.stderr)
        return 2
    name = Path(args.spec).stem
    parent = _start_parent_run(name, base)
    try:
        results = _run_all(name, base, runs, labels, args, parent and parent.run_id)
    except BaseException as error:
        if parent is not None:
            parent.abandon("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        if isinstance(error, (RunsFailed, RecordingFailed)):
            print(f"compare: {error}", file=sys.stderr)
            return 1
        raise
    rows = summarize(results, baseline, tuple(args.target_accuracy))
    print(markdown(rows, baseline))
    for warning in last_tenth_warnings(rows):
        print(warning, file=sys.stderr)
    paths = write_outputs(rows, results, Path(args.out), baseline)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    if parent is not None:
        children = {
            f"{label}-seed{seed}": outcome.run_id
            for label, outcomes in results.items()
            for seed, outcome in enumerate(outcomes)
        }
        listing = Path(args.out) / "children.json"
        listing.write_text(json.dumps(children, indent=1) + "\n")
        parent.log_files([*paths, listing], "compare")
        parent.end()
    return 0


def _run_all(
    name: str, base: dict, runs: dict, labels: list[str], args, parent_run_id: str | None
) -> dict[str, list]:
    """Every preset × seed (``cluster.analysis.trials``): one after another in this process, or with
    ``--concurrent N``, N at once on Ray; outcomes by label, in seed order. ``RunsFailed``
    where a concurrent run failed, ``RecordingFailed`` where handling a run's end raised (the
    others ran to their end)."""
    from cluster.analysis.trials import Trial, calibrate, run_concurrently, run_in_process

    trials, keys = [], {}
    for label in labels:
        for seed in range(args.seeds):
            extra = [f"seed={seed}", run_name(name, label, seed)]
            config = calibrate(build_config(base, args.set, runs[label], extra), print)
            trials.append(Trial(f"{name}-{label}-seed{seed}", config))
            keys[trials[-1].name] = (label, seed)

    def on_done(result, uri: str | None = None) -> None:
        label, seed = keys[result.trial.name]
        outcome = result.outcome
        if result.status != "FINISHED":
            print(f"{label} seed {seed}: {result.status} {result.error or ''}", flush=True)
            return
        eps = outcome.claim.epsilon_text(outcome.epsilon, outcome.epsilon_vs_server)
        print(
            f"{label} seed {seed}: final acc {outcome.final_accuracy:.4f}, {eps}, "
            f"{result.seconds:.0f} s",
            flush=True,
        )

    if args.concurrent:
        done = run_concurrently(trials, args.concurrent, parent_run_id, on_done)
    else:
        done = run_in_process(trials, parent_run_id, on_done)
    failed = [r for r in done if r.status != "FINISHED"]
    if failed:
        raise RunsFailed([f"{r.trial.name}: {r.status} {r.error or ''}" for r in failed])
    results: dict[str, list] = {label: [] for label in labels}
    for result in sorted(done, key=lambda r: keys[r.trial.name][1]):
        results[keys[result.trial.name][0]].append(result.outcome)
    return results


def _start_parent_run(name: str, base: dict):
    """The parent MLflow run: each preset × seed run is nested under it (``mlflow.parentRunId``)
    and it holds the table, the figure and ``children.json`` (label-seed → run id)."""
    from cluster.tracking.process import TrackingRun
    from cluster.tracking.settings import tracking_uri

    tracking = base.get("tracking") or {}
    if tracking.get("enabled", True) is False:
        return None
    experiment = tracking.get("experiment", "dpfl")
    return TrackingRun.open(tracking_uri(), experiment, f"compare-{name}", {}, {"compare": name})
