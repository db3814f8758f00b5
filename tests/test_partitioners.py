"""Partitioners (iid, both Dirichlet variants, shards), matched test sets, partition reports."""

import json
import math

import numpy as np
import pytest

from datasets.arrays import LabeledArrays
from datasets.partition import (
    PARTITION_METHODS,
    DirichletClientPrior,
    DirichletPerClass,
    PartitionError,
    ShardsPartitioner,
    largest_remainder,
    make_partitioner,
    matched_test_split,
)
from datasets.partition_report import (
    class_counts,
    format_summary,
    partition_summary,
    write_partition_report,
)

N, K, M = 5000, 10, 20


def _unbalanced(n=N, classes=K, seed=0):
    """Class c has probability ∝ 0.75^c: class 0 about 27%, class 9 about 2%."""
    rng = np.random.default_rng(seed)
    p = 0.75 ** np.arange(classes)
    y = rng.choice(classes, size=n, p=p / p.sum())
    return LabeledArrays(np.zeros((n, 1), np.float32), y)


DATA = _unbalanced()

PARTITIONERS = {
    "iid": make_partitioner("iid"),
    "dirichlet": make_partitioner("dirichlet", 0.3),
    "dirichlet_class": make_partitioner("dirichlet_class", 0.3, min_size=10),
    "shards": make_partitioner("shards", classes_per_client=2),
}


def _split(partitioner, seed, data=DATA, clients=M):
    return partitioner.split(data, clients, np.random.default_rng(seed))


def _counts(parts, data=DATA):
    return class_counts([data.y[p] for p in parts], K)


