"""The norms that decide a clip are upper bounds (``algorithms.norms``): a clipped update's or
record's exact norm is at most C and within 3.4·10⁻⁶ of it, where float32's ``vector_norm`` was 2e-5
off, either way, at the MNIST CNN's 582k coordinates."""

import math

import torch

from algorithms.dpsgd import clipped_sum
from algorithms.layout import ParamLayout
from algorithms.norms import EXCESS, PIECE, l2_norm, l2_norms
from algorithms.transforms import ClientContext, Clip

D = 582_026  # the MNIST CNN's parameters
TIGHT = EXCESS  # how far below C a clipped norm may fall, and above ‖Δ‖ its bound


def _released_within(norm: float, clip: float) -> bool:
    return clip * (1 - TIGHT) <= norm <= clip


def _update(d: int = D, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Coordinates of very unequal size, as a model's layers have.
    return torch.randn(d, generator=g) * torch.rand(d, generator=g) ** 4


def _exact(vector: torch.Tensor) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for v in vector.double().tolist()))


def test_a_clip_releases_norm_c_to_float32_rounding():
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


def test_a_records_clipped_gradient_has_norm_c_to_float32_rounding():
    clip = 0.5
    clipped, within = _update(seed=1), _update(seed=2) * 1e-6
    assert _released_within(_exact(clipped_sum(clipped[None], clip)), clip)
    assert torch.equal(clipped_sum(within[None], clip), within)  # factor 1


def test_norms_are_tight_upper_bounds_a_row_the_same_alone_or_in_a_block():
    rows = torch.stack([_update(width, seed) for seed, width in enumerate((D, D, D))])
    rows[2, : PIECE * 3] = 0.0  # pieces of zeros beside others
    norms = l2_norms(rows)
    assert norms.dtype == torch.float64 and norms.shape == (3,)
    for row, norm in zip(rows, norms, strict=True):
        assert _exact(row) <= float(norm) <= _exact(row) * (1 + TIGHT)
        assert float(norm) == l2_norm(row)  # bit for bit: the batched tail's is the client's
    short = _update(PIECE - 1)  # no whole piece
    assert _exact(short) <= l2_norm(short) <= _exact(short) * (1 + TIGHT)
    assert l2_norms(rows.view(3, 1, -1)).shape == (3, 1)
    bad = rows.clone()
    bad[1, 5], bad[2, PIECE + 3] = math.nan, math.inf
    assert [math.isfinite(n) for n in l2_norms(bad).tolist()] == [True, False, False]
    assert l2_norm(torch.full((10,), 3e19)) == math.inf  # its float32 squares overflow
