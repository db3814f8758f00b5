"""The papers' data preparation (datasets.preparation): subsample, standardise + unit norm,
per-client held-out test rows; unit tests on small arrays, then a store and a run on the real
MNIST test set (../shared/data/mnist)."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers import run_local, small_config

from cluster.config import ConfigError
from cluster.runtime.store import open_store
from datasets.arrays import LabeledArrays
from datasets.partition import PartitionError
from datasets.preparation import (
    hold_out_client_tests,
    split_preparation,
    standardize_unit_norm,
    subsample_rows,
)

MNIST_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
needs_mnist = pytest.mark.skipif(
    not (MNIST_ROOT / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").exists(),
    reason=f"the real MNIST test set is not at {MNIST_ROOT} (../shared/data absent)",
)


def _rows(n: int, seed: int = 0) -> LabeledArrays:
    rng = np.random.default_rng(seed)
    return LabeledArrays(rng.integers(0, 256, (n, 1, 2, 3), dtype=np.uint8), np.arange(n))


def test_subsample_has_the_rounded_size_is_seeded_and_keeps_the_order():
    data = _rows(1001)
    kept = subsample_rows(data, 0.2, seed=3)
    assert len(kept) == 200  # round(200.2)
    assert np.all(np.diff(kept.y) > 0)  # a subset, in the original order (y is the row index)
    np.testing.assert_array_equal(kept.x, data.x[kept.y])
    np.testing.assert_array_equal(subsample_rows(data, 0.2, seed=3).y, kept.y)
    assert not np.array_equal(subsample_rows(data, 0.2, seed=4).y, kept.y)
    assert len(subsample_rows(data, 1.0, seed=3)) == 1001


def test_standardize_unit_norm_uses_the_training_statistics_then_unit_rows():
    rng = np.random.default_rng(1)
    train = LabeledArrays(rng.normal(3.0, 2.0, (50, 4)), np.zeros(50, dtype=np.int64))
    train.x[:, 2] = 7.0  # a constant feature: only centred, no division by 0
    test = LabeledArrays(rng.normal(0.0, 1.0, (5, 4)), np.zeros(5, dtype=np.int64))
    out_train, out_test = standardize_unit_norm(train, test)
    assert out_train.x.dtype == np.float32 and out_train.x.shape == (50, 4)
    mean, std = train.x.mean(axis=0), train.x.std(axis=0)
    expected = (test.x - mean) / np.where(std > 0, std, 1.0)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(out_test.x, expected, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out_train.x, axis=1), 1.0, rtol=1e-6)
    assert np.all(out_train.x[:, 2] == 0)


def test_standardize_unit_norm_fits_the_source_test_split_where_asked():
    rng = np.random.default_rng(2)
    train = LabeledArrays(rng.normal(3.0, 2.0, (50, 4)), np.zeros(50, dtype=np.int64))
    test = LabeledArrays(rng.normal(-1.0, 0.5, (30, 4)), np.zeros(30, dtype=np.int64))
    out_train, _ = standardize_unit_norm(train, test, "source_test")
    expected = (train.x - test.x.mean(axis=0)) / test.x.std(axis=0)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(out_train.x, expected, rtol=1e-6)
    with pytest.raises(ValueError, match="training or source_test"):
        standardize_unit_norm(train, test, "public")


def test_standardize_unit_norm_keeps_image_shapes():
    train, test = standardize_unit_norm(_rows(20), _rows(4, seed=1))
    assert train.x.shape == (20, 1, 2, 3) and test.x.shape == (4, 1, 2, 3)
    flat = train.x.reshape(20, -1)
    np.testing.assert_allclose(np.linalg.norm(flat, axis=1), 1.0, rtol=1e-6)


def test_held_out_rows_leave_the_training_shards_and_belong_to_their_client():
    data = _rows(100)
    clients = [np.arange(0, 50), np.arange(50, 60), np.arange(60, 100)]
    test, kept = hold_out_client_tests(data, clients, 0.2, seed=0)
    assert [len(k) for k in kept] == [40, 8, 32]
    np.testing.assert_array_equal(np.bincount(test.group), [10, 2, 8])
    for client, rows in enumerate(clients):
        held = test.y[test.group == client]  # y is the row index
        assert set(held) | set(kept[client]) == set(rows)
        assert not set(held) & set(kept[client])
    again, kept_again = hold_out_client_tests(data, clients, 0.2, seed=0)
    np.testing.assert_array_equal(again.y, test.y)
    other, _ = hold_out_client_tests(data, clients, 0.2, seed=1)
    assert not np.array_equal(other.y, test.y)


def test_a_client_left_without_training_rows_or_shared_rows_are_refused():
    with pytest.raises(PartitionError, match="client 1 has 1 rows"):
        hold_out_client_tests(_rows(5), [np.arange(4), np.array([4])], 0.6, seed=0)
    shared = [np.arange(0, 10), np.arange(5, 15)]  # dirichlet's refilled pools repeat rows
    with pytest.raises(PartitionError, match="several clients"):
        hold_out_client_tests(_rows(15), shared, 0.5, seed=0)


def test_fractions_that_keep_no_row_are_refused_with_the_smallest_that_does():
    with pytest.raises(PartitionError, match=r"raise it to at least 1/8 = 0.125") as error:
        subsample_rows(_rows(8), 0.06, seed=0)  # round(0.48) = 0
    assert error.value.field == "train_subsample_fraction"
    clients = [np.arange(0, 4), np.arange(4, 10)]
    with pytest.raises(PartitionError, match=r"the test set would be empty.* 1/6 ") as error:
        hold_out_client_tests(_rows(10), clients, 0.08, seed=0)  # round(0.48) = 0
    assert error.value.field == "client_test_fraction"
    test, _ = hold_out_client_tests(_rows(10), clients, 1 / 6, seed=0)
    assert len(test) == 2  # round(6/6) and round(4/6): one row of each client


def test_unset_options_key_no_store_and_split_off_the_source_options():
    config = small_config("/tmp/unused", "data.source=mnist_test_split", "task=mnist_cnn")
    assert config.data.source_options() == {}
    emnist = small_config("/tmp/unused", "data.source=emnist", "task=emnist_cnn")
    assert emnist.data.source_options() == {"split": "byclass"}
    options = {"split": "balanced", "standardize_unit_norm": True, "client_test_fraction": 0.2}
    own, preparation = split_preparation(options)
    assert own == {"split": "balanced"}
    assert preparation.standardize_unit_norm and preparation.client_test_fraction == 0.2


SYNTHETIC = ["task=synthetic_logreg", "data.source=synthetic"]
MNIST = ["task=mnist_pca_mlp", "data.source=mnist"]
CNN = ["task=mnist_cnn", "data.source=mnist"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (SYNTHETIC + ["data.standardize_unit_norm=true"], "data.standardize_unit_norm"),
        (SYNTHETIC + ["data.client_test_fraction=0.2"], "data.client_test_fraction"),
        (MNIST + ["data.client_test_fraction=1.0"], "data.client_test_fraction"),
        (MNIST + ["data.train_subsample_fraction=0"], "data.train_subsample_fraction"),
        (
            MNIST + ["data.client_test_fraction=0.2", "data.test_per_client=5"],
            "data.test_per_client",
        ),
        (CNN + ["data.statistics_from=training"], "data.statistics_from"),  # nothing fitted
        (
            CNN + ["data.standardize_unit_norm=true", "data.statistics_from=public"],
            "data.statistics_from",
        ),
        (  # the source's test split is the run's test set
            CNN + ["data.standardize_unit_norm=true", "data.statistics_from=source_test"],
            "data.statistics_from",
        ),
    ],
)
def test_bad_preparation_options_are_config_errors(overrides, field):
    with pytest.raises(ConfigError) as error:
        small_config("/tmp/unused", *overrides)
    assert error.value.field_path == field


def _mnist_config(store_root, *overrides: str):
    """DP-SCAFFOLD's MNIST data setting shrunk: 10 label-skewed users of 500 rows, standardised
    and unit-normed, 20% of each user's rows held out."""
    return small_config(
        store_root,
        "data.source=mnist_test_split",
        f"data.root={MNIST_ROOT}",
        "data.standardize_unit_norm=true",
        "data.client_test_fraction=0.2",
        "data.num_clients=10",
        "data.partition.method=label_skew",
        "data.partition.iid_fraction=0.1",
        "data.partition.samples_per_client=500",
        *overrides,
    )


