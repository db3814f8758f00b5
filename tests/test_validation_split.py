"""``data.validation``: rows or clients held out of training at store level (datasets.validation),
evaluated like the test set, and the accounting that follows the rows that remain."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.claims.privacy_plan import privacy_claim
from cluster.config import ConfigError
from cluster.runtime.executors import LocalExecutor
from cluster.runtime.experiment import run_experiment, validation_tags
from cluster.runtime.store import open_store
from datasets.partition import PartitionError
from datasets.validation import held_out_clients, held_out_rows
from tests.helpers import run_local, small_config


@pytest.mark.parametrize(
    "value, field, fix",
    [
        ("{fraction: 0}", "data.validation.fraction", "must be in (0, 1)"),
        ("{fraction: 1.5}", "data.validation.fraction", "must be in (0, 1)"),
        ("{clients: 1}", "data.validation.clients", "must be in (0, 1)"),
        ("{clients: 0.01}", "data.validation.clients", "holds out round(0.01·20) = 0"),
        ("{fraction: 0.1, clients: 0.1}", "data.validation", "set exactly one of"),
        ("{}", "data.validation", "set exactly one of"),
        ("{folds: 1, fold: 0}", "data.validation.folds", "must be >= 2"),
        ("{folds: 5}", "data.validation.fold", "set both or neither"),
        ("{fraction: 0.1, fold: 1}", "data.validation.fold", "set both or neither"),
        ("{folds: 5, fold: 5}", "data.validation.fold", "must be in [0, 4]"),
        ("{rows: 0.1}", "data.validation.rows", "unknown key"),
    ],
)
def test_bad_validation_options_are_refused_naming_field_value_and_fix(
    store_root, value, field, fix
):
    with pytest.raises(ConfigError) as error:
        small_config(store_root, f"data.validation={value}")
    assert error.value.field_path == field
    assert fix in error.value.fix


def rows_of(arrays) -> list[bytes]:
    """Each row (features and label) as bytes, to compare rows as multisets."""
    return [x.tobytes() + y.tobytes() for x, y in zip(arrays.x, arrays.y, strict=True)]


def test_a_fraction_of_every_clients_rows_is_held_out(store_root):
    base, _ = open_store(small_config(store_root))
    derived, _ = open_store(small_config(store_root, "data.validation={fraction: 0.1}"))
    held = np.floor(0.1 * base.client_sizes + 0.5).astype(int)
    np.testing.assert_array_equal(derived.client_sizes, base.client_sizes - held)
    assert derived.num_validation == held.sum() and derived.num_clients == base.num_clients
    for client in range(base.num_clients):  # each client trains on a subset of its own rows
        assert set(rows_of(derived.client(client))) < set(rows_of(base.client(client)))
    pooled = rows_of(derived.train_rows()) + rows_of(
        derived.held_out_rows("validation", 0, derived.num_validation)
    )
    assert sorted(pooled) == sorted(rows_of(base.train_rows()))
    for split in (base, derived):  # the test set is the base's, row for row
        assert rows_of(split.test_rows()) == rows_of(base.test_rows())
    again, built = open_store(small_config(store_root, "data.validation={fraction: 0.1}"))
    assert not built and again.path == derived.path  # written once, then reused


def test_held_out_rows_are_seeded_and_deterministic():
    sizes = np.array([10, 7, 0, 33])
    spec = {"fraction": 0.3}
    first, again = held_out_rows(sizes, spec, 1), held_out_rows(sizes, spec, 1)
    other = held_out_rows(sizes, spec, 2)
    assert [len(h) for h in first] == [3, 2, 0, 10]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_the_folds_partition_every_clients_rows():
    sizes = np.array([10, 7, 3, 23])
    folds = [held_out_rows(sizes, {"folds": 5, "fold": j}, 4) for j in range(5)]
    for client, size in enumerate(sizes):
        parts = [fold[client] for fold in folds]
        assert sorted(np.concatenate(parts).tolist()) == list(range(size))  # disjoint, all
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_held_out_clients_are_outside_the_training_population(store_root):
    config = small_config(store_root, "data.validation={clients: 0.2}")
    assert config.data.partitioned_clients == 24 and config.accounting_sample_rate == 5 / 20
    base, _ = open_store(small_config(store_root, "data.num_clients=24"))
    derived, _ = open_store(config)
    held = held_out_clients(24, {"clients": 0.2}, 20, config.seed)
    kept = np.setdiff1d(np.arange(24), held)
    assert derived.num_clients == 20 and len(held) == 4
    for new, old in enumerate(kept):  # the training clients' rows, bit for bit
        assert rows_of(derived.client(new)) == rows_of(base.client(int(old)))
    held_rows = [row for c in held for row in rows_of(base.client(int(c)))]
    assert rows_of(derived.held_out_rows("validation", 0, derived.num_validation)) == held_rows
    assert "public" in validation_tags(config.data.validation)["data.validation"]
    private = small_config(store_root, "data.validation={fraction: 0.1}").data.validation
    assert "private" in validation_tags(private)["data.validation"]


@pytest.mark.parametrize(
    "value, field", [("{fraction: 0.5}", "fraction"), ("{folds: 2, fold: 0}", "folds")]
)
def test_a_client_left_without_training_rows_is_refused(store_root, value, field):
    """One training row per client (2 samples, half of them test): holding out half of it
    (round half up) or one of two folds takes all of it."""
    config = small_config(
        store_root,
        "data.synthetic.samples_per_user=2",
        "data.synthetic.train_fraction=0.5",
        f"data.validation={value}",
    )
    with pytest.raises(ConfigError) as error:
        open_store(config)
    assert error.value.field_path == f"data.validation.{field}"
    assert "leaving it none to train on" in str(error.value)
    assert "no validation store was written" in str(error.value)


@pytest.mark.parametrize(
    "spec, fix",
    [
        ({"fraction": 0.01}, "raise data.validation.fraction to at least 1/40 = 0.025"),
        ({"fraction": 1.2e-38}, "raise data.validation.fraction to at least 1/40"),
        ({"folds": 1000000, "fold": 999999}, "lower data.validation.folds to at most 40"),
    ],
)
def test_options_that_hold_out_no_row_are_refused(spec, fix):
    """An empty validation table could not be stored (it failed as it was written)."""
    with pytest.raises(PartitionError, match="nothing is left|holds out no row") as error:
        held_out_rows(np.array([40, 12, 0]), spec, seed=0)
    assert fix in str(error.value)
    assert error.value.field == f"validation.{next(iter(spec))}"


def test_sample_level_accounting_uses_the_training_rows_that_remain(store_root):
    """DP-SCAFFOLD's record rate s = B/n of the smallest client: 16/80 on the whole training
    rows, 16/64 once 20% are held out, and ε grows with it."""
    private = [
        "algorithm.name=dp_scaffold",
        "algorithm.noise_multiplier=2.0",
        "algorithm.clip_norm=1.0",
    ]
    claims = []
    for extra in ([], ["data.validation={fraction: 0.2}"]):
        config = small_config(store_root, *private, *extra)
        store, _ = open_store(config)
        claims.append(privacy_claim(config, config.build_algorithm(), store.client_sizes))
    whole, remaining = claims
    assert whole.data_rate == 16 / 80 and remaining.data_rate == 16 / 64
    assert remaining.epsilon(5) > whole.epsilon(5)


def test_validation_is_evaluated_like_the_test_set(store_root):
    """On the rounds that evaluate (every 2nd and the last), pooled over the hosts' slices:
    the same numbers as one host evaluating every validation row."""
    config = small_config(store_root, "data.validation={fraction: 0.1}", "eval_every=2")
    sim = run_local(config, num_hosts=2)
    evaluated = [r.round for r in sim.history if "validation_accuracy" in r.metrics]
    assert evaluated == [r.round for r in sim.history if r.test_accuracy is not None] == [2, 4, 5]
    store, _ = open_store(config)
    one = LocalExecutor(store, config.task, config.build_algorithm(), config.seed, num_hosts=1)
    try:
        result = one.evaluate(sim.state.params.numpy(), "validation")
    finally:
        one.close()
    assert result.count == store.num_validation
    last = sim.history[-1].metrics
    assert last["validation_accuracy"] == result.correct / result.count
    assert last["validation_loss"] == pytest.approx(result.loss_sum / result.count, rel=1e-6)


def test_outcome_reports_the_final_validation_accuracy(store_root):
    with_validation = run_experiment(small_config(store_root, "data.validation={clients: 0.1}"))
    history = with_validation.result.history
    assert with_validation.final_validation_accuracy == history[-1].metrics["validation_accuracy"]
    without = run_experiment(small_config(store_root))
    assert without.final_validation_accuracy is None
    assert not any("validation_loss" in r.metrics for r in without.result.history)


def test_a_given_store_holds_the_training_and_the_held_out_clients(store_root):
    base, _ = open_store(small_config(store_root, "data.num_clients=24"))
    given = f"data.store={base.path}"
    derived, _ = open_store(small_config(store_root, given, "data.validation={clients: 0.2}"))
    assert derived.num_clients == 20 and derived.num_validation == 4 * 80
    with pytest.raises(ConfigError) as error:  # 20 + 2 held out: not the 24 it holds
        open_store(small_config(store_root, given, "data.validation={clients: 0.1}"))
    assert "(+ 2 held out by data.validation.clients) to 24 in all" in error.value.fix
