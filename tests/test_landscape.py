"""Loss-landscape slices (cluster/analysis/landscape.py; the DP-FedSAM and DP-FedPGN flatness
figures)."""

import json

import numpy as np
import pytest
import torch
from helpers import small_config
from mlflow.tracking import MlflowClient

from actors.client_host import build_model
from algorithms.layout import ParamLayout
from cluster.analysis.landscape import filter_normalized_direction, loss_slice
from cluster.cli.main import main
from cluster.runtime.store import open_store
from datasets.tasks import TASKS
from models.cnn import EmnistCnn


def test_each_filter_of_a_direction_has_the_norm_of_the_models_filter():
    model = EmnistCnn()
    layout, params = ParamLayout.of(model), ParamLayout.flatten(model)
    direction = filter_normalized_direction(layout, params, torch.Generator().manual_seed(4))
    for name, d in layout.unflatten(direction).items():
        theta = layout.unflatten(params)[name]
        if d.dim() == 1:  # biases: not moved (Li et al.'s ignore='biasbn')
            assert torch.equal(d, torch.zeros_like(d))
        else:
            assert torch.allclose(d.flatten(1).norm(dim=1), theta.flatten(1).norm(dim=1))
            assert not torch.allclose(d, theta)  # a random draw, not the model's own filters
    again = filter_normalized_direction(layout, params, torch.Generator().manual_seed(4))
    assert torch.equal(direction, again)


def test_a_convex_models_slice_is_convex_and_centred_on_the_model(store_root):
    """Multinomial logistic regression is convex: along any line the loss has non-negative
    second differences, and the grid's edge averages at least its centre; the centre is the
    model's own loss, and the model's parameters are put back."""
    config = small_config(store_root)
    store, _ = open_store(config)
    model = build_model(store, config.task)
    layout = ParamLayout.of(model)
    params = ParamLayout.flatten(model) + 0.3
    rows = store.train_rows()
    x, y = TASKS[config.task].preprocess(torch.tensor(rows.x)), torch.tensor(rows.y).long()
    generator = torch.Generator().manual_seed(0)
    directions = [filter_normalized_direction(layout, params, generator) for _ in range(2)]
    grid = [-1.0, -0.5, 0.0, 0.5, 1.0]
    line = loss_slice(model, params, directions[:1], grid, x, y)
    assert np.all(np.diff(line.loss, 2) >= -1e-6)
    assert line.sharpness()["edge_loss_increase"] >= 0
    layout.load_into(model, params)
    with torch.no_grad():
        own = float(torch.nn.functional.cross_entropy(model(x), y))
    assert line.center_loss == pytest.approx(own, rel=1e-5)
    surface = loss_slice(model, params, directions, grid, x, y)
    assert surface.loss.shape == (5, 5) and surface.center_loss == pytest.approx(own, rel=1e-5)
    assert np.allclose(surface.loss[:, 2], line.loss)  # β = 0 is the 1-D slice
    assert torch.equal(ParamLayout.flatten(model), params) and model.training


def test_the_cli_slices_a_tracked_checkpoint_and_logs_to_its_run(
    store_root, tmp_path, monkeypatch, capsys, sqlite_store
):
    uri = sqlite_store(tmp_path / "m.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    sets = [
        f"data.store_root={store_root}",
        f"checkpoint.dir={tmp_path}",
        "data.num_clients=20",
        "data.synthetic.samples_per_user=100",
        "cohort.size=5",
        "rounds=3",
        "executor.kind=local",
    ]
    assert main(["run", "configs/quickstart.yaml", *(a for s in sets for a in ("--set", s))]) == 0
    (checkpoint,) = tmp_path.glob("*.pt")
    out = tmp_path / "slice"
    args = ["landscape", str(checkpoint), "--dims", "2", "--steps", "5", "--rows", "300"]
    assert main([*args, "--out", str(out)]) == 0
    record = json.loads((out / "landscape.json").read_text())
    (surface,) = record["slices"]
    assert record["rounds_done"] == 3 and np.array(surface["loss"]).shape == (5, 5)
    assert record["center_loss"] == pytest.approx(surface["loss"][2][2])
    lines = tmp_path / "lines"
    assert (
        main([*args[:2], "--slices", "3", "--steps", "5", "--out", str(lines), "--no-mlflow"]) == 0
    )
    record = json.loads((lines / "landscape.json").read_text())
    rises = [s["edge_loss_increase"] for s in record["slices"]]
    assert len(rises) == 3 and len(set(rises)) == 3  # independent directions
    assert record["edge_loss_increase"] == pytest.approx(np.mean(rises))
    assert record["edge_loss_increase_std"] == pytest.approx(np.std(rises, ddof=1))
    assert (out / "landscape.png").stat().st_size > 0
    artifacts = MlflowClient(uri).list_artifacts(checkpoint.stem, "landscape")
    assert {a.path for a in artifacts} == {"landscape/landscape.json", "landscape/landscape.png"}
    capsys.readouterr()
    assert main(["landscape", str(checkpoint), "--steps", "4"]) == 2
    assert "--steps = 4" in capsys.readouterr().err
    assert main(["landscape", str(checkpoint), "--span", "inf"]) == 2
    assert "--span = inf" in capsys.readouterr().err
    # More rows asked than the split has: the JSON says how many were used.
    whole = tmp_path / "whole"
    assert main([*args[:2], "--steps", "3", "--rows", "10000000", "--out", str(whole)]) == 0
    assert json.loads((whole / "landscape.json").read_text())["rows"] == 20 * 80
    # A checkpoint whose run is in another store: the files are written, the error says how.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other.db'}")
    assert main([*args[:2], "--steps", "3", "--out", str(tmp_path / "elsewhere")]) == 2
    error = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI" in error and "--no-mlflow" in error
    assert (tmp_path / "elsewhere" / "landscape.json").exists()


@pytest.mark.parametrize(
    ("options", "largest"),
    [(["--dims", "2", "--steps", "1000001"], 315), (["--slices", "5", "--steps", "20001"], 19999)],
)
def test_a_grid_of_too_many_evaluations_is_refused_before_the_checkpoint_is_read(
    options, largest, tmp_path, capsys
):
    """Its cost is checked first: the checkpoint named does not even exist."""
    assert main(["landscape", str(tmp_path / "absent.pt"), *options]) == 2
    err = capsys.readouterr().err
    assert "model evaluations, over 100000" in err and f"at most {largest} here" in err
    assert "Traceback" not in err
