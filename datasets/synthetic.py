"""The synthetic heterogeneous logistic-regression benchmark of DP-SCAFFOLD (Noble et al. 2022).

Follows ``specs/004_dpscaffold.md`` §4 (FedProx's generator with entrywise u_i and B_i). For each
user i, with N(m, v) meaning mean m and *variance* v:

    U_i ~ N(0, α) (d'×K),  u'_i ~ N(0, α) (K),   W_i = U_i + N(0, 1),  b_i = u'_i + N(0, 1)
    B_i ~ N(0, β) (d'),    v_i = B_i + N(0, 1),   x ~ N(v_i, diag(j^-1.2)),  j = 1..d'
    y = argmax(x W_i + b_i), then with probability ``label_noise`` replaced by a uniform class.

α controls model heterogeneity, β feature heterogeneity; (0, 0) is still non-i.i.d. Features are
then standardised (per feature, over the pooled data) and every row is scaled to unit L2 norm, and
each user's rows are split ``train_fraction`` / rest into train and test.
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


def _standardise_unit_norm(x: np.ndarray) -> np.ndarray:
    """In place (the same operations as out of place, so the same values): at 100,000 users
    the pooled features are 2 GB, and every temporary copy was another 2 GB."""
    std = x.std(axis=0)
    x -= x.mean(axis=0)
    x /= np.where(std > 0, std, 1.0)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x /= np.where(norms > 0, norms, 1.0)
    return x


def generate_synthetic(spec: SyntheticSpec, seed: int) -> tuple[LabeledArrays, LabeledArrays]:
    """Return (train, test); ``group`` holds the generating user of every row."""
    root = np.random.SeedSequence([int(seed), 0x5C4F])
    n = spec.samples_per_user
    x = np.empty((spec.num_users * n, spec.num_features))
    y = np.empty(spec.num_users * n, dtype=np.int64)
    for user, seed_seq in enumerate(root.spawn(spec.num_users)):  # written in place, no parts
        rows = slice(user * n, (user + 1) * n)
        x[rows], y[rows] = _user_samples(spec, np.random.default_rng(seed_seq))
    x = _standardise_unit_norm(x).astype(np.float32)
    users = np.repeat(np.arange(spec.num_users, dtype=np.int64), spec.samples_per_user)

    n_train = int(round(spec.train_fraction * spec.samples_per_user))
    split_rng = np.random.default_rng(root.spawn(1)[0])
    train_mask = np.zeros(len(y), dtype=bool)
    for user in range(spec.num_users):
        rows = user * spec.samples_per_user + split_rng.permutation(spec.samples_per_user)
        train_mask[rows[:n_train]] = True
    pooled = LabeledArrays(x, y, users)
    return pooled.take(np.flatnonzero(train_mask)), pooled.take(np.flatnonzero(~train_mask))
