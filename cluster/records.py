"""What a round reports: plain data, importable without torch (the MLflow tracking process,
``cluster.tracking_process``, receives these pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundRecord:
    round: int  # 1-based: the number of rounds completed
    seconds: float
    cohort_size: int
    epsilon: float | None = None
    test_accuracy: float | None = None
    test_loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
