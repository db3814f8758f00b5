"""``python -m cluster sweep``'s options; the sweep itself (``cluster.analysis.sweep``, which
imports torch, Ray and MLflow) is imported when it runs, so that ``sweep --help`` starts at
once."""

from __future__ import annotations

import argparse

from cluster.cli.compare import add_set_option


def add_parser(commands, help_text: str) -> None:
    p = commands.add_parser(
        "sweep",
        help=help_text,
        description="A search space × seeds, trials concurrently on Ray, one configuration "
        "selected by the mean over seeds of a validation metric (see "
        "cluster/analysis/sweep_spec.py for the spec format). Rerun the same command to resume: "
        "finished trials are not rerun.",
    )
    p.add_argument("spec", help="sweep YAML (base, space, search, seeds, select)")
    add_set_option(p)
    p.add_argument(
        "--concurrent",
        type=int,
        default=0,
        metavar="N",
        help="at most N trials at once (default 0: as many as the Ray cluster's CPUs/GPUs hold)",
    )
    p.add_argument(
        "--out",
        help="folder for the table, plot and selected.yaml (sweeps/<spec>) and the trials' "
        "ledger/: part of the sweep's identity, since with tracking off a rerun resumes from "
        "the ledger under the same --out only",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster.analysis.sweep import run as run_sweep

    return run_sweep(args)
