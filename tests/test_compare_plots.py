"""compare's accuracy-against-communication figure (cluster/analysis/compare_plots.py)."""

import math
from types import SimpleNamespace

import pytest

from cluster.analysis.compare_plots import (
    COMMUNICATION_PLOT,
    CommunicationPoint,
    accuracy_against_communication,
    communication_points,
)
from cluster.runtime.records import RoundRecord


def _outcome(preset: str, accuracy: float | None, communicated: list[float] | None):
    """A run of ``preset`` whose rounds logged ``communicated`` (cumulative bytes; None: no
    byte metrics) and whose last evaluation was ``accuracy``."""
    rounds = communicated or [None, None]
    history = [
        RoundRecord(t, 0.0, 5, metrics={} if total is None else {"communication_bytes": total})
        for t, total in enumerate(rounds, start=1)
    ]
    return SimpleNamespace(
        result=SimpleNamespace(history=history),
        config=SimpleNamespace(algorithm=SimpleNamespace(name=preset)),
        final_accuracy=accuracy,
    )


def test_points_average_each_labels_seeds_and_leave_out_runs_without_bytes():
    results = {
        "dpsfl_cl1": [_outcome("dpsfl", 0.5, [40.0, 100.0]), _outcome("dpsfl", 0.7, [90, 300])],
        "dpsfl_cl5": [_outcome("dpsfl", 0.4, [10.0, 20.0])],
        "no_bytes": [_outcome("dp_fedavg", 0.9, None)],
        "no_eval": [_outcome("dp_fedavg", None, [5.0])],
    }
    points = communication_points(results)
    assert [p.label for p in points] == ["dpsfl_cl1", "dpsfl_cl5"]
    first = points[0]
    assert (first.preset, first.total_bytes, first.accuracy) == ("dpsfl", 200.0, 0.6)
    assert first.accuracy_std == pytest.approx(math.sqrt(0.02))  # stdev of 0.5 and 0.7
    assert points[1] == CommunicationPoint("dpsfl_cl5", "dpsfl", 20.0, 0.4, 0.0)


def test_the_figure_is_written_when_bytes_were_logged_and_skipped_otherwise(tmp_path):
    logged = {"fetchsgd": [_outcome("fetchsgd", 0.9, [1e6, 2e6])]}
    assert accuracy_against_communication(logged, tmp_path) == tmp_path / COMMUNICATION_PLOT
    assert (tmp_path / COMMUNICATION_PLOT).stat().st_size > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert accuracy_against_communication({"a": [_outcome("fedavg", 0.9, None)]}, empty) is None
    assert not any(empty.iterdir())