@needs_mnist
def test_held_out_store_rows_are_unit_norm_owned_and_never_trained_on(store_root):
    config = _mnist_config(store_root, "task=mnist_cnn")
    store, _ = open_store(config)
    assert (store.client_sizes == 400).all() and store.manifest["num_test"] == 1000
    assert store.manifest["x_dtype"] == "float32" and store.manifest["x_shape"] == [1, 28, 28]
    train, test = store.train_rows(), store.test_rows()
    np.testing.assert_allclose(np.linalg.norm(train.x.reshape(4000, -1), axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(test.x.reshape(1000, -1), axis=1), 1.0, rtol=1e-5)
    with pa.memory_map(str(store.path / "test.arrow")) as source:  # the owners, as written
        owners = pa.ipc.open_file(source).read_all().column("client_id").to_numpy()
    np.testing.assert_array_equal(np.bincount(owners), [100] * 10)
    trained = {row.tobytes() for row in train.x}
    assert not any(row.tobytes() in trained for row in test.x)  # held-out rows never trained on
    for client in (0, 7):  # each user's test rows come from its own label-skewed rows
        assert np.mean(test.y[owners == client] == client) > 0.7
    # Standardised with the statistics of the source's test split (here images 8000–9999),
    # which the clients' own test rows leave unused: public data.
    assert store.manifest["source"]["statistics_from"] == "source_test"
    assert config.data.statistics_outside_dp is None
    paper = _mnist_config(store_root, "task=mnist_cnn", "data.statistics_from=training")
    paper_store, _ = open_store(paper)
    assert (
        paper_store.path != store.path and "statistics_from" not in paper_store.manifest["source"]
    )
    assert not np.allclose(paper_store.train_rows().x[:5], train.x[:5])
    assert "standardize_unit_norm" in paper.data.statistics_outside_dp


@pytest.mark.slow  # the PCA's SVD and a run: 12 s, up to 60 s on 2 shared cores
@needs_mnist
def test_pca_then_standardise_then_unit_norm_and_a_run_evaluates_the_held_out_rows(store_root):
    config = _mnist_config(store_root, "task=mnist_pca_mlp", "data.pca_components=60", "rounds=2")
    store, _ = open_store(config)
    assert store.manifest["x_shape"] == [60]
    np.testing.assert_allclose(np.linalg.norm(store.train_rows().x, axis=1), 1.0, rtol=1e-5)
    assert config.data.statistics_outside_dp is None  # fitted to the source's test split
    record = run_local(config).history[-1]
    assert 0.0 <= record.test_accuracy <= 1.0 and record.test_loss > 0


@needs_mnist
def test_train_subsample_shrinks_the_partitioned_split_only(store_root):
    config = small_config(
        store_root,
        "task=mnist_cnn",
        "data.source=mnist_test_split",
        f"data.root={MNIST_ROOT}",
        "data.train_subsample_fraction=0.2",
        "data.partition.method=iid",
    )
    store, _ = open_store(config)
    assert store.manifest["num_train"] == 1600 and int(store.client_sizes.sum()) == 1600
    assert store.manifest["num_test"] == 2000
    assert store.manifest["source"]["train_subsample_fraction"] == 0.2
