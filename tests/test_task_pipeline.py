"""Raw files in their exact on-disk format → partition CLI → store → a run of the paper task.

The same code path as real data: CIFAR-10 pickle batches (ResNet9 with augmentation) and TFF's
federated-EMNIST HDF5 (natural partition by writer, Reddi et al.'s CNN with dropout).
"""

import shlex

import numpy as np
from helpers import run_local, small_config
from test_vision_sources import femnist_writers, patch_cifar_md5, write_cifar, write_femnist_file

from cluster.cli.main import main
from datasets.store import ShardStore


def _partition(tmp_path, dataset, root, clients, method, capsys):
    """(the store ``partition`` wrote, the ``--set`` settings it says a run uses it with)."""
    out = tmp_path / f"{dataset}-store"
    args = ["partition", "--dataset", dataset, "--root", str(root), "--clients", str(clients)]
    assert main([*args, "--method", method, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (hint,) = [line for line in printed.splitlines() if "use it with:" in line]
    assert f"\n  on a config of data.source {dataset} (task " in printed  # not the quickstart's
    words = shlex.split(hint.removeprefix("use it with:"))
    assert words[::2] == ["--set"] * (len(words) // 2) and words[1] == f"data.store={out}"
    return out, words[1::2]


def _run(store_root, settings, task, clients, *extra):
    """Two rounds of ``task`` on the store ``settings`` (the partition hint's) name."""
    config = small_config(
        store_root,
        f"task={task}",
        *settings,
        f"cohort.size={clients}",
        "rounds=2",
        "algorithm.local.local_steps=2",
        "algorithm.local.batch_size=2",
        *extra,
    )
    return run_local(config)


def test_cifar10_resnet9_runs_from_pickle_batches(tmp_path, monkeypatch, capsys, store_root):
    write_cifar(tmp_path / "raw", "cifar10", np.random.default_rng(0))
    patch_cifar_md5(monkeypatch, "cifar10", tmp_path / "raw")
    store, settings = _partition(tmp_path, "cifar10", tmp_path / "raw", 2, "iid", capsys)
    assert ShardStore.open(store).client(0).x.shape == (5, 3, 32, 32)
    first = _run(store_root, settings, "cifar10_resnet9", 2)
    again = _run(store_root, settings, "cifar10_resnet9", 2)
    assert first.history[-1].test_accuracy is not None
    # Augmentation is seeded per (round, client): the run is reproducible bit for bit.
    assert np.array_equal(first.state.params.numpy(), again.state.params.numpy())


def test_femnist_natural_partition_by_writer_runs(tmp_path, capsys, store_root):
    rng = np.random.default_rng(1)
    writers = {"f0000_14": 4, "f0001_41": 6, "f0002_11": 5}
    train = femnist_writers(rng, writers, 62)
    write_femnist_file(tmp_path / "fed_emnist_train.h5", train)
    write_femnist_file(tmp_path / "fed_emnist_test.h5", femnist_writers(rng, writers, 62))
    store, settings = _partition(tmp_path, "femnist", tmp_path, 3, "natural", capsys)
    opened = ShardStore.open(store)
    assert opened.client_sizes.tolist() == [4, 6, 5]  # client i is writer i (sorted ids)
    np.testing.assert_array_equal(opened.client(1).y, train["f0001_41"][1])
    first = _run(store_root, settings, "femnist_cnn", 3)
    again = _run(store_root, settings, "femnist_cnn", 3)
    # Dropout draws from torch's global RNG, which each client round seeds: reproducible.
    assert np.array_equal(first.state.params.numpy(), again.state.params.numpy())


def test_the_partition_hint_names_the_source_options_the_store_was_built_with():
    from cluster.cli.partition import _store_settings
    from cluster.config import DataConfig

    def hint(**data) -> list[str]:
        return shlex.split(_store_settings("out", DataConfig(**data), 10))[1::2]

    assert "data.split=letters" in hint(source="emnist", split="letters")
    assert "data.only_digits=true" in hint(source="femnist", only_digits=True)
    assert not [s for s in hint(source="femnist") if s.startswith(("data.split", "data.only"))]
    pasted = shlex.split(_store_settings("my shards/$(touch x)", DataConfig(), 10))
    assert pasted[:2] == ["--set", "data.store=my shards/$(touch x)"]  # one word, not run
