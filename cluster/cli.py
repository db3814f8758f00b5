"""Command line: ``python -m cluster run CONFIG [--set a.b=value ...]``."""

from __future__ import annotations

import argparse
import sys

from cluster.config import ConfigError, load_config
from cluster.simulation import RoundRecord


def _progress_line(record: RoundRecord, total: int) -> str:
    parts = [f"round {record.round:>4}/{total}"]
    if record.epsilon is not None:
        parts.append(f"ε {record.epsilon:7.3f}")
    if record.test_accuracy is not None:
        parts.append(f"acc {record.test_accuracy:.4f}")
    if "clip_fraction" in record.metrics:
        parts.append(f"clipped {record.metrics['clip_fraction']:.2f}")
    parts.append(f"{record.seconds:.2f} s/round")
    return " | ".join(parts)


def _run(args: argparse.Namespace) -> int:
    overrides = list(args.set)
    if args.executor:
        overrides.append(f"executor.kind={args.executor}")
    if args.address:
        overrides.append(f"executor.address={args.address}")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2

    from cluster.experiment import run_experiment

    a = config.algorithm
    print(
        f"{a.name} on {config.task}: {config.data.num_clients} clients, cohort "
        f"{config.cohort.size} ({config.cohort.sampling}), {config.rounds} rounds, executor "
        f"{config.executor.kind}",
        flush=True,
    )
    outcome = run_experiment(config, lambda r: print(_progress_line(r, config.rounds), flush=True))
    result = outcome.result
    print(f"done: {result.stop_reason}")
    if outcome.final_accuracy is not None:
        print(f"final test accuracy {outcome.final_accuracy:.4f}")
    if outcome.result.history and outcome.result.history[-1].epsilon is not None:
        print(
            f"privacy spent: ε = {outcome.epsilon:.3f} at δ = {config.delta:g} "
            f"(client-level, {config.privacy.accountant})"
        )
    if outcome.run_id:
        print(f"MLflow run {outcome.run_id} in {outcome.tracking_uri}")
        print(f"browse it with: mlflow ui --backend-store-uri {outcome.tracking_uri}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster", description="DP federated learning simulations on Ray"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one experiment from a YAML config")
    run.add_argument("config", help="experiment YAML, e.g. configs/quickstart.yaml")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set rounds=10 (repeatable)",
    )
    run.add_argument("--executor", choices=["local", "ray"], help="override executor.kind")
    run.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or embedded)")
    run.set_defaults(handler=_run)
    args = parser.parse_args(argv)
    return args.handler(args)
