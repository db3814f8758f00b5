"""Laplacian smoothing of a noisy model update (DP-FedPGN-LS, DP-FedAvg-LS).

``LaplacianSmoothing``: the papers' A_σ⁻¹ (spec 003 §1a, §7 item 5; refs [28, 29] there:
Osher et al., "Laplacian smoothing gradient descent"; Liang et al. '24), the default.
``LaplacianStencil``: what the DP-FedPGN authors' server runs instead (spec 003 §1c), one
explicit stencil step per tensor on the averaged update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F


def segments_from_offsets(offsets: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(offset, size)`` segments from cumulative offsets, e.g. ``ParamLayout.offsets``."""
    return tuple((a, b - a) for a, b in zip(offsets[:-1], offsets[1:], strict=True))


def smoothing_eigenvalues(d: int, sigma: float, device=None) -> torch.Tensor:
    """Eigenvalues 1 + 2σ(1 − cos(2πk/d)) of A_σ for k = 0..d−1 (float64).

    Written as 1 + 4σ·sin²(πk/d), which has no cancellation for small k.
    """
    k = torch.arange(d, dtype=torch.float64, device=device)
    return 1.0 + 4.0 * sigma * torch.sin(math.pi * k / d) ** 2


def _smooth_last_dim(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """A_σ⁻¹ along the last dim of a float64 tensor, via the real FFT."""
    d = x.shape[-1]
    if d == 0:
        return x.clone()
    # rfft keeps frequencies k = 0..⌊d/2⌋; the eigenvalues are real and symmetric in k ↔ d−k.
    denom = smoothing_eigenvalues(d, sigma, device=x.device)[: d // 2 + 1]
    return torch.fft.irfft(torch.fft.rfft(x, dim=-1) / denom, n=d, dim=-1)


@dataclass(frozen=True)
class LaplacianSmoothing:
    """Laplacian smoothing A_σ⁻¹ = (I − σL)⁻¹ of an update (post-processing: no privacy cost).

    L is the 1-D periodic discrete Laplacian on a length-d vector: the circulant matrix with
    stencil (Lg)_i = g_{i−1} − 2g_i + g_{i+1} (indices mod d), i.e. first column
    c = [−2, 1, 0, …, 0, 1]. For d = 2 both neighbours are the same entry, so
    c = [−2, 2]; for d = 1 they are the entry itself, so L = 0 and A_σ = I.

    A_σ is circulant, so the DFT diagonalises it. Its eigenvalues are

        λ_k = 1 − σ·fft(c)_k = 1 + 2σ(1 − cos(2πk/d)) = 1 + 4σ·sin²(πk/d) ≥ 1,  k = 0..d−1,

    and A_σ⁻¹g = ifft(fft(g) / λ). The transform is computed with ``torch.fft.rfft``/``irfft``
    in float64 in O(d log d). Since every λ_k ≥ 1, A_σ⁻¹ is symmetric positive definite and
    a contraction (‖A_σ⁻¹g‖₂ ≤ ‖g‖₂). It leaves the mean (k = 0, λ_0 = 1) unchanged, so a
    constant vector is a fixed point. It damps frequency k by 1/λ_k, which damps high
    frequencies most. On white noise of variance v the output variance per coordinate is
    v·mean_k λ_k⁻².

    Applied to an already privatised (clipped and noised) update, this is post-processing of
    a DP release. It is data-independent and uses no private data, so it costs no privacy.

    Args:
        sigma: Smoothing strength σ_ls ≥ 0. ``sigma == 0`` is the identity and returns the
            input tensor itself, bit for bit.
        scope: ``"flat"`` smooths the whole flat vector as one periodic signal. Any
            ``segments`` are ignored, so callers may always pass them and let ``scope``
            decide. ``"tensor"`` smooths each ``(offset, size)`` segment on its own, as a
            periodic signal of length ``size``, and needs ``segments``. Entries outside every
            segment are returned unchanged.

    Call:
        ``smoothing(g, segments=None)``. ``g`` is a floating tensor of shape ``(..., d)``.
        Smoothing acts on the last dim, and leading dims are a batch. The result has the
        dtype, device and shape of ``g``. ``segments`` defaults to the bound model's tensors.
    """

    sigma: float
    scope: Literal["flat", "tensor"] = "flat"
    segments: tuple[tuple[int, int], ...] | None = None  # the model's tensors (``bind``)
    # The paper smooths g̃^{r+1} itself (Alg. 1): the pseudo-gradient it broadcasts is smoothed.
    smooths_direction: ClassVar[bool] = True

    def __post_init__(self):
        _check_sigma(self.sigma)
        if self.scope not in ("flat", "tensor"):
            raise ValueError(f"scope must be 'flat' or 'tensor', got {self.scope!r}")

    def bind(self, layout) -> LaplacianSmoothing:
        """The operator with a model's tensors as its segments (``ParamLayout``)."""
        return replace(self, segments=segments_from_offsets(layout.offsets))

    def __call__(
        self, g: torch.Tensor, segments: Sequence[tuple[int, int]] | None = None
    ) -> torch.Tensor:
        if not (g.is_floating_point() and g.dim() >= 1):
            raise ValueError(
                f"g must be a real floating tensor with at least one dim, got {g.dtype} "
                f"of shape {tuple(g.shape)}"
            )
        segments = self.segments if segments is None else segments
        if self.scope == "tensor":
            if segments is None:
                raise ValueError("scope='tensor' needs segments: a list of (offset, size)")
            segments = _checked_segments(segments, g.shape[-1])
        if self.sigma == 0:
            return g
        x = g.to(torch.float64)
        if self.scope == "flat":
            out = _smooth_last_dim(x, self.sigma)
        else:
            out = x.clone()
            for offset, size in segments:
                if size > 0:
                    out[..., offset : offset + size] = _smooth_last_dim(
                        x[..., offset : offset + size], self.sigma
                    )
        return out.to(g.dtype)


def _check_sigma(sigma) -> None:
    if isinstance(sigma, bool) or not (
        isinstance(sigma, int | float) and math.isfinite(sigma) and sigma >= 0
    ):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")


def _checked_segments(segments: Sequence[tuple[int, int]], d: int) -> list[tuple[int, int]]:
    """Check that the segments lie in [0, d) and do not overlap; return them as int pairs."""
    out = [(int(offset), int(size)) for offset, size in segments]
    end = 0
    for offset, size in sorted(out):
        if offset < 0 or size < 0 or offset + size > d:
            raise ValueError(f"segment (offset={offset}, size={size}) is outside [0, {d})")
        if size > 0 and offset < end:
            raise ValueError(f"segment (offset={offset}, size={size}) overlaps another segment")
        end = max(end, offset + size)
    return out


# The 5-point Laplacian Δ₅ of the authors' ``laplacian_smoothing_2d`` / ``_4d``.
_FIVE_POINT = ((0.0, 1.0, 0.0), (1.0, -4.0, 1.0), (0.0, 1.0, 0.0))


def stencil_step(u: torch.Tensor, lam: float) -> torch.Tensor:
    """One explicit stencil step on one tensor ``u``, exactly as the DP-FedPGN authors' server
    (``DP_new.py``: ``laplacian_smoothing``, ``_2d``, ``_4d``) applies it, by ``u.dim()``:

    - 1-D, length n: v_i = u_i + λ(u_{i−1} − 2u_i + u_{i+1}) for 0 < i < n−1; v_0 = u_0 and
      v_{n−1} = u_{n−1} (the ends are kept; n ≤ 2 leaves u as it is). A smoothing step.
    - 2-D (a, b): v = u − λ·Δ₅u on the a × b grid, Δ₅u_{ij} = u_{i−1,j} + u_{i+1,j} +
      u_{i,j−1} + u_{i,j+1} − 4u_{ij} with zeros outside the grid (``conv2d``, padding 1).
    - 4-D (o, c, h, w): the same v = u − λ·Δ₅u on every h × w slice u[o, c] (a 1 × 1 kernel
      becomes (1 + 4λ)·u).
    - any other dim: u unchanged.

    The 2-D/4-D sign is the opposite of the 1-D one: u − λΔ₅u amplifies high frequencies (a
    sharpening step), as in the code. Returns a new tensor of ``u``'s shape and dtype.
    """
    if u.dim() == 1:
        v = u.clone()
        v[1:-1] = u[1:-1] + lam * (u[:-2] - 2 * u[1:-1] + u[2:])
        return v
    if u.dim() not in (2, 4):
        return u.clone()
    kernel = torch.tensor(_FIVE_POINT, dtype=u.dtype, device=u.device).view(1, 1, 3, 3)
    grids = u.reshape(-1, 1, *u.shape[-2:])
    return (grids - lam * F.conv2d(grids, kernel, padding=1)).view(u.shape)


@dataclass(frozen=True)
class LaplacianStencil:
    """The DP-FedPGN authors' "Laplacian smoothing" (spec 003 §1c): ``stencil_step`` with
    λ = ``sigma`` on each tensor of the averaged model update, by the tensor's shape.

    Not A_σ⁻¹ and not a contraction: on 2-D and 4-D tensors the step sharpens (see
    ``stencil_step``). The authors' server applies it to the model update only and keeps its
    pseudo-gradient ps_c (g̃) unsmoothed (``smooths_direction`` False). Applied to the noisy
    mean it is post-processing of a DP release: data-independent, no privacy cost.

    Args:
        sigma: λ ≥ 0 (the code's ``ls_sigma``); 0 is the identity and returns the input tensor.
        shapes: ``(offset, shape)`` of every tensor in the flat vector (``bind``).

    Call:
        ``stencil(g)``, ``g`` a flat floating vector of the bound model's size; the result has
        its dtype and device.
    """

    sigma: float
    shapes: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    smooths_direction: ClassVar[bool] = False

    def __post_init__(self):
        _check_sigma(self.sigma)

    def bind(self, layout) -> LaplacianStencil:
        """The operator for a model's tensors (``ParamLayout``)."""
        return replace(self, shapes=tuple(zip(layout.offsets[:-1], layout.shapes, strict=True)))

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        if self.shapes is None:
            raise ValueError("LaplacianStencil needs the model's tensor shapes: bind(layout)")
        size = sum(math.prod(shape) for _, shape in self.shapes)
        if not (g.is_floating_point() and g.dim() == 1 and g.numel() == size):
            raise ValueError(
                f"g must be a flat floating vector of {size} entries, got {g.dtype} of shape "
                f"{tuple(g.shape)}"
            )
        if self.sigma == 0:
            return g
        out = g.clone()
        for offset, shape in self.shapes:
            piece = slice(offset, offset + math.prod(shape))
            out[piece] = stencil_step(g[piece].view(shape), self.sigma).reshape(-1)
        return out
