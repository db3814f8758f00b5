"""Count sketch (Charikar et al. 2002) of flat vectors, with hashes shared by seed.

A sketch S ∈ R^{l×m} of x ∈ R^d has, per row j, a bucket hash h_j: [d] → [m] and a sign hash
ξ_j: [d] → {±1}::

    insert     S[j, h_j(i)] += ξ_j(i)·x_i             (linear: S(a + b) = S(a) + S(b))
    estimate   x̂_i = median_j ξ_j(i)·S[j, h_j(i)]      (lower median for an even l)
    top-k      the k estimates of largest |x̂_i|, every other coordinate 0

Hashes: per row, eight integers drawn uniformly from [0, P), P = 2⁶¹ − 1, from
``numpy.random.default_rng(seed)``, the coefficients of two degree-3 polynomials (4-wise
independent families): h_j(i) = ((a₃i³ + a₂i² + a₁i + a₀) mod P) mod m and
ξ_j(i) = 2·((c₃i³ + c₂i² + c₁i + c₀) mod P mod 2) − 1. FetchSGD's CSVec (and spec 002's
suggestion) hashes buckets linearly, ((a·i + b) mod P) mod m; over consecutive indices that is a
lattice, and some draws of a cover a fraction of the buckets: at the paper's size
(d = 6,573,120, m = 500,000) row 3 of seed 42 left 375,872 buckets empty with a load of 73
where 13 are expected, and at d = 20k, m = 2k the worst of the 200 rows of seeds 0–39 left 68%
empty. The cubic's rows load like a random hash's (Poisson: max ≈ 35 at the paper's size, ≈ 22
at 20k/2k). The coefficients must be large: with coefficients below 2³¹ the buckets of nearby
indices collide. Every client and the server derive the same hashes from the seed, so the
server can sketch Δ itself (error feedback).

L2 sensitivity. For one row, ‖S_j(x)‖² = Σ_b (Σ_{i∈b} ξ_j(i)x_i)² ≤ maxload_j·‖x‖² (Cauchy–
Schwarz within each bucket), so ‖S(x)‖_F ≤ √(Σ_j maxload_j)·‖x‖₂, and a unit vector spread with
matching signs over row j's fullest bucket attains maxload_j in that row. A change of one
coordinate by c moves one counter per row by ±c: ‖ΔS‖_F = c·√l exactly, the sensitivity
DPSFL's paper uses, which does not bound a change of a whole clipped vector.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import numpy as np
import torch

MERSENNE_61 = (1 << 61) - 1
# Names the hash family: sketch tables saved under another (a checkpoint's momentum and error
# sketches) index other buckets and cannot be continued.
HASH_FAMILY = "cubic-buckets"
_MASK_31 = (1 << 31) - 1
_MASK_30 = (1 << 30) - 1
_CHUNK = 1 << 20  # coordinates hashed at a time (bounds the uint64 temporaries)


def _mulmod(a: int, x: np.ndarray) -> np.ndarray:
    """(a·x) mod P for a < P and uint64 x < P, without overflowing 64 bits.

    With a = a₁2³¹ + a₀ and x = x₁2³¹ + x₀: a·x = a₁x₁2⁶² + (a₁x₀ + a₀x₁)2³¹ + a₀x₀, and
    2⁶¹ ≡ 1 (mod P) folds the high parts: 2⁶² ≡ 2, and m·2³¹ ≡ m₁ + m₀2³¹ for m = m₁2³⁰ + m₀.
    """
    a1, a0 = np.uint64(a >> 31), np.uint64(a & _MASK_31)
    x1, x0 = x >> np.uint64(31), x & np.uint64(_MASK_31)
    mid = a1 * x0 + a0 * x1  # < 2⁶²
    folded_mid = (mid >> np.uint64(30)) + ((mid & np.uint64(_MASK_30)) << np.uint64(31))
    total = ((a1 * x1) << np.uint64(1)) + folded_mid + a0 * x0  # < 2⁶³
    return total % np.uint64(MERSENNE_61)


def _addmod(x: np.ndarray, b: int) -> np.ndarray:
    return (x + np.uint64(b)) % np.uint64(MERSENNE_61)


def hash_coefficients(rows: int, seed: int) -> np.ndarray:
    """rows × 8 integers uniform in [0, P): a₀..a₃ of the bucket hash, c₀..c₃ of the sign."""
    return np.random.default_rng(seed).integers(0, MERSENNE_61, size=(rows, 8), dtype=np.uint64)


def _cubic_mod_p(coefficients: list[int], i: np.ndarray) -> np.ndarray:
    """(c₃i³ + c₂i² + c₁i + c₀) mod P by Horner: ((c₃i + c₂)i + c₁)i + c₀."""
    c0, c1, c2, c3 = coefficients
    poly = _addmod(_mulmod(c3, i), c2)
    poly = _addmod(_mulmod_vec(poly, i), c1)
    return _addmod(_mulmod_vec(poly, i), c0)


@functools.lru_cache(maxsize=4)
def _host_hashes(dim: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(buckets int32 rows × d, signs int8 rows × d), computed once per process."""
    coefficients = [[int(c) for c in row] for row in hash_coefficients(rows, seed)]
    buckets = np.empty((rows, dim), dtype=np.int32)
    signs = np.empty((rows, dim), dtype=np.int8)
    for start in range(0, dim, _CHUNK):
        i = np.arange(start, min(start + _CHUNK, dim), dtype=np.uint64)
        for j, row in enumerate(coefficients):
            buckets[j, start : start + i.size] = _cubic_mod_p(row[:4], i) % np.uint64(cols)
            sign_bits = (_cubic_mod_p(row[4:], i) & np.uint64(1)).astype(np.int8)
            signs[j, start : start + i.size] = sign_bits * 2 - 1
    return torch.from_numpy(buckets), torch.from_numpy(signs)


