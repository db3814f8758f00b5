"""The L2 norms that decide a clip: an upper bound of the exact norm, within 3.5·10⁻⁶ of it.

torch's float32 ``vector_norm`` sums a row's squares in float32: on random vectors of unequal
coordinates its relative error measured 2.3e-5 at 582k coordinates (the MNIST CNN) and 6.3e-4 at
11M (ResNet-18), either way, so a clip to C by that norm released updates of norm up to
C·(1 + 6e-4): a sensitivity above the one every accountant is given.

Here a row of float32 numbers is cut into pieces of ``PIECE`` coordinates, each piece's norm
taken in float32 (a float32 sum of w nonnegative terms, in any order, is within (w − 1)·u of the
exact sum, u = 2⁻²⁴; Higham 2002, §4.2: the squares and the root add 3u), and the pieces'
squares summed in float64, in a fixed two-level order (``_fixed_order_sum``: torch would split
one long sum across threads, and a row's bound would depend on the thread count and on whether
it came alone or in a block). The sum read is then at most (w + 2)·u below the exact one, the
norm (w + 2)·u/2 (1.0e-6 at w = 32), and scaling it by ``1 + SLACK`` (2.4e-6) makes it an upper
bound of the exact norm with room for the float32 rounding of a clip's own product (≤ 2u: a
float32 factor, each coordinate's product rounded): SLACK = (w + 8)·u is about twice the
(w + 2)·u/2 + 2u these need, a margin for what the analysis rounds to first order. A clip by
this norm releases a norm ≤ C, exactly, and shrinks an update at most ``EXCESS`` below C:
what the diagnostics (``pre_clip_norm``) over-read too. Rows of at most ``SHORT`` coordinates,
and float64 rows, are summed in float64 whole (an error of d·2⁻⁵³), enlarged by 3u only: a
small layer's norm costs one kernel. float16 and bfloat16 rows are refused (their norms round
far beyond the slack).

Squares of coordinates below ≈ 1e-19 underflow in float32 (at most d·1.2e-38 lost, far below
C² ≥ 10⁻¹², ``MIN_CLIP_NORM``, which the adaptive clip keeps too); a finite row longer than
``SHORT`` whose float32 piece norm overflows (coordinates above ≈ 1.8e19) gets norm ∞ (a short
one its finite norm), as NaN or ±inf in a row gives NaN or ∞.
"""

from __future__ import annotations

import torch

PIECE = 32
SHORT = 64
# The smallest clip norm C (a config's, and the adaptive clip's C_t): a vector whose norm exceeds
# C ≥ 1e-6 (of at most 2³¹ entries) has an entry above 2e-11, whose float32 square is a normal
# number, and the squares that underflow (entries below 1e-19) sum to under 1e-28 ≪ C². At
# C = 1e-30 an update of 410 entries of 1e-25 (norm 2e-24) had a float32 norm of 0 and was
# released unclipped, 2e6 × C.
MIN_CLIP_NORM = 1e-6
_UNIT = 2.0**-24
SLACK = (PIECE + 8) * _UNIT
SHORT_SLACK = 3 * _UNIT
# The most a clipped norm falls below C (relative): the bound's excess over the exact norm,
# (w + 2)u/2 + SLACK at most, and the clip's own product rounded down by up to 2u.
EXCESS = ((PIECE + 2) / 2 + 2) * _UNIT + SLACK
_GROUP = 1024  # pieces summed at once: below torch's threshold for splitting a sum (32,768)


def l2_norms(rows: torch.Tensor) -> torch.Tensor:
    """An upper bound of ‖row‖₂ over the last axis of float32 (or float64) ``rows``, at most
    ``EXCESS`` relative above it: a float64 tensor of shape ``rows.shape[:-1]`` (0-d for a
    vector). A row's bound is the same number alone or among other rows, at any thread count."""
    _check_dtype(rows)
    width = rows.shape[-1]
    if rows.dtype == torch.float64:
        return _fixed_order_sum(rows.square()).sqrt() * (1.0 + SHORT_SLACK)
    if width <= SHORT:
        return torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float64) * (1.0 + SHORT_SLACK)
    whole = width - width % PIECE
    pieces = torch.linalg.vector_norm(rows[..., :whole].unflatten(-1, (-1, PIECE)), dim=-1)
    squares = _fixed_order_sum(pieces.double().square())
    if whole < width:
        squares = squares + torch.linalg.vector_norm(rows[..., whole:], dim=-1).double().square()
    return squares.sqrt() * (1.0 + SLACK)


def segment_l2_norms(vector: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Upper bounds of the norms of consecutive segments (lengths ``sizes``) of a flat float32
    (or float64) ``vector``, as ``l2_norms`` bounds them but in one pass for all the segments
    (a per-layer clip's): squares summed in float64 (an error of d·2⁻⁵³), enlarged by 3u. A
    float64 tensor of ``len(sizes)`` norms."""
    _check_dtype(vector)
    squares = torch.segment_reduce(vector.double().square(), "sum", lengths=sizes)
    return squares.sqrt() * (1.0 + SHORT_SLACK)


def _check_dtype(rows: torch.Tensor) -> None:
    if rows.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"clip norms are bounded for float32 and float64 rows, not {rows.dtype}")


def _fixed_order_sum(values: torch.Tensor) -> torch.Tensor:
    """Σ over the last axis in groups of ``_GROUP``, then over the groups: sums short enough
    that torch runs each one in order on one thread, so a row's sum does not depend on how
    many rows there are or how many threads torch has."""
    count = values.shape[-1]
    if count <= _GROUP:
        return values.sum(-1)
    padded = torch.nn.functional.pad(values, (0, -count % _GROUP))
    return padded.unflatten(-1, (-1, _GROUP)).sum(-1).sum(-1)


def l2_norm(vector: torch.Tensor) -> float:
    """``l2_norms`` of the flattened ``vector``, as a Python float."""
    return float(l2_norms(vector.reshape(-1)))
