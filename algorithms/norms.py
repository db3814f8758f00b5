"""The L2 norms that decide a clip: an upper bound of the exact norm, within 3.4·10⁻⁶ of it.

torch's float32 ``vector_norm`` sums a row's squares in float32: on random vectors of unequal
coordinates its relative error measured 2.3e-5 at 582k coordinates (the MNIST CNN) and 6.3e-4 at
11M (ResNet-18), either way, so a clip to C by that norm released updates of norm up to
C·(1 + 6e-4): a sensitivity above the one every accountant is given.

Here a row is cut into pieces of ``PIECE`` coordinates, each piece's norm taken in float32 (a
float32 sum of w nonnegative terms, in any order, is within (w − 1)·u of the exact sum, u =
2⁻²⁴; Higham 2002, §4.2: the squares and the root add 3u), and the pieces' squares summed in
float64 (k pieces: k·2⁻⁵³). The sum read is then at most (w + 2)·u below the exact one, the
norm (w + 2)·u/2 (1.0e-6 at w = 32), and scaling it by ``1 + SLACK`` (2.4e-6) makes it an upper
bound of the exact norm with room to spare for the float32 rounding of a clip's own product
(≤ 2u: a float32 factor, each coordinate's product rounded). A clip by this norm releases a
norm ≤ C, exactly, and shrinks an update at most ``EXCESS`` (3.4e-6) below C: what the
diagnostics (``pre_clip_norm``) over-read too. Pieces of 32 cost ≈ 1.7× float32's
``vector_norm`` on a [16, 582k] block at one thread (5.3 against 3.2 ms).

Squares of coordinates below ≈ 1e-19 underflow in float32 (at most d·1.2e-38 lost, far below
C² ≥ 10⁻¹², ``MIN_CLIP_NORM``); a finite row whose float32 piece norm overflows (coordinates
above ≈ 1.8e19) gets norm ∞, as NaN or ±inf in a row gives NaN or ∞.
"""

from __future__ import annotations

import torch

PIECE = 32
_UNIT = 2.0**-24
SLACK = (PIECE + 8) * _UNIT
# The most a bound exceeds the exact norm (relative): its own error above, times 1 + SLACK.
EXCESS = ((PIECE + 2) / 2) * _UNIT + SLACK


def l2_norms(rows: torch.Tensor) -> torch.Tensor:
    """An upper bound of ‖row‖₂ over the last axis, at most ``EXCESS`` relative above it: a
    float64 tensor of shape ``rows.shape[:-1]`` (0-d for a vector). A row's bound is the same
    number alone or among other rows (each piece is its own float32 reduction)."""
    width = rows.shape[-1]
    whole = width - width % PIECE
    squares = torch.zeros(rows.shape[:-1], dtype=torch.float64, device=rows.device)
    if whole:
        pieces = rows[..., :whole].unflatten(-1, (whole // PIECE, PIECE))
        squares = squares + torch.linalg.vector_norm(pieces, dim=-1).double().square().sum(-1)
    if whole < width:
        squares = squares + torch.linalg.vector_norm(rows[..., whole:], dim=-1).double().square()
    return squares.sqrt() * (1.0 + SLACK)


def l2_norm(vector: torch.Tensor) -> float:
    """``l2_norms`` of the flattened ``vector``, as a Python float."""
    return float(l2_norms(vector.reshape(-1)))
