import math

import pytest
import torch

from algorithms.layout import ParamLayout
from algorithms.smoothing import (
    LaplacianSmoothing,
    LaplacianStencil,
    segments_from_offsets,
    smoothing_eigenvalues,
    stencil_step,
)

SIGMAS = (0.1, 0.5, 1.0, 3.0, 25.0)


def _dense_laplacian(d: int) -> torch.Tensor:
    """L from the stencil g_{i-1} - 2 g_i + g_{i+1} (mod d), entries accumulated.

    For d=2 both neighbours are the other entry (L = [[-2, 2], [2, -2]]); for d=1 both are
    the entry itself (L = [[0]]).
    """
    lap = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d):
        lap[i, i] -= 2
        lap[i, (i - 1) % d] += 1
        lap[i, (i + 1) % d] += 1
    return lap


def _dense_smooth(g: torch.Tensor, sigma: float) -> torch.Tensor:
    d = g.shape[-1]
    a = torch.eye(d, dtype=torch.float64) - sigma * _dense_laplacian(d)
    return torch.linalg.solve(a, g)


@pytest.mark.parametrize("d", [1, 2, 3, 50])
@pytest.mark.parametrize("sigma", SIGMAS)
def test_matches_dense_solve(d, sigma):
    gen = torch.Generator().manual_seed(d)
    g = torch.randn(d, generator=gen, dtype=torch.float64)
    out = LaplacianSmoothing(sigma)(g)
    torch.testing.assert_close(out, _dense_smooth(g, sigma), rtol=0, atol=1e-10)


def test_dense_laplacian_edge_cases_and_eigenvalues():
    assert torch.equal(_dense_laplacian(1), torch.zeros(1, 1, dtype=torch.float64))
    assert torch.equal(_dense_laplacian(2), torch.tensor([[-2.0, 2.0], [2.0, -2.0]]).double())
    for d in (1, 2, 3, 50):
        for sigma in SIGMAS:
            a = torch.eye(d, dtype=torch.float64) - sigma * _dense_laplacian(d)
            eig = torch.linalg.eigvalsh(a)
            expected = torch.sort(smoothing_eigenvalues(d, sigma)).values
            torch.testing.assert_close(eig, expected, rtol=1e-12, atol=1e-10)


