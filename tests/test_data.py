"""Synthetic benchmark, partitioners and the Arrow shard store."""

import json

import numpy as np
import pytest

from datasets import synthetic
from datasets.arrays import LabeledArrays
from datasets.partition import DirichletClientPrior, IIDPartitioner, NaturalPartitioner
from datasets.sources import build_or_open_store
from datasets.synthetic import SyntheticSpec, generate_synthetic

SPEC = {"alpha": 1.0, "beta": 1.0, "num_users": 10, "samples_per_user": 200}


def test_synthetic_rows_are_unit_norm_and_split_80_20_per_user():
    train, test = generate_synthetic(SyntheticSpec(**SPEC), seed=3)
    assert train.x.shape == (10 * 160, 40) and test.x.shape == (10 * 40, 40)
    np.testing.assert_allclose(np.linalg.norm(train.x, axis=1), 1.0, rtol=1e-5)
    assert np.bincount(train.group).tolist() == [160] * 10
    assert np.bincount(test.group).tolist() == [40] * 10
    assert set(np.unique(train.y)) <= set(range(10))
    again, _ = generate_synthetic(SyntheticSpec(**SPEC), seed=3)
    np.testing.assert_array_equal(train.x, again.x)


def whole_pool(spec: SyntheticSpec, seed: int, statistics_from: str):
    """The generator's definition in one piece: every user's rows pooled in float64, each
    feature standardised (``training``: by the pool's mean and std; ``population``: by the
    distribution's, mean 0 and variance β + 1 + j^-1.2), rows scaled to unit norm, float32,
    split per user."""
    root = np.random.SeedSequence([seed, 0x5C4F])
    rows = [
        synthetic._user_samples(spec, np.random.default_rng(s)) for s in root.spawn(spec.num_users)
    ]
    x = np.concatenate([r[0] for r in rows])
    y = np.concatenate([r[1] for r in rows])
    if statistics_from == "training":
        std = x.std(axis=0)
        x = (x - x.mean(axis=0)) / np.where(std > 0, std, 1.0)
    else:
        x = (x - 0.0) / np.sqrt(spec.beta + 1.0 + np.arange(1, x.shape[1] + 1.0) ** -1.2)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    train = synthetic._train_rows(spec, root.spawn(1)[0])
    return (x[train], y[train]), (x[~train], y[~train])


@pytest.mark.parametrize("statistics_from", ["population", "training"])
@pytest.mark.parametrize("kept", [True, False])
def test_generation_in_blocks_equals_the_whole_pool_bit_for_bit(kept, statistics_from, monkeypatch):
    monkeypatch.setattr(synthetic, "CHUNK_USERS", 7)  # blocks of 7 users, the last one short
    monkeypatch.setattr(synthetic, "KEPT_POOL_BYTES", 1 << 40 if kept else 0)
    for spec, seed in [
        (SyntheticSpec(1.0, 1.0, 20, 100), 0),
        (SyntheticSpec(0.0, 0.0, 23, 63), 5),
        (SyntheticSpec(0.5, 2.0, 30, 37, num_features=60, num_classes=5, train_fraction=0.75), 1),
    ]:
        generated = generate_synthetic(spec, seed, statistics_from)
        for got, (x, y) in zip(generated, whole_pool(spec, seed, statistics_from), strict=True):
            assert got.x.dtype == np.float32
            np.testing.assert_array_equal(got.x, x)
            np.testing.assert_array_equal(got.y, y)


def test_population_statistics_are_the_pools_in_distribution_and_move_with_no_record():
    """The generator's own mean and std are what a large pool's converge to, and standardising
    by them makes a row a function of its own draw only: changing one user's rows leaves every
    other user's rows as they were (the pooled statistics move them all)."""
    spec = SyntheticSpec(1.0, 2.0, 400, 500)
    x = np.concatenate(
        [
            synthetic._user_samples(spec, np.random.default_rng(s))[0]
            for s in np.random.SeedSequence(0).spawn(spec.num_users)
        ]
    )
    mean, std = synthetic._population_scaling(spec)
    np.testing.assert_allclose(x.mean(0), mean, atol=0.25)  # the users' means: sd √(3/400)
    np.testing.assert_allclose(x.std(0), std, rtol=0.1)
    small = SyntheticSpec(1.0, 1.0, 5, 50)
    for statistics_from, others_move in (("population", False), ("training", True)):
        base, _ = generate_synthetic(small, 0, statistics_from)
        one_user = iter([np.random.SeedSequence(99)])

        def user_zero_redrawn(spec, rng, original=synthetic._user_samples, one_user=one_user):
            seed = next(one_user, None)  # the first user drawn, user 0, from another seed
            return original(spec, rng if seed is None else np.random.default_rng(seed))

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(synthetic, "_user_samples", user_zero_redrawn)
            patch.setattr(synthetic, "KEPT_POOL_BYTES", 1 << 40)  # one generation pass
            changed, _ = generate_synthetic(small, 0, statistics_from)
        rest = base.group != 0
        assert not np.array_equal(changed.x[~rest], base.x[~rest])
        assert (not np.array_equal(changed.x[rest], base.x[rest])) == others_move


