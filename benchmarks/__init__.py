"""Performance benchmarks: each module is a command writing one JSON report."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, out: str | Path) -> Path:
    """``report`` as indented JSON at ``out`` (its folder made as needed); returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    return path