@pytest.mark.parametrize("name", PARTITIONERS)
def test_partition_covers_every_row_once_and_is_seeded(name):
    partitioner = PARTITIONERS[name]
    parts = _split(partitioner, 1)
    assert len(parts) == M
    rows = np.concatenate(parts)
    assert sum(len(p) for p in parts) == N
    assert len(np.unique(rows)) == N  # no row repeats, none lost
    assert rows.min() == 0 and rows.max() == N - 1
    assert all(np.issubdtype(p.dtype, np.integer) for p in parts)
    same = _split(partitioner, 1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, same, strict=True))
    other = _split(partitioner, 2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shards"])
@pytest.mark.parametrize("clients", [20, 30, 7])
def test_promised_equal_sizes(name, clients):
    # 5000 rows over 30 or 7 clients do not divide: sizes then differ by one.
    sizes = [len(p) for p in _split(PARTITIONERS[name], 3, clients=clients)]
    assert sum(sizes) == N
    assert max(sizes) - min(sizes) <= 1
    assert min(sizes) == N // clients


def test_dirichlet_class_sizes_are_unequal():
    sizes = [len(p) for p in _split(PARTITIONERS["dirichlet_class"], 1)]
    assert max(sizes) > 2 * min(sizes)


@pytest.mark.parametrize(
    "factory",
    [DirichletClientPrior, lambda a: DirichletPerClass(a, min_size=0)],
    ids=["dirichlet", "dirichlet_class"],
)
def test_label_entropy_rises_with_alpha(factory):
    def entropy(alpha):
        counts = _counts(_split(factory(alpha), 4))
        return partition_summary(counts, K)["label_entropy"]["mean_normalized"]

    assert entropy(0.05) < entropy(0.5) < entropy(50.0)


def test_dirichlet_class_respects_min_size():
    # Without the floor this seed's first draw has a client below 80 rows: the retry is exercised.
    assert min(len(p) for p in _split(DirichletPerClass(0.5, min_size=0), 5)) < 80
    parts = _split(DirichletPerClass(0.5, min_size=80), 5)
    assert min(len(p) for p in parts) >= 80
    assert len(np.unique(np.concatenate(parts))) == N


@pytest.mark.parametrize("name", PARTITIONERS)
def test_more_clients_than_rows_is_refused_naming_num_clients(name):
    """A client without rows could not train (a round used to fail in it)."""
    with pytest.raises(PartitionError, match=r"30 clients but the dataset has 20 rows") as error:
        _split(PARTITIONERS[name], 0, data=_unbalanced(20), clients=30)
    assert error.value.field == "num_clients"


def test_dirichlet_draws_per_client_are_at_most_the_datasets_rows():
    too_many = DirichletClientPrior(0.5, samples_per_client=10**12)
    with pytest.raises(PartitionError, match=r"more than the dataset's 5000 rows") as error:
        _split(too_many, 0)
    assert error.value.field == "partition.samples_per_client"
    assert all(len(p) == N for p in _split(DirichletClientPrior(0.5, N), 0, clients=2))


def test_dirichlet_class_rejects_impossible_min_size_up_front():
    with pytest.raises(ValueError, match=r"min_size=300.*5000"):
        _split(DirichletPerClass(1.0, min_size=300), 0)  # 300 × 20 > 5000


def test_dirichlet_class_gives_up_after_bounded_retries_with_a_useful_message():
    partitioner = DirichletPerClass(0.01, min_size=240, max_retries=5)  # feasible, never drawn
    with pytest.raises(ValueError, match=r"min_size=240") as info:
        _split(partitioner, 0)
    message = str(info.value)
    for fragment in ("α=0.01", "num_clients=20", "5000 rows", "lower min_size", "raise α"):
        assert fragment in message


def test_dirichlet_with_samples_per_client_refills_class_pools():
    """DP-FedPGN's code: 500 draws per client from refilled class pools, rows shared by clients."""
    partitioner = make_partitioner("dirichlet", 0.3, samples_per_client=600)
    parts = _split(partitioner, 4)
    assert [len(p) for p in parts] == [600] * M  # 12,000 draws from 5,000 rows
    rows = np.concatenate(parts)
    assert rows.min() >= 0 and rows.max() < N
    assert len(np.unique(rows)) > 0.9 * N  # pools cycle through their class before repeating
    # A whole pool is used before any row of it is drawn again: per class, draws differ by ≤ 1.
    for c in range(K):
        members = np.flatnonzero(DATA.y == c)
        drawn = np.bincount(rows[DATA.y[rows] == c], minlength=N)[members]
        assert drawn.max() - drawn.min() <= 1
    # No exhausted classes: the client's classes follow its prior, as with α small few classes.
    assert (_counts(parts) > 0).sum(1).mean() < 0.8 * K
    same = _split(partitioner, 4)
    assert all(np.array_equal(a, b) for a, b in zip(parts, same, strict=True))
    described = {"method": "dirichlet", "alpha": 0.3, "samples_per_client": 600}
    assert partitioner.describe() == described
    with pytest.raises(ValueError, match="samples_per_client must be >= 1"):
        make_partitioner("dirichlet", 0.3, samples_per_client=0)


def test_make_partitioner_keeps_old_calls_and_describes_new_methods():
    assert make_partitioner("dirichlet", 0.3) == DirichletClientPrior(0.3)
    assert make_partitioner("dirichlet", alpha=0.3).describe() == {
        "method": "dirichlet",
        "alpha": 0.3,
    }
    assert make_partitioner("dirichlet_class", 0.5, min_size=3).describe() == {
        "method": "dirichlet_class",
        "alpha": 0.5,
        "min_size": 3,
        "max_retries": 100,
    }
    assert make_partitioner("shards", classes_per_client=3).describe() == {
        "method": "shards",
        "classes_per_client": 3,
    }
    assert set(PARTITION_METHODS) == {
        "natural",
        "iid",
        "dirichlet",
        "dirichlet_class",
        "shards",
        "label_skew",
    }
    with pytest.raises(ValueError, match="needs alpha"):
        make_partitioner("dirichlet_class")
    with pytest.raises(ValueError, match="α must be"):
        make_partitioner("dirichlet", 0.0)
    with pytest.raises(ValueError, match="unknown partition method"):
        make_partitioner("pathological")


def test_shards_give_at_most_k_classes_when_shards_do_not_straddle():
    # 10 classes × 100 rows, 20 clients × 2 shards = 40 shards of 25 rows: every class boundary
    # (a multiple of 100) is a shard boundary, so every shard holds a single class.
    data = LabeledArrays(np.zeros((1000, 1)), np.repeat(np.arange(10), 100)[::-1].copy())
    for seed in range(5):
        parts = ShardsPartitioner(2).split(data, 20, np.random.default_rng(seed))
        assert {len(p) for p in parts} == {50}
        classes = [len(np.unique(data.y[p])) for p in parts]
        assert max(classes) <= 2
        assert min(classes) >= 1


def test_shards_straddling_a_class_boundary_can_exceed_k():
    # 4 classes of 25 rows, 2 clients × 1 shard of 50: each shard spans two classes.
    data = LabeledArrays(np.zeros((100, 1)), np.repeat(np.arange(4), 25))
    parts = ShardsPartitioner(1).split(data, 2, np.random.default_rng(0))
    assert sorted(tuple(np.unique(data.y[p])) for p in parts) == [(0, 1), (2, 3)]


def test_shards_reject_more_shards_than_rows():
    with pytest.raises(ValueError, match="classes_per_client"):
        ShardsPartitioner(3).split(_unbalanced(n=50), 20, np.random.default_rng(0))


def test_largest_remainder_by_hand():
    assert largest_remainder(np.array([5, 3, 2]), 7).tolist() == [4, 2, 1]  # 3.5, 2.1, 1.4
    assert largest_remainder(np.array([3, 1, 0]), 10).tolist() == [8, 2, 0]  # tie → lower index
    assert largest_remainder(np.array([1, 1, 1]), 2).tolist() == [1, 1, 0]
    assert largest_remainder(np.array([0, 4]), 9).tolist() == [0, 9]


def test_matched_test_split_follows_each_clients_label_mix():
    test = _unbalanced(n=3000, seed=9)
    counts = _counts(_split(PARTITIONERS["dirichlet_class"], 1))
    per_client = 37
    sets = matched_test_split(test.y, counts, per_client, np.random.default_rng(0))
    assert len(sets) == M
    for row, rows in zip(counts, sets, strict=True):
        got = np.bincount(test.y[rows], minlength=K)
        assert got.tolist() == largest_remainder(row, per_client).tolist()
        # Each class within one row of its exact quota, none for classes the client lacks.
        assert np.all(np.abs(got - per_client * row / row.sum()) < 1)
        assert np.all(got[row == 0] == 0)
        assert len(np.unique(rows)) == per_client  # no repeats within a client
    again = matched_test_split(test.y, counts, per_client, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(sets, again, strict=True))


def test_matched_test_split_exact_counts_by_hand():
    test_y = np.repeat(np.arange(3), 10)
    counts = np.array([[5, 3, 2], [3, 1, 0], [0, 0, 4]])
    sets = matched_test_split(test_y, counts, 7, np.random.default_rng(1))
    got = [np.bincount(test_y[s], minlength=3).tolist() for s in sets]
    assert got == [[4, 2, 1], [5, 2, 0], [0, 0, 7]]  # 5.25,1.75 → 5,2 for the second client


def test_matched_test_split_errors():
    test_y = np.repeat(np.arange(3), 4)
    with pytest.raises(ValueError, match="class 2"):
        matched_test_split(test_y, np.array([[0, 0, 1]]), 5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="no training rows"):
        matched_test_split(test_y, np.array([[1, 0, 0], [0, 0, 0]]), 2, np.random.default_rng(0))


def test_partition_summary_by_hand():
    counts = np.array([[2, 0], [1, 1], [0, 0]])
    summary = partition_summary(counts, 2)
    assert summary["total_rows"] == 4
    assert summary["num_clients"] == 3 and summary["empty_clients"] == 1
    assert summary["sizes"] == {"min": 0, "median": 2.0, "max": 2, "mean": 4 / 3}
    assert summary["classes_per_client"] == {"mean": 1.0, "min": 0, "max": 2}
    entropy = summary["label_entropy"]
    assert entropy["mean_nats"] == pytest.approx(math.log(2) / 2)
    assert entropy["mean_normalized"] == pytest.approx(0.5)
    labels = [np.array([0, 0]), np.array([1, 0]), np.array([], dtype=int)]
    assert partition_summary(labels, 2) == summary
    text = format_summary(summary)
    assert "3 clients" in text and "4 rows" in text and "empty clients: 1" in text


@pytest.mark.parametrize("clients", [20, 150])
def test_report_files_and_json(tmp_path, clients):
    parts = _split(DirichletPerClass(0.3, min_size=0), 1, clients=clients)
    counts = _counts(parts)
    paths = write_partition_report(counts, tmp_path / "report")
    names = sorted(p.name for p in paths)
    assert names == ["class_histogram.png", "client_sizes.png", "partition_summary.json"]
    for path in paths:
        assert path.exists() and path.stat().st_size > 0
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((tmp_path / "report" / "partition_summary.json").read_text())
    assert written == partition_summary(counts, K)
    assert written["total_rows"] == N and written["num_clients"] == clients


@pytest.mark.parametrize("gamma", [0.0, 0.1, 1.0])
def test_label_skew_gives_each_user_its_label_plus_an_iid_fraction(gamma):
    data = LabeledArrays(np.zeros((3000, 1)), np.repeat(np.arange(10), 300))
    parts = make_partitioner("label_skew", iid_fraction=gamma, samples_per_client=100).split(
        data, 20, np.random.default_rng(0)
    )
    rows = np.concatenate(parts)
    assert len(rows) == len(set(rows.tolist())) == 2000 and all(len(p) == 100 for p in parts)
    own = [np.mean(data.y[p] == u % 10) for u, p in enumerate(parts)]
    # (1 − γ)·n rows of label u mod K, the γ·n i.i.d. rows hit it with probability 1/10.
    assert min(own) >= 1 - gamma and np.mean(own) == pytest.approx(1 - 0.9 * gamma, abs=0.03)
    with pytest.raises(ValueError, match="lower samples_per_client"):  # 2 users × 250 > 300
        make_partitioner("label_skew", iid_fraction=0.0, samples_per_client=250).split(
            data, 12, np.random.default_rng(0)
        )
