"""In-memory labelled data as it leaves a source, before partitioning."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LabeledArrays:
    """``x[i]`` has label ``y[i]``; ``group[i]`` is the natural owner (user/writer) when known."""

    x: np.ndarray
    y: np.ndarray
    group: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} rows but y has {len(self.y)}")
        if self.group is not None and len(self.group) != len(self.y):
            raise ValueError(f"group has {len(self.group)} rows but y has {len(self.y)}")

    def __len__(self) -> int:
        return len(self.y)

    def take(self, index: np.ndarray) -> LabeledArrays:
        group = None if self.group is None else self.group[index]
        return LabeledArrays(self.x[index], self.y[index], group)
