"""The real MNIST test set (../shared/data/mnist): partition CLI, store, CNN FedAvg learns."""

from pathlib import Path

import numpy as np
import pytest
from helpers import run_local, small_config

from cluster.cli.main import main
from cluster.config import ConfigError
from cluster.runtime.store import open_store
from datasets.store import ShardStore

MNIST_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
pytestmark = pytest.mark.skipif(
    not (MNIST_ROOT / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").exists(),
    reason=f"the real MNIST test set is not at {MNIST_ROOT} (../shared/data absent)",
)


@pytest.fixture(scope="module")
def mnist_store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "mnist-dir0.3"
    args = ["partition", "--dataset", "mnist_test_split", "--root", str(MNIST_ROOT)]
    args += ["--clients", "100", "--method", "dirichlet", "--alpha", "0.3", "--out", str(out)]
    assert main(args) == 0
    return out


def test_partition_cli_writes_the_store_and_its_report(mnist_store, capsys):
    store = ShardStore.open(mnist_store)
    assert store.num_clients == 100 and store.offsets[-1] == 8000
    assert store.manifest["num_test"] == 2000 and store.manifest["x_dtype"] == "uint8"
    assert store.manifest["partition"] == {"method": "dirichlet", "alpha": 0.3}
    assert (store.client_sizes == 80).all()  # the client-prior Dirichlet has equal sizes
    client = store.client(7)
    assert client.x.shape == (80, 1, 28, 28) and client.x.dtype == np.uint8
    assert not client.x.flags.writeable  # zero-copy view of the memory map
    for name in ("class_histogram.png", "client_sizes.png", "partition_summary.json"):
        assert (mnist_store / "report" / name).stat().st_size > 0
    # The same store opens through a pyarrow filesystem URI and reads the same rows.
    by_uri = ShardStore.open(f"file://{mnist_store}")
    np.testing.assert_array_equal(by_uri.client(7).x, client.x)


def _mnist_config(store_root, mnist_store, *overrides):
    """A run on the partitioned real MNIST store."""
    return small_config(
        store_root,
        "task=mnist_cnn",
        "data.source=mnist_test_split",
        f"data.store={mnist_store}",
        "data.num_clients=100",
        "data.partition={method: dirichlet, alpha: 0.3}",
        *overrides,
    )


# 19 s: in the slow tests (the suite's 15-minute budget); the same CNN on the same rows trains in
# CI in tests/test_workloads.py::test_project_and_plain_loop_reach_the_same_weights[A].
@pytest.mark.slow
def test_fedavg_cnn_reaches_90_percent_in_30_rounds(mnist_store, store_root):
    config = _mnist_config(
        store_root,
        mnist_store,
        "cohort.size=10",
        "rounds=30",
        "eval_every=30",
        "algorithm.local.lr=0.05",
        "algorithm.local.momentum=0.9",
        "algorithm.local.batch_size=32",
        "algorithm.local.local_steps=null",
        "algorithm.local.local_epochs=1",
        "executor.cpus_per_actor=2",
    )
    sim = run_local(config)
    assert sim.history[-1].test_accuracy >= 0.90


def test_a_store_that_does_not_match_the_config_is_refused(mnist_store, store_root):
    config = small_config(
        store_root, "task=mnist_cnn", "data.source=mnist_test_split", f"data.store={mnist_store}"
    )
    with pytest.raises(ConfigError, match="data.num_clients=100"):
        open_store(config)


def test_a_missing_data_root_fails_before_any_work_with_the_paths(tmp_path, capsys):
    code = main(
        [
            "run",
            "configs/quickstart.yaml",
            "--set",
            "task=mnist_cnn",
            "--set",
            "data.source=mnist",
            "--set",
            "data.synthetic={}",  # the quickstart's synthetic options, back to the defaults
            "--set",
            f"data.root={tmp_path / 'nowhere'}",
            "--set",
            f"data.store_root={tmp_path / 'shards'}",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nowhere" / "MNIST" / "raw" / "train-images-idx3-ubyte") in err
    assert "torchvision.datasets.MNIST" in err
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())


def test_per_client_test_sets_follow_each_clients_label_mix(mnist_store, store_root):
    store = ShardStore.open(mnist_store)
    sets = store.matched_test_sets(50, seed=0)
    test_y = store.test_rows().y
    counts = store.class_counts()
    for cid in (0, 42, 99):
        got = np.bincount(test_y[sets[cid]], minlength=10)
        assert got.sum() == 50 and len(set(sets[cid].tolist())) == 50
        assert set(np.flatnonzero(got)) <= set(np.flatnonzero(counts[cid]))
        assert np.abs(got - 50 * counts[cid] / counts[cid].sum()).max() < 1  # largest remainder
    config = _mnist_config(store_root, mnist_store, "data.test_per_client=50", "rounds=2")
    record = run_local(config).history[-1]
    assert 0 <= record.metrics["client_test_accuracy"] <= 1
    assert record.metrics["client_test_loss"] > 0 and record.test_accuracy is not None


def test_dp_scaffold_on_pca60_mnist_with_the_papers_label_skew(store_root):
    """DP-SCAFFOLD's MNIST setup shrunk: PCA-60 features of the real images, γ = 0.1 label skew,
    the paper config's preset and options; learns above chance in a few rounds."""
    config = small_config(
        store_root,
        "task=mnist_pca_mlp",
        "data.source=mnist_test_split",
        f"data.root={MNIST_ROOT}",
        "data.pca_components=60",
        "data.num_clients=10",
        "data.partition.method=label_skew",
        "data.partition.iid_fraction=0.1",
        "data.partition.samples_per_client=400",
        "cohort.size=5",
        "rounds=6",
        "algorithm.name=dp_scaffold",
        "algorithm.warm_start=true",
        "algorithm.clip_norm=1.0",
        "algorithm.noise_multiplier=1.0",
        "algorithm.local.lr=1.0",
        "algorithm.local.lr_scaling=inverse_sk",
        "algorithm.local.batch_size=80",
        "algorithm.local.local_steps=5",
    )
    store, _ = open_store(config)
    assert store.manifest["x_shape"] == [60] and store.manifest["x_dtype"] == "float32"
    assert (store.client_sizes == 400).all()
    own = [np.mean(store.client(u).y == u % 10) for u in range(10)]
    assert min(own) >= 0.9
    sim = run_local(config)
    assert len(sim.history) == config.total_rounds == 6 + 8  # ⌈4/l⌉ = 8 warm-up rounds
    assert sim.history[-1].test_accuracy > 0.3  # chance is 0.1
