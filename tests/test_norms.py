"""The norms that decide a clip are upper bounds (``algorithms.norms``): a clipped update's or
record's exact norm is at most C and within 3.5·10⁻⁶ of it, where float32's ``vector_norm`` was 2e-5
off, either way, at the MNIST CNN's 582k coordinates."""

import math

import pytest
import torch

from algorithms.adaptive_clip import AdaptiveClip
from algorithms.dpsgd import clipped_sum
from algorithms.layout import ParamLayout
from algorithms.norms import (
    EXCESS,
    MIN_CLIP_NORM,
    PIECE,
    SHORT,
    l2_norm,
    l2_norms,
    segment_l2_norms,
)
from algorithms.transforms import ClientContext, Clip

D = 582_026  # the MNIST CNN's parameters


def _released_within(norm: float, clip: float) -> bool:
    return clip * (1 - EXCESS) <= norm <= clip


def _update(d: int = D, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Coordinates of very unequal size, as a model's layers have.
    return torch.randn(d, generator=g) * torch.rand(d, generator=g) ** 4


def _exact(vector: torch.Tensor) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for v in vector.double().tolist()))


def test_a_clipped_update_has_norm_at_most_c_and_within_excess_of_it():
    clip = 0.01
    update = _update()
    assert abs(float(torch.linalg.vector_norm(update)) / _exact(update) - 1) > 1e-6  # float32's
    released = Clip(clip).apply(update, ClientContext(torch.Generator(), 1.0))
    assert _released_within(_exact(released), clip)
    # Per layer: each layer's norm is C (every layer is above it here).
    layout = ParamLayout(("a", "b"), ((300_000,), (D - 300_000,)), (0, 300_000, D))
    ctx = ClientContext(torch.Generator(), 1.0, layout=layout)
    per_layer = Clip(clip, scope="layer", num_layers=2).apply(update, ctx)
    for part in (per_layer[:300_000], per_layer[300_000:]):
        assert _released_within(_exact(part), clip)


def test_a_records_clipped_gradient_has_norm_at_most_c_and_within_excess_of_it():
    clip = 0.5
    clipped, within = _update(seed=1), _update(seed=2) * 1e-6
    assert _released_within(_exact(clipped_sum(clipped[None], clip)), clip)
    assert torch.equal(clipped_sum(within[None], clip), within)  # factor 1


def test_norms_are_tight_upper_bounds_a_row_the_same_alone_or_in_a_block():
    rows = torch.stack([_update(D, seed) for seed in range(3)])
    rows[2, : PIECE * 3] = 0.0  # pieces of zeros beside others
    norms = l2_norms(rows)
    assert norms.dtype == torch.float64 and norms.shape == (3,)
    for row, norm in zip(rows, norms, strict=True):
        assert _exact(row) <= float(norm) <= _exact(row) * (1 + EXCESS)
        assert float(norm) == l2_norm(row)  # bit for bit: the batched tail's is the client's
    # Around SHORT (float64 whole below, pieces above) and a row of one piece and a tail.
    for width in (SHORT - 1, SHORT, SHORT + 1, PIECE * 3, PIECE * 3 + 1):
        row = _update(width, width)
        assert _exact(row) <= l2_norm(row) <= _exact(row) * (1 + EXCESS)
    assert l2_norms(rows.view(3, 1, -1)).shape == (3, 1)
    bad = rows.clone()
    bad[1, 5], bad[2, PIECE + 3] = math.nan, math.inf
    assert [math.isfinite(n) for n in l2_norms(bad).tolist()] == [True, False, False]
    assert l2_norm(torch.full((1000,), 3e19)) == math.inf  # its float32 squares overflow
    assert math.isfinite(l2_norm(torch.full((10,), 3e19)))  # a short row: summed in float64


def test_a_long_rows_bound_does_not_depend_on_threads_or_block():
    """torch splits one long float64 sum across threads: a row of 2M coordinates (62,500
    pieces) summed so came out otherwise alone than in a block at 2 threads (a review's
    reproducer); the pieces are summed in a fixed order."""
    rows = torch.stack([_update(2_000_003, seed) for seed in range(3)])
    threads = torch.get_num_threads()
    try:
        seen = []
        for count in (1, 2):
            torch.set_num_threads(count)
            seen.append((l2_norms(rows).tolist(), [l2_norm(row) for row in rows]))
    finally:
        torch.set_num_threads(threads)
    assert seen[0][0] == seen[0][1] == seen[1][0] == seen[1][1]


def test_a_per_layer_clips_segment_norms_are_tight_upper_bounds():
    update, cuts = _update(), (0, 7, 300_007, D)
    segments = list(zip(cuts[:-1], cuts[1:], strict=True))
    bounds = segment_l2_norms(update, torch.tensor([b - a for a, b in segments])).tolist()
    for (a, b), bound in zip(segments, bounds, strict=True):
        assert _exact(update[a:b]) <= bound <= _exact(update[a:b]) * (1 + EXCESS)


def test_half_precision_rows_are_refused_and_float64_rows_bounded():
    with pytest.raises(TypeError, match="bfloat16"):
        l2_norms(torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float16"):
        segment_l2_norms(torch.ones(8, dtype=torch.float16), torch.tensor([8]))
    row = _update(100_003).double()
    assert _exact(row) <= l2_norm(row) <= _exact(row) * (1 + EXCESS)


def test_the_adaptive_clip_never_shrinks_c_below_the_smallest_clip():
    rule = AdaptiveClip(target_quantile=0.5, clip_lr=50.0)
    assert rule.next_clip_norm(2e-6, 5.0, 10.0) == MIN_CLIP_NORM  # every bit 1: shrink e^-25
    assert rule.next_clip_norm(2e-6, -5.0, 10.0) == pytest.approx(2e-6 * math.exp(25))
