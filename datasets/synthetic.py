"""The synthetic heterogeneous logistic-regression benchmark of DP-SCAFFOLD (Noble et al. 2022).

Follows ``specs/004_dpscaffold.md`` §4 (FedProx's generator with entrywise u_i and B_i). For each
user i, with N(m, v) meaning mean m and *variance* v:

    U_i ~ N(0, α) (d'×K),  u'_i ~ N(0, α) (K),   W_i = U_i + N(0, 1),  b_i = u'_i + N(0, 1)
    B_i ~ N(0, β) (d'),    v_i = B_i + N(0, 1),   x ~ N(v_i, diag(j^-1.2)),  j = 1..d'
    y = argmax(x W_i + b_i), then with probability ``label_noise`` replaced by a uniform class.

α controls model heterogeneity, β feature heterogeneity; (0, 0) is still non-i.i.d. Features are
then standardised per feature and every row is scaled to unit L2 norm, and each user's rows are
split ``train_fraction`` / rest into train and test.

The standardisation's statistics (``statistics_from``): ``population`` (the default) takes the
generator's own: x_j = B_j + e_j + s_j·ξ_j with B_j ~ N(0, β) and e_j, ξ_j ~ N(0, 1), so mean 0
and variance β + 1 + j^-1.2, a function of the spec alone, which moves no row when a record
changes; ``training``, the papers' (FedProx's and DP-SCAFFOLD's code), the mean and std of all
users' rows pooled, train and test, where one record moves every other row's features (outside
the DP mechanism: such a run states no ε).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datasets.arrays import LabeledArrays


@dataclass(frozen=True)
class SyntheticSpec:
    alpha: float = 1.0
    beta: float = 1.0
    num_users: int = 100
    samples_per_user: int = 5000
    num_features: int = 40
    num_classes: int = 10
    label_noise: float = 0.05
    train_fraction: float = 0.8


def _user_samples(spec: SyntheticSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    d, k, n = spec.num_features, spec.num_classes, spec.samples_per_user
    model_mean = rng.normal(0.0, np.sqrt(spec.alpha), size=(d, k))
    bias_mean = rng.normal(0.0, np.sqrt(spec.alpha), size=k)
    weights = model_mean + rng.normal(size=(d, k))
    bias = bias_mean + rng.normal(size=k)
    feature_mean = rng.normal(0.0, np.sqrt(spec.beta), size=d) + rng.normal(size=d)
    feature_std = np.arange(1, d + 1, dtype=np.float64) ** (-1.2 / 2)
    x = feature_mean + rng.normal(size=(n, d)) * feature_std
    y = np.argmax(x @ weights + bias, axis=1)
    flip = rng.random(n) < spec.label_noise
    y[flip] = rng.integers(0, k, size=int(flip.sum()))
    return x, y


# Users generated at a time: their rows are one float64 block (≈ 40 MB at 63 × 40).
CHUNK_USERS = 2000
# A float64 pool up to this size is generated once and kept between the passes; a larger one is
# regenerated block by block on each pass (≈ 2.3× the generation time, memory of one block).
KEPT_POOL_BYTES = 1 << 29


def _user_chunks(spec: SyntheticSpec, user_seeds: list[np.random.SeedSequence]):
    """(first row, x, y) of consecutive blocks of users, regenerated on every call (each user's
    rows come from its own SeedSequence, so every pass sees the same values)."""
    n = spec.samples_per_user
    for first in range(0, spec.num_users, CHUNK_USERS):
        seeds = user_seeds[first : first + CHUNK_USERS]
        x = np.empty((len(seeds) * n, spec.num_features))
        y = np.empty(len(seeds) * n, dtype=np.int64)
        for i, seed_seq in enumerate(seeds):
            x[i * n : (i + 1) * n], y[i * n : (i + 1) * n] = _user_samples(
                spec, np.random.default_rng(seed_seq)
            )
        yield first * n, x, y


def _block_source(spec: SyntheticSpec, user_seeds):
    """A function returning an iterator over the blocks, for one pass each."""
    pool_bytes = spec.num_users * spec.samples_per_user * spec.num_features * 8
    if pool_bytes <= KEPT_POOL_BYTES:
        kept = list(_user_chunks(spec, user_seeds))
        return lambda: iter(kept)
    return lambda: _user_chunks(spec, user_seeds)


def _column_sums(blocks) -> np.ndarray:
    """``np.add.reduce(pooled, axis=0)`` of the blocks stacked, bit for bit: NumPy reduces a
    C-ordered array along axis 0 row after row, so carrying the running sum in as the first row
    of the next block keeps the same additions in the same order."""
    total = None
    for block in blocks:
        rows = block if total is None else np.concatenate([total[None], block])
        total = np.add.reduce(rows, axis=0)
    return total


def _feature_scaling(spec: SyntheticSpec, blocks) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) per feature over the pooled rows — ``x.mean(axis=0)`` and ``x.std(axis=0)``
    of the whole float64 pool to the last bit (NumPy's ``_var``: mean = Σx / N, then
    Σ(x − mean)² / N, then √), in two passes over regenerated blocks instead of holding the
    pool (2 GB at 100,000 users) and its centred copy (2 GB more)."""
    count = spec.num_users * spec.samples_per_user
    mean = _column_sums(x for _, x, _ in blocks()) / count

    def squared_deviations():
        for _, x, _ in blocks():
            centred = x - mean
            yield np.multiply(centred, centred, out=centred)

    return mean, np.sqrt(_column_sums(squared_deviations()) / count)


