"""``python -m cluster compare``'s options; the comparison itself (``cluster.analysis.compare``,
which imports torch and MLflow) is imported when it runs, so that ``compare --help`` starts at
once."""

from __future__ import annotations

import argparse


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE``: an override of a spec's base config (compare, sweep)."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override the base config (repeatable)",
    )


def add_parser(commands, help_text: str) -> None:
    p = commands.add_parser(
        "compare",
        help=help_text,
        description="Several presets at the same ε over several seeds: one mean ± std table "
        "(see cluster/analysis/compare.py for the spec format).",
    )
    p.add_argument("spec", help="comparison YAML (base + runs)")
    p.add_argument("--seeds", type=int, default=3)
    add_set_option(p)
    p.add_argument("--only", action="append", default=[], help="run only these labels")
    p.add_argument("--out", default="compare", help="folder for the table and figure")
    p.add_argument(
        "--baseline",
        help="run label to difference against, seed by seed (default: dp_fedavg if present; "
        "'none' for no difference column)",
    )
    p.add_argument(
        "--target-accuracy",
        action="append",
        type=float,
        default=[],
        metavar="ACC",
        help="also report the first round each run's test accuracy reaches ACC (e.g. 0.3; "
        "repeatable): DP-FedPGN's rounds-to-target",
    )
    p.add_argument(
        "--concurrent",
        type=int,
        default=0,
        metavar="N",
        help="run N runs at once on Ray, each in a placement group of its driver and actors "
        "(cluster/analysis/trials.py); default 0: one after another in this process",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster.analysis.compare import run as run_compare

    return run_compare(args)
