"""Command line: ``python -m cluster run CONFIG [--set a.b=value ...]``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TYPE_CHECKING

from cluster.tracking_process import prestart as prestart_tracking

if TYPE_CHECKING:
    from cluster.records import RoundRecord

# Subcommands in their own modules, imported only when chosen (torch, opacus and mlflow take
# seconds to import; `--help` and the calculators should not wait for them).
SUBCOMMANDS = {
    "privacy": (
        "cluster.privacy_cli",
        "privacy calculator: ε, calibrated σ or max rounds, side by side per accountant",
    ),
    "audit": (
        "cluster.audit_cli",
        "privacy audit: empirical ε lower bound (canary client) vs the accountant's ε",
    ),
    "partition": (
        "cluster.partition_cli",
        "build a shard store (partitioned dataset) and its partition report",
    ),
    "compare": (
        "cluster.compare_cli",
        "run several presets at the same ε over several seeds; mean ± std table",
    ),
    "landscape": (
        "cluster.landscape_cli",
        "loss-landscape slices around a checkpoint's model (filter-normalised directions)",
    ),
}


def _progress_line(record: RoundRecord, total: int, claim) -> str:
    parts = [f"round {record.round:>4}/{total}"]
    if record.metrics.get("warmup"):
        parts.append("warm-up (c_i⁰)")
    if claim.private:
        parts.append(claim.epsilon_text(record.epsilon, record.metrics.get("epsilon_vs_server")))
    if record.test_accuracy is not None:
        parts.append(f"acc {record.test_accuracy:.4f}")
    if "clip_fraction" in record.metrics:
        parts.append(f"clipped {record.metrics['clip_fraction']:.2f}")
    parts.append(f"{record.seconds:.2f} s/round")
    return " | ".join(parts)


# What a resumed run may change: how and how long it runs, never what it computes.
RESUMABLE_PREFIXES = ("rounds", "eval_every", "eval_train", "executor.", "checkpoint.")


def _overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.set)
    if args.executor:
        overrides.append(f"executor.kind={args.executor}")
    if args.address:
        overrides.append(f"executor.address={args.address}")
    return overrides


def _start_tracking_process(verbose: bool) -> None:
    """Start the MLflow process now: its imports run on another core while this one imports
    torch. It inherits the environment as it is here (quiet MLflow, unless ``verbose``)."""
    if verbose:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO")  # read when MLflow is imported
    prestart_tracking()


def _run(args: argparse.Namespace) -> int:
    # First line before the heavy imports (torch alone takes seconds): the user sees it started.
    print(f"run {args.config}" + "".join(f" --set {a}" for a in _overrides(args)), flush=True)
    _start_tracking_process(args.verbose)
    from cluster.config import load_config

    return _execute(load_config(args.config, _overrides(args)), None, args.verbose)


def _resume(args: argparse.Namespace) -> int:
    from cluster.checkpoint import load_checkpoint
    from cluster.config import ConfigError, config_from_dict

    print(f"resume {args.checkpoint}", flush=True)
    _start_tracking_process(args.verbose)
    overrides = _overrides(args)
    for assignment in overrides:
        if not assignment.startswith(RESUMABLE_PREFIXES):
            raise ConfigError(
                "--set",
                assignment,
                "a resumed run keeps its config; only "
                "rounds, eval_every, eval_train, executor.* and checkpoint.* may change",
            )
    checkpoint = load_checkpoint(args.checkpoint)
    try:
        config_from_dict(checkpoint["config"])
    except ConfigError as error:
        raise ConfigError(
            f"{args.checkpoint}: {error.field_path}",
            error.value,
            f"{error.fix} (this checkpoint's config; written by another version of this code? "
            "resume it with that version, or start the run afresh)",
        ) from None
    config = config_from_dict(checkpoint["config"], overrides)
    done = checkpoint["simulation"]["rounds_done"]
    print(f"resuming after round {done} from {args.checkpoint}", flush=True)
    return _execute(config, checkpoint, args.verbose)


def _execute(config, checkpoint: dict | None, verbose: bool) -> int:
    try:
        return _execute_in_session(config, checkpoint, verbose)
    finally:
        from cluster.ray_runtime import disconnect

        disconnect()


def _execute_in_session(config, checkpoint: dict | None, verbose: bool) -> int:
    from cluster.experiment import run_experiment
    from cluster.preflight import check_no_checkpoint_overwritten, preflight
    from cluster.privacy_plan import calibrate_with_message, privacy_claim

    def say(message: str) -> None:
        print(message, flush=True)

    if checkpoint is None:
        preflight(config)  # before the σ search: a missing file fails at once
        check_no_checkpoint_overwritten(config)
        config = calibrate_with_message(config, say)

    a = config.algorithm
    print(
        f"{a.name} on {config.task}: {config.data.num_clients} clients, cohort "
        f"{config.cohort.size} ({config.cohort.sampling}), {config.rounds} rounds, executor "
        f"{config.executor.kind}",
        flush=True,
    )
    claim = privacy_claim(config, config.build_algorithm())
    try:
        outcome = run_experiment(
            config,
            lambda r: print(_progress_line(r, config.total_rounds, claim), flush=True),
            checkpoint,
            say,
            calibrate=False,
            verbose=verbose,
        )
    except KeyboardInterrupt as error:  # a second Ctrl-C: abort now, no checkpoint of this round
        print(f"aborted: {error or 'KeyboardInterrupt'}", file=sys.stderr)
        return 130
    result, config = outcome.result, outcome.config
    if outcome.interrupted:
        print(
            f"{result.stop_reason}: checkpoint {outcome.checkpoint}; resume with: uv run python "
            f"-m cluster resume {outcome.checkpoint}",
            flush=True,
        )
        return 130  # the shell's code for a run ended by Ctrl-C
    print(f"done: {result.stop_reason}")
    if outcome.final_accuracy is not None:
        print(f"final test accuracy {outcome.final_accuracy:.4f}")
    if outcome.claim.private:
        print(outcome.privacy_line())
    print(
        f"checkpoint: {outcome.checkpoint} (continue with: uv run python -m cluster resume "
        f"{outcome.checkpoint} --set rounds=N)"
    )
    if outcome.run_id:
        print(f"MLflow run {outcome.run_id} in {outcome.tracking_uri}")
        if not outcome.tracking_uri.startswith("http"):
            print(f"browse it with: uv run mlflow ui --backend-store-uri {outcome.tracking_uri}")
        print(f"run page: {outcome.run_page}")
    return 0


def _add_execution_options(parser: argparse.ArgumentParser, set_help: str) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    parser.add_argument("--executor", choices=["local", "ray"], help="override executor.kind")
    parser.add_argument(
        "--address", help="Ray cluster address (default: $RAY_ADDRESS or an embedded Ray)"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show Ray's own log lines and the workers' output (default: only the run's "
        "progress; Ray's logs stay in the log directory printed at start)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="uv run python -m cluster", description="DP federated learning simulations on Ray"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one experiment from a YAML config")
    run.add_argument("config", help="experiment YAML, e.g. configs/quickstart.yaml")
    _add_execution_options(run, "override a config field, e.g. --set rounds=10 (repeatable)")
    run.set_defaults(handler=_run)
    resume = commands.add_parser("resume", help="continue a run from its checkpoint")
    resume.add_argument("checkpoint", help="checkpoint file written by a run")
    _add_execution_options(
        resume, "change rounds, eval_every, eval_train, executor.* or checkpoint.* only"
    )
    resume.set_defaults(handler=_resume)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(commands, help_text)
        else:  # listed in --help; its options are parsed only when it is the command
            commands.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except _input_errors() as error:  # bad input: one paragraph, no traceback
        print(error, file=sys.stderr)
        return 2


def _input_errors() -> tuple[type[Exception], ...]:
    """What bad input raises: a config field, a file, the Ray cluster's size."""
    from cluster.config import ConfigError
    from cluster.ray_runtime import ResourceError
    from datasets.vision import SourceMissingError

    return ConfigError, SourceMissingError, ResourceError