def _population_scaling(spec: SyntheticSpec) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) per feature of the distribution the rows are drawn from (module docstring)."""
    variance = spec.beta + 1.0 + np.arange(1, spec.num_features + 1, dtype=np.float64) ** -1.2
    return np.zeros(spec.num_features), np.sqrt(variance)


def _train_rows(spec: SyntheticSpec, split_seed: np.random.SeedSequence) -> np.ndarray:
    """Which pooled rows are training rows: ``train_fraction`` of each user's, at random."""
    n = spec.samples_per_user
    n_train = int(round(spec.train_fraction * n))
    split_rng = np.random.default_rng(split_seed)
    train_mask = np.zeros(spec.num_users * n, dtype=bool)
    for user in range(spec.num_users):
        rows = user * n + split_rng.permutation(n)
        train_mask[rows[:n_train]] = True
    return train_mask


def generate_synthetic(
    spec: SyntheticSpec, seed: int, statistics_from: str = "population"
) -> tuple[LabeledArrays, LabeledArrays]:
    """Return (train, test); ``group`` holds the generating user of every row.

    One pass over blocks of users writes the standardised unit-norm rows straight into the
    float32 train and test arrays; ``statistics_from: training`` first takes two more (column
    means, then standard deviations), and a pool over ``KEPT_POOL_BYTES`` is regenerated for
    each pass, so the peak memory is the float32 output plus one block. The values are those of
    standardising the whole float64 pool at once (``tests/test_data.py`` compares with that
    computation)."""
    root = np.random.SeedSequence([int(seed), 0x5C4F])
    blocks = _block_source(spec, root.spawn(spec.num_users))
    if statistics_from not in ("population", "training"):
        raise ValueError(f"statistics_from must be population or training: {statistics_from!r}")
    pooled = statistics_from == "training"
    mean, std = _feature_scaling(spec, blocks) if pooled else _population_scaling(spec)
    scale = np.where(std > 0, std, 1.0)
    train_mask = _train_rows(spec, root.spawn(1)[0])
    users = np.repeat(np.arange(spec.num_users, dtype=np.int64), spec.samples_per_user)
    splits = {
        part: LabeledArrays(
            np.empty((int(mask.sum()), spec.num_features), dtype=np.float32),
            np.empty(int(mask.sum()), dtype=np.int64),
            users[mask],
        )
        for part, mask in (("train", train_mask), ("test", ~train_mask))
    }
    filled = {"train": 0, "test": 0}
    for first, x, y in blocks():  # the last pass: blocks are standardised in place
        x -= mean
        x /= scale
        norms = np.linalg.norm(x, axis=1, keepdims=True)  # row by row: blocks change nothing
        x /= np.where(norms > 0, norms, 1.0)
        in_train = train_mask[first : first + len(y)]
        for part, rows in (("train", in_train), ("test", ~in_train)):
            start, stop = filled[part], filled[part] + int(rows.sum())
            splits[part].x[start:stop] = x[rows]  # float64 → float32, as astype
            splits[part].y[start:stop] = y[rows]
            filled[part] = stop
    return splits["train"], splits["test"]
