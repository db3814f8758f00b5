"""The full-scale paper configs run as written, shrunk only in scale (clients, rounds, steps).

Raw files are tiny CIFAR-10 pickles in the exact torchvision layout; everything else — preset,
options, partition (incl. DP-FedPGN's resampling), lr decay, privacy settings, augmentation,
is the config's own (per-client test sets are off: 3 test images cannot fill them).
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_local
from test_vision_sources import emnist_arrays, idx_bytes, patch_cifar_md5, write_cifar

from cluster.claims.calibration import calibrated
from cluster.config import load_config
from cluster.runtime.store import open_store

# The ViT-B/16 configs run in test_transformers.py (a tiny ViT in place of ViT-B/16).
CIFAR_CONFIGS = sorted(
    str(p)
    for p in Path("configs/papers").glob("*.yaml")
    if "cifar" in p.name and "_vit_" not in p.name
)
# The CIFAR-100 ResNet9 run repeats the CIFAR-10 one's code path on 100 classes (30 s): slow.
CASES = [pytest.param(p, marks=pytest.mark.slow) if "cifar100" in p else p for p in CIFAR_CONFIGS]


def _shrunk(path: str, raw: Path, tmp_path: Path, store_root: Path) -> list[str]:
    paper = load_config(path)
    local = paper.algorithm.local
    steps = "local_epochs" if local.local_epochs is not None else "local_steps"
    # Dirichlet draws per client (DP-FedPGN: 500 of 50,000) within the 10 rows written here.
    draws = ["data.partition.samples_per_client=5"] * (
        paper.data.partition.samples_per_client is not None
    )
    return [
        *draws,
        f"data.root={raw}",
        f"data.store_root={store_root}",
        f"checkpoint.dir={tmp_path / 'ck'}",
        "data.num_clients=4",
        "cohort.size=2",
        "rounds=2",
        "eval_every=1",
        "algorithm.local.batch_size=2",
        f"algorithm.local.{steps}=1",
        "executor.kind=local",
        "executor.num_actors=1",
        "executor.gpus_per_actor=0",
        "data.test_per_client=null",  # 3 test images cannot fill per-class test sets
        "tracking.enabled=false",
    ]


@pytest.mark.parametrize("path", CASES, ids=lambda p: Path(p).stem)
def test_cifar_paper_config_runs(path, tmp_path, monkeypatch, store_root):
    assert len(CIFAR_CONFIGS) == 6
    raw, source = tmp_path / "raw", load_config(path).data.source
    write_cifar(raw, source, np.random.default_rng(0))
    patch_cifar_md5(monkeypatch, source, raw)
    config = calibrated(load_config(path, _shrunk(path, raw, tmp_path, store_root)))
    sim = run_local(config)
    assert len(sim.history) == 2 and torch.isfinite(sim.state.params).all()
    assert all(r.test_accuracy is not None for r in sim.history)
    assert sim.history[-1].epsilon is not None and sim.history[-1].epsilon > 0
    local = config.algorithm.local
    lrs = [r.metrics["local_lr"] for r in sim.history]
    assert lrs == pytest.approx([local.lr, local.lr * local.lr_decay])


def test_dpfedsam_emnist_config_runs_on_a_seeded_fifth_of_the_training_split(tmp_path, store_root):
    """Tiny EMNIST byclass IDX files in torchvision's raw layout; the config's 20% subsample
    and the authors' crop and flips (emnist_cnn_crop_flips), shrunk only in scale."""
    path = "configs/papers/dpfedsam_emnist_dir0.6.yaml"
    raw = tmp_path / "raw"
    (raw / "EMNIST" / "raw").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for part, n in (("train", 200), ("test", 10)):
        images, labels = emnist_arrays(rng, "byclass", n)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"emnist-byclass-{part}-{kind}-ubyte"
            (raw / "EMNIST" / "raw" / name).write_bytes(idx_bytes(array))
    shrunk = [*_shrunk(path, raw, tmp_path, store_root), "data.partition.min_size=1"]
    shrunk.append("algorithm.local.batch_size=10")  # one or two steps per client
    config = calibrated(load_config(path, shrunk))
    assert config.task == "emnist_cnn_crop_flips" and config.data.train_subsample_fraction == 0.2
    store, _ = open_store(config)
    assert store.manifest["num_train"] == 40 and store.manifest["num_test"] == 10
    sim = run_local(config)
    assert len(sim.history) == 2 and torch.isfinite(sim.state.params).all()


@pytest.mark.parametrize(
    ("path", "train_rows"),
    [
        ("configs/papers/dpscaffold_femnist_logreg.yaml", 2000),
        ("configs/papers/dpscaffold_mnist_mlp.yaml", 800),
    ],
)
def test_dpscaffold_configs_hold_out_a_fifth_of_each_user_and_set_delta_on_the_rest(
    path, train_rows
):
    """Spec 004 §4: each user's R rows split 80/20, standardised then unit-normed; δ is
    1/(M·R_train) with the training rows that remain after the held-out ones."""
    config = load_config(path)
    d = config.data
    assert d.standardize_unit_norm and d.client_test_fraction == 0.2
    samples = d.partition.samples_per_client
    assert samples - round(d.client_test_fraction * samples) == train_rows
    assert config.privacy.delta == pytest.approx(1 / (d.num_clients * train_rows), rel=1e-4)