def _mulmod_vec(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Elementwise (x·y) mod P for uint64 arrays x < P and y < 2³¹ (coordinate indices)."""
    x1, x0 = x >> np.uint64(31), x & np.uint64(_MASK_31)
    # x·y = x₁y·2³¹ + x₀y; x₁y < 2⁶¹, x₀y < 2⁶²
    high = (x1 * y) % np.uint64(MERSENNE_61)
    folded = (high >> np.uint64(30)) + ((high & np.uint64(_MASK_30)) << np.uint64(31))
    return (folded + x0 * y) % np.uint64(MERSENNE_61)


@functools.lru_cache(maxsize=4)
def _device_hashes(dim, rows, cols, seed, device) -> tuple[torch.Tensor, torch.Tensor]:
    buckets, signs = _host_hashes(dim, rows, cols, seed)
    return buckets.to(device), signs.to(device)


@dataclass(frozen=True)
class CountSketch:
    """An l × m count sketch of R^d vectors (``rows`` = l, ``cols`` = m), hashes from ``seed``.

    Tables are ``rows × cols`` tensors of the input's dtype and device. The hashes are computed
    once per process (and device) and cached outside the object, so a ``CountSketch`` pickles
    as four integers.
    """

    dim: int
    rows: int = 5
    cols: int = 500_000
    seed: int = 42

    def __post_init__(self) -> None:
        for name in ("dim", "rows", "cols"):
            if getattr(self, name) < 1:
                raise ValueError(f"count sketch {name} must be >= 1, got {getattr(self, name)}")
        if self.dim >= 1 << 31:
            raise ValueError(f"count sketch dim must be < 2³¹, got {self.dim}")

    @property
    def size(self) -> int:
        """Counters: l·m."""
        return self.rows * self.cols

    def hashes(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(buckets int32 l × d, signs int8 l × d) on ``device``."""
        return _device_hashes(self.dim, self.rows, self.cols, self.seed, torch.device(device))

    def zeros(self, dtype=torch.float32, device="cpu") -> torch.Tensor:
        return torch.zeros(self.rows, self.cols, dtype=dtype, device=device)

    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """S(x) for a flat x of size d: one ``index_add_`` per row."""
        if x.shape != (self.dim,):
            raise ValueError(f"expected a flat vector of size {self.dim}, got {tuple(x.shape)}")
        return self.accumulate(self.zeros(x.dtype, x.device), x)

    def accumulate(
        self, table: torch.Tensor, values: torch.Tensor, indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``table`` += S(x) in place and returned: x = ``values`` (size d), or with
        ``indices`` the sparse x with x[indices] = values and 0 elsewhere."""
        buckets, signs = self.hashes(table.device)
        if indices is not None:
            buckets, signs = buckets[:, indices], signs[:, indices]
        for j in range(self.rows):
            table[j].index_add_(0, buckets[j], values * signs[j])
        return table

    def counters_of(
        self, indices: torch.Tensor, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The counters coordinates ``indices`` hash to, {(j, h_j(i)) : i ∈ indices, j < l}, as
        (row, column) index tensors into an l × m table."""
        buckets = self.hashes(device)[0][:, indices].long()
        rows = torch.arange(self.rows, device=buckets.device)[:, None].expand_as(buckets)
        return rows, buckets

    def estimates(self, table: torch.Tensor) -> torch.Tensor:
        """x̂: the median over rows of ξ_j(i)·S[j, h_j(i)], for every coordinate i."""
        buckets, signs = self.hashes(table.device)
        per_row = torch.gather(table, 1, buckets.long()) * signs
        return median_over_rows(per_row)

    def top_k(self, table: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of the k estimates of largest magnitude (ties: lowest index)."""
        estimates = self.estimates(table)
        k = min(k, self.dim)
        indices = torch.topk(estimates.abs(), k, sorted=False).indices.sort().values
        return indices, estimates[indices]

    def max_loads(self) -> torch.Tensor:
        """The largest bucket load of every row (coordinates hashed to one counter)."""
        buckets, _ = self.hashes()
        loads = [torch.bincount(row.long(), minlength=self.cols).max() for row in buckets]
        return torch.stack(loads)

    @property
    def l2_sensitivity_factor(self) -> float:
        """√(Σ_j maxload_j): ‖S(x)‖_F ≤ this × ‖x‖₂, attained per row by a vector on that row's
        fullest bucket (an upper bound over all of x)."""
        return _l2_sensitivity_factor(self)

    def adversarial_unit_vector(self, row: int = 0) -> torch.Tensor:
        """Unit x on row ``row``'s fullest bucket with signs ξ_row: ‖S_row(x)‖² = maxload."""
        buckets, signs = self.hashes()
        counts = torch.bincount(buckets[row].long(), minlength=self.cols)
        members = torch.nonzero(buckets[row].long() == int(counts.argmax())).flatten()
        x = torch.zeros(self.dim, dtype=torch.float64)
        x[members] = signs[row, members].double()
        return x / math.sqrt(members.numel())


def _median3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))


def median_over_rows(values: torch.Tensor) -> torch.Tensor:
    """Median of each column of an l × d tensor (the lower one for an even l).

    l = 3 and l = 5 use min/max networks, elementwise and ~10× faster than ``torch.median``
    over a short dimension: of 5, the smaller of two pair minima and the larger of two pair
    maxima cannot be the median, which leaves the median of three."""
    rows = values.shape[0]
    if rows == 1:
        return values[0]
    if rows == 3:
        return _median3(values[0], values[1], values[2])
    if rows == 5:
        a, b, c, d, e = values
        low = torch.maximum(torch.minimum(a, b), torch.minimum(c, d))
        high = torch.minimum(torch.maximum(a, b), torch.maximum(c, d))
        return _median3(low, high, e)
    return values.median(dim=0).values


@functools.lru_cache(maxsize=8)
def _l2_sensitivity_factor(sketch: CountSketch) -> float:
    return math.sqrt(float(sketch.max_loads().sum()))


def rho_from_epsilon(epsilon: float, delta: float) -> float:
    """ρ with ε = ρ + 2√(ρ·ln(1/δ)) (zCDP → (ε, δ)-DP, Bun & Steinke 2016, Prop. 1.3):
    √ρ = √(ln(1/δ) + ε) − √(ln(1/δ))."""
    if not (epsilon > 0 and 0 < delta < 1):
        raise ValueError(f"need ε > 0 and δ in (0, 1), got ε={epsilon}, δ={delta}")
    log_term = math.log(1 / delta)
    return (math.sqrt(log_term + epsilon) - math.sqrt(log_term)) ** 2


SketchSensitivity = Literal["true", "paper"]


@dataclass(frozen=True)
class SketchUpload:
    """Update transform: a client's flat update → its count sketch, flattened (l·m values).

    ``output_bound``: ‖S(x)‖_F ≤ √(Σ_j maxload_j)·‖x‖₂ (``sensitivity="true"``), or DPSFL's
    claim C√l (``"paper"``): the change of a single coordinate, which is not a bound on the
    change of a clipped vector; a mechanism that noises the sketch to that claim is
    unaccounted. The model size ``dim`` is set by ``bind`` from the layout.
    """

    rows: int = 5
    cols: int = 500_000
    seed: int = 42
    sensitivity: SketchSensitivity = "true"
    dim: int | None = None
    selects_by_value: ClassVar[bool] = False
    upload_name: ClassVar[str] = "sketch"

    def __post_init__(self) -> None:
        if self.sensitivity not in ("true", "paper"):
            raise ValueError(f"sketch sensitivity must be true or paper, got {self.sensitivity!r}")

    def bind(self, layout) -> SketchUpload:
        """This upload for the model of ``layout`` (d = its size); warns when l·m > d."""
        bound = replace(self, dim=layout.offsets[-1])
        if bound.rows * bound.cols > bound.dim:
            message = oversized_sketch_message(bound.rows, bound.cols, bound.dim)
            warnings.warn(message, stacklevel=1)  # one location for every caller: shown once
        return bound

    def count_sketch(self, dim: int | None = None) -> CountSketch:
        dim = self.dim if dim is None else dim
        if dim is None:
            raise ValueError("the sketch needs the model's size: call Algorithm.bind")
        return CountSketch(dim, self.rows, self.cols, self.seed)

    def apply(self, update: torch.Tensor, ctx) -> torch.Tensor:
        return self.count_sketch(update.numel()).sketch(update).flatten()

    def output_bound(self, input_bound: float) -> float:
        if self.sensitivity == "paper":
            return input_bound * math.sqrt(self.rows)
        return input_bound * self.count_sketch().l2_sensitivity_factor

    @property
    def unaccounted_reason(self) -> str | None:
        if self.sensitivity == "true":
            return None
        return (
            "noise sized to DPSFL's sketch sensitivity C·√l, which bounds a change of one "
            "coordinate only; a clipped update that changes as a whole moves the sketch by up "
            "to 2C·√(Σ_j maxload_j) in L2"
        )


def oversized_sketch_message(rows: int, cols: int, dim: int) -> str:
    """Why an l × m sketch with l·m > d is a mistake (``SketchUpload.bind`` warns with it once
    per process: Python shows a warning's first occurrence per message and line)."""
    return (
        f"a count sketch of sketch_rows × sketch_cols = {rows} × {cols} = {rows * cols} counters "
        f"has more counters than the model's d = {dim} parameters: it uploads more than the dense "
        f"update, and upload_bytes counts the smaller of its 4·l·m dense bytes and 8 bytes per "
        f"nonzero counter (algorithms.client.upload_bytes); set algorithm.sketch_cols below "
        f"d / sketch_rows = {dim // rows}"
    )


def noise_multiplier_for_rho(rho: float) -> float:
    """z with N(0, (zΔ)²) ρ-zCDP for sensitivity Δ: ρ = Δ²/(2(zΔ)²), z = 1/√(2ρ)."""
    if not rho > 0:
        raise ValueError(f"ρ must be > 0, got {rho}")
    return 1.0 / math.sqrt(2.0 * rho)