def test_batched_leading_dims_match_rowwise():
    g = torch.randn(4, 3, 17, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ls = LaplacianSmoothing(0.7)
    out = ls(g)
    for idx in ((0, 0), (3, 2), (1, 1)):
        torch.testing.assert_close(out[idx], _dense_smooth(g[idx], 0.7), rtol=0, atol=1e-10)


@pytest.mark.parametrize("d", [1, 2, 3, 50, 1001])
def test_constant_vector_is_fixed_point(d):
    g = torch.full((d,), -3.25, dtype=torch.float64)
    for sigma in SIGMAS:
        torch.testing.assert_close(LaplacianSmoothing(sigma)(g), g, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sigma", [0.5, 2.0, 10.0])
def test_reduces_white_noise_variance_by_expected_factor(sigma):
    d, n = 64, 4000
    gen = torch.Generator().manual_seed(1234)
    noise = torch.randn(n, d, generator=gen, dtype=torch.float64) * 2.0
    out = LaplacianSmoothing(sigma)(noise)
    # A^-1 is symmetric circulant, so Cov(out) = v·A^-2 and its mean diagonal is v·mean_k λ_k^-2.
    k = torch.arange(d, dtype=torch.float64)
    factor = (1.0 / (1.0 + 2.0 * sigma * (1.0 - torch.cos(2 * math.pi * k / d))) ** 2).mean()
    ratio = out.var() / noise.var()
    assert ratio < 1
    assert ratio.item() == pytest.approx(factor.item(), rel=0.03)
    # contraction on every sample
    assert torch.all(out.norm(dim=-1) <= noise.norm(dim=-1) * (1 + 1e-12))


def test_sigma_zero_is_identity_bit_for_bit():
    g = torch.randn(37, generator=torch.Generator().manual_seed(0))
    g[3] = float("nan")
    g[5] = -0.0
    for scope, segs in (("flat", None), ("tensor", [(0, 10), (10, 27)])):
        out = LaplacianSmoothing(0.0, scope)(g, segs)
        assert out is g
    assert LaplacianSmoothing(0)(g) is g


def test_tensor_scope_equals_smoothing_each_segment():
    gen = torch.Generator().manual_seed(7)
    sizes = [5, 1, 2, 0, 50, 3]
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    segs = segments_from_offsets(offsets)
    assert segs == ((0, 5), (5, 1), (6, 2), (8, 0), (8, 50), (58, 3))
    g = torch.randn(offsets[-1], generator=gen, dtype=torch.float64)
    sigma = 1.5
    out = LaplacianSmoothing(sigma, scope="tensor")(g, segs)
    flat = LaplacianSmoothing(sigma)
    for offset, size in segs:
        piece = g[offset : offset + size]
        torch.testing.assert_close(out[offset : offset + size], flat(piece), rtol=0, atol=0)
        if size:
            expected = _dense_smooth(piece, sigma)
            torch.testing.assert_close(out[offset : offset + size], expected, rtol=0, atol=1e-10)
    # differs from flat smoothing, and flat scope ignores segments
    assert not torch.allclose(out, flat(g))
    assert torch.equal(flat(g, segs), flat(g))


def test_tensor_scope_leaves_uncovered_entries_and_validates_segments():
    g = torch.randn(10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ls = LaplacianSmoothing(2.0, scope="tensor")
    out = ls(g, [(2, 4)])
    assert torch.equal(out[:2], g[:2]) and torch.equal(out[6:], g[6:])
    with pytest.raises(ValueError, match="needs segments"):
        ls(g)
    with pytest.raises(ValueError, match="outside"):
        ls(g, [(8, 3)])
    with pytest.raises(ValueError, match="overlaps"):
        ls(g, [(0, 5), (4, 2)])


def test_float32_dtype_and_shape_preserved():
    g = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    for ls, segs in (
        (LaplacianSmoothing(1.0), None),
        (LaplacianSmoothing(1.0, "tensor"), [(0, 20)]),
    ):
        out = ls(g, segs)
        assert out.dtype == torch.float32 and out.shape == g.shape and out.device == g.device
        torch.testing.assert_close(out.double(), ls(g.double(), segs), rtol=0, atol=1e-6)
    assert LaplacianSmoothing(1.0)(g.half()).dtype == torch.float16


@pytest.mark.parametrize("bad", [-0.1, -1, float("nan"), float("inf"), "1.0", None, True])
def test_bad_sigma_raises(bad):
    with pytest.raises(ValueError, match="sigma"):
        LaplacianSmoothing(bad)


def test_bad_scope_and_input_raise():
    with pytest.raises(ValueError, match="scope"):
        LaplacianSmoothing(1.0, scope="layer")
    with pytest.raises(ValueError, match="floating"):
        LaplacianSmoothing(1.0)(torch.arange(5))
    with pytest.raises(ValueError, match="floating"):
        LaplacianSmoothing(1.0)(torch.tensor(1.0))


# The DP-FedPGN authors' one-step stencil (spec 003 §1c): ``DP_new.py``'s three functions,
# transcribed as the reference the stencil must reproduce.
def _code_1d(update, lam):
    smoothed = update.clone()
    smoothed[1:-1] = update[1:-1] - lam * (2 * update[1:-1] - update[:-2] - update[2:])
    return smoothed


def _code_kernel(update):
    kernel = torch.tensor([[0, 1, 0], [1, -4, 1], [0, 1, 0]], dtype=update.dtype)
    return kernel.unsqueeze(0).unsqueeze(0)


def _code_2d(update, lam):
    laplace = torch.nn.functional.conv2d(update.unsqueeze(0), _code_kernel(update), padding=1)
    return update - lam * laplace.squeeze(0)


def _code_4d(update, lam):
    kernel = _code_kernel(update).expand(update.size(1), 1, 3, 3)
    laplace = torch.nn.functional.conv2d(update, kernel, padding=1, groups=update.size(1))
    return update - lam * laplace


def test_stencil_on_a_vector_by_hand_keeps_both_ends():
    u = torch.tensor([1.0, 4.0, 2.0, 8.0, 3.0], dtype=torch.float64)
    # v_i = u_i + λ(u_{i−1} − 2u_i + u_{i+1}) inside; v_0, v_4 as they were
    expected = torch.tensor([1.0, 2.75, 4.0, 5.25, 3.0], dtype=torch.float64)
    assert torch.equal(stencil_step(u, 0.25), expected)
    for short in (torch.tensor([5.0]), torch.tensor([5.0, -1.0])):  # no interior entry
        assert torch.equal(stencil_step(short, 0.25), short)


def test_stencil_on_a_matrix_by_hand_sharpens_with_zero_padding():
    u = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    # Δ₅u with zeros outside: [[3+2−4, 1+4−8], [1+4−12, 2+3−16]] = [[1, −3], [−7, −11]]
    expected = u - 0.5 * torch.tensor([[1.0, -3.0], [-7.0, -11.0]], dtype=torch.float64)
    assert torch.equal(stencil_step(u, 0.5), expected)
    assert torch.equal(expected, torch.tensor([[0.5, 3.5], [6.5, 9.5]], dtype=torch.float64))
    conv = u.view(1, 1, 2, 2)  # a conv weight: the same step on its kernel slice
    assert torch.equal(stencil_step(conv, 0.5), expected.view(1, 1, 2, 2))
    pointwise = torch.tensor([2.0, -1.0], dtype=torch.float64).view(2, 1, 1, 1)  # 1 × 1 kernels
    assert torch.equal(stencil_step(pointwise, 0.5), 3.0 * pointwise)  # (1 + 4λ)·u
    for other in (torch.tensor(7.0), torch.ones(2, 3, 4)):  # 0-D, 3-D: as they were
        assert torch.equal(stencil_step(other, 0.5), other)


@pytest.mark.parametrize(
    ("shape", "reference"),
    [((7,), _code_1d), ((5, 6), _code_2d), ((4, 3, 3, 3), _code_4d), ((3, 2, 1, 1), _code_4d)],
)
def test_stencil_matches_the_authors_code(shape, reference):
    u = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    torch.testing.assert_close(stencil_step(u, 0.3), reference(u, 0.3), rtol=0, atol=1e-6)


def test_stencil_operator_steps_each_tensor_of_the_bound_model():
    layout = ParamLayout(
        ("conv", "fc", "bias", "other"),
        ((2, 1, 3, 3), (3, 4), (4,), (1, 2, 2)),
        (0, 18, 30, 34, 38),
    )
    g = torch.randn(38, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    stencil = LaplacianStencil(0.2).bind(layout)
    expected = torch.cat(
        [
            _code_4d(g[:18].view(2, 1, 3, 3), 0.2).reshape(-1),
            _code_2d(g[18:30].view(3, 4), 0.2).reshape(-1),
            _code_1d(g[30:34], 0.2),
            g[34:],
        ]
    )
    torch.testing.assert_close(stencil(g), expected, rtol=0, atol=1e-12)
    assert LaplacianStencil(0.0).bind(layout)(g) is g
    with pytest.raises(ValueError, match="bind"):
        LaplacianStencil(0.2)(g)
    with pytest.raises(ValueError, match="38 entries"):
        stencil(g[:-1])
    with pytest.raises(ValueError, match="sigma"):
        LaplacianStencil(-0.1)