def test_feature_heterogeneity_grows_with_beta():
    def between_user_energy(beta):
        # Rows have unit norm, so this is the share of energy in the per-user feature means.
        train, _ = generate_synthetic(SyntheticSpec(0.0, beta, 20, 500), seed=0)
        means = np.stack([train.x[train.group == u].mean(0) for u in range(20)])
        return (means**2).sum(1).mean()

    assert between_user_energy(0.0) < between_user_energy(1.0) < between_user_energy(5.0)


def test_store_round_trip_is_sorted_zero_copy_and_reused(tmp_path):
    partition = {"method": "natural"}
    options = {**SPEC, "statistics_from": "population"}  # as DataConfig.source_options keys it
    store, built = build_or_open_store(tmp_path, "synthetic", options, partition, 10, seed=1)
    assert built
    manifest = json.loads((store.path / "manifest.json").read_text())
    assert store.client_sizes.tolist() == [160] * 10
    assert manifest["source"]["alpha"] == 1.0 and manifest["seed"] == 1
    assert store.class_counts().sum() == 1600 and store.class_counts().shape == (10, 10)
    assert store.offsets.tolist() == list(range(0, 1601, 160))
    client = store.client(3)
    assert client.x.shape == (160, 40) and not client.x.flags.writeable  # a view of the mmap
    train, _ = generate_synthetic(SyntheticSpec(**SPEC), seed=1)
    np.testing.assert_array_equal(client.x, train.x[train.group == 3])
    store.verify()
    again, built_again = build_or_open_store(tmp_path, "synthetic", options, partition, 10, seed=1)
    assert not built_again and again.path == store.path
    other, built_other = build_or_open_store(tmp_path, "synthetic", options, partition, 10, seed=2)
    assert built_other and other.path != store.path
    # Options without statistics_from are a store of before the option: pooled statistics.
    pooled, built_pooled = build_or_open_store(tmp_path, "synthetic", SPEC, partition, 10, seed=1)
    assert built_pooled and pooled.path != store.path
    train, _ = generate_synthetic(SyntheticSpec(**SPEC), seed=1, statistics_from="training")
    np.testing.assert_array_equal(pooled.client(3).x, train.x[train.group == 3])


def _pooled(n=3000, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return LabeledArrays(np.zeros((n, 2), np.float32), rng.integers(0, classes, n))


@pytest.mark.parametrize("partitioner", [IIDPartitioner(), DirichletClientPrior(0.3)])
def test_partitions_cover_every_row_once_and_are_seeded(partitioner):
    data = _pooled()
    parts = partitioner.split(data, 30, np.random.default_rng(5))
    rows = np.concatenate(parts)
    assert sorted(rows.tolist()) == list(range(len(data)))  # disjoint and complete
    assert {len(p) for p in parts} == {100}  # equal sizes
    again = partitioner.split(data, 30, np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_dirichlet_label_entropy_rises_with_alpha_and_handles_exhausted_classes():
    data = _pooled()

    def mean_entropy(alpha):
        parts = DirichletClientPrior(alpha).split(data, 30, np.random.default_rng(0))
        p = np.stack([np.bincount(data.y[i], minlength=10) for i in parts]) / 100
        return -(p * np.log(np.where(p > 0, p, 1))).sum(1).mean()

    assert mean_entropy(0.1) < mean_entropy(1.0) < mean_entropy(100.0)
    # A skewed pool: one class holds most rows, so priors keep hitting exhausted classes.
    skewed = LabeledArrays(np.zeros((1000, 1)), np.r_[np.zeros(900, int), np.arange(100) % 10])
    parts = DirichletClientPrior(0.05).split(skewed, 10, np.random.default_rng(1))
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))


def test_natural_partition_requires_owners():
    with pytest.raises(ValueError, match="per-row owners"):
        NaturalPartitioner().split(_pooled(), 3, np.random.default_rng(0))
