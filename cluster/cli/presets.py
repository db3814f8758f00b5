"""``python -m cluster presets``: every algorithm preset, its paper, whom it protects, whether
an accountant's ε holds for it, and the starting config to run it from.

The privacy columns are read off each preset's example (``configs/examples/<preset>.yaml``)
as a run reads them: the algorithm it builds and the run's privacy claim, with the preset's
default options (the papers' literal variants are opt-in and unaccounted).
"""

from __future__ import annotations

import argparse


def add_parser(commands, help_text: str) -> None:
    p = commands.add_parser(
        "presets",
        help=help_text,
        description="One row per preset: paper, privacy unit (client, record or none), "
        "accounted (an accountant's ε holds: dp_valid) and the example config to start from.",
    )
    p.set_defaults(handler=run)


def preset_row(name: str) -> tuple[str, str, str, str, str]:
    """(preset, paper, privacy unit, accounted, example) of ``name`` from its example config."""
    from algorithms.papers import PAPERS
    from cluster.claims.privacy_plan import privacy_claim
    from cluster.config import load_config
    from cluster.config.errors import example_path

    config = load_config(example_path(name))
    claim = privacy_claim(config, config.build_algorithm())
    unit = ("record" if config.sample_level else "client") if claim.private else "none"
    return name, PAPERS[name], unit, "yes" if claim.dp_valid else "no", example_path(name)


def run(args: argparse.Namespace) -> int:
    from algorithms.presets import PRESETS

    header = ("preset", "paper", "unit", "accounted", "example")
    rows = [header, *(preset_row(name) for name in PRESETS)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print("  ".join(cells).rstrip())
    return 0
