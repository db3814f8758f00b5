"""What a round reports: plain data, importable without torch (the MLflow tracking process,
``cluster.tracking.service``, receives these pickled)."""

from __future__ import annotations

from array import array
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
    # Each client's ‖Δ_i‖₂ before clipping (dropped clients left out): the distributions of
    # DP-FedSAM's Fig. 4, BLUR+LUS's Fig. 2 and DP-FedPGN's Fig. 6 (``update_norms.npz``).
    # float32, 4 bytes a client: a 1,000-client cohort adds 4 kB a round to the history.
    update_norms: array = field(default_factory=lambda: array("f"))
