"""The largest number of rounds meeting a monotone predicate (round budgets of every accountant).

Dependency-free, so that the light modules (``privacy.subsampling_wor``: numpy only;
``privacy.sample_level``: no Opacus) and ``privacy.calibration`` share it.
"""

from __future__ import annotations

from collections.abc import Callable


def largest_meeting(predicate: Callable[[int], bool], limit: int) -> int:
    """Largest T in 1..``limit`` with ``predicate(T)``; 0 when none does (or ``limit`` < 1).

    ``predicate`` must hold up to some T* and fail beyond it, e.g. ε(T) ≤ ε* with ε growing
    with T. Doubling T = 1, 2, 4, … while it holds, then bisection between the last T that held
    and the first that failed; when every power of two up to ``limit`` holds, ``limit`` itself is
    probed (and returned if it holds). About 2·log₂(T*) probes, all within 1..``limit``.
    """
    if limit < 1 or not predicate(1):
        return 0
    lo, hi = 1, 2  # invariant: predicate(lo)
    while hi <= limit and predicate(hi):
        lo, hi = hi, 2 * hi
    if hi > limit:
        if lo == limit or predicate(limit):
            return limit
        hi = limit
    while hi - lo > 1:  # invariant: predicate(lo), not predicate(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predicate(mid) else (lo, mid)
    return lo
