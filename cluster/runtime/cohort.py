"""Cohort samplers, seeded by (seed, round) so every executor sees the same cohorts."""

from __future__ import annotations

import numpy as np

from algorithms.rng import Purpose, numpy_rng


def sample_cohort(
    sampling: str, num_clients: int, size: int, seed: int, round_index: int
) -> np.ndarray:
    """Sorted client ids of one round's cohort.

    ``fixed``: exactly ``size`` clients uniformly without replacement. ``poisson``: each client
    independently with probability q = size/num_clients (the cohort may be empty).
    """
    rng = numpy_rng(seed, round_index, Purpose.COHORT)
    if sampling == "fixed":
        return np.sort(rng.choice(num_clients, size=size, replace=False))
    if sampling == "poisson":
        return np.flatnonzero(rng.random(num_clients) < size / num_clients)
    raise ValueError(f"unknown cohort sampling {sampling!r}")
