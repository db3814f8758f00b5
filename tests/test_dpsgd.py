"""DP-SGD as a local gradient rule: Opacus is the reference for per-example gradients."""

import copy
import math

import pytest
import torch
from opacus import GradSampleModule

from algorithms.dpsgd import DpSgdGradient, auto_method, clipped_sum, per_example_gradients
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, ModelObjective
from models import build_model

MODELS = {
    "logreg": ((40,), 10),
    "mlp_pca60": ((60,), 10),
    "mnist_cnn": ((1, 28, 28), 10),
    "reddi_cnn": ((1, 28, 28), 62),
}


def _batch(shape, classes, size=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, *shape, generator=g), torch.randint(0, classes, (size,), generator=g)


def _opacus_per_example(model, x, y):
    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    loss = torch.nn.functional.cross_entropy(gsm(x), y, reduction="sum")
    loss.backward()
    return torch.cat([p.grad_sample.reshape(len(y), -1) for p in gsm.parameters()], dim=1)


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("method", ["auto", "expanded", "vmap_grad"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_example_gradients_and_clipped_sums_match_opacus(name, method):
    torch.manual_seed(0)
    shape, classes = MODELS[name]
    model = build_model(name, shape, classes)
    for module in model.modules():  # dropout off: the same forward for both (hooks need train)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    layout = ParamLayout.of(model)
    objective = ModelObjective(model, layout)
    x, y = _batch(shape, classes)
    _, _, ours = per_example_gradients(objective, ParamLayout.flatten(model), x, y, method)
    reference = _opacus_per_example(model, x, y)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)
    for offsets in (None, tuple(layout.offsets)):
        torch.testing.assert_close(
            clipped_sum(ours, 0.1, offsets),
            clipped_sum(reference, 0.1, offsets),
            rtol=1e-4,
            atol=1e-6,
        )


def test_clipping_bound_holds_per_example_flat_and_per_tensor():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(50, 30, generator=g) * torch.logspace(-3, 3, 50).unsqueeze(1)
    offsets = (0, 10, 25, 30)
    for c in (1e-3, 0.5, 20.0):
        for j in range(50):  # one example at a time: its clipped row is its contribution
            row = rows[j : j + 1]
            assert float(clipped_sum(row, c).norm()) <= c * (1 + 1e-5)
            per_tensor = clipped_sum(row, c, offsets)
            for start, stop in zip(offsets[:-1], offsets[1:], strict=True):
                assert float(per_tensor[start:stop].norm()) <= c * (1 + 1e-5)
            assert float(per_tensor.norm()) <= c * math.sqrt(3) * (1 + 1e-5)


@pytest.mark.parametrize(
    ("adjacency", "kappa", "factor"),
    [("replace_one", 2.0, 1.0), ("add_remove", 1.0, 1.0), ("replace_one", 2.0, math.sqrt(5 / 40))],
)
def test_per_step_noise_std_is_kappa_c_sigma_over_b(adjacency, kappa, factor):
    """Zero data gradient contribution (x = 0, balanced): G's spread is the noise, κCσ_g/B,
    times f = √(m/C_n) in a simulation of a noise cohort (here 5 clients standing for 40)."""
    model = build_model("logreg", (40,), 10)
    objective = ModelObjective(model, ParamLayout.of(model))
    w = torch.zeros(ParamLayout.of(model).offsets[-1])
    x, y = torch.zeros(10, 40), torch.arange(10)  # every class once: the mean gradient is 0
    rule = DpSgdGradient(0.5, 3.0, adjacency=adjacency, simulation_noise_factor=factor)
    rule = rule.for_round(None, lambda: torch.Generator().manual_seed(2), steps=200)
    draws = torch.stack([rule(objective, w, x, y)[2] for _ in range(200)])
    clean = DpSgdGradient(0.5, 0.0).for_round()(objective, w, x, y)[2]
    noise = (draws - clean).flatten()
    expected = kappa * 0.5 * 3.0 * factor / 10
    assert float(noise.std()) == pytest.approx(expected, rel=0.02)
    assert abs(float(noise.mean())) < 4 * expected / math.sqrt(noise.numel())


def test_batchnorm_is_refused_and_sigma_zero_is_clipped_sgd():
    from algorithms.dpsgd import refuse_batchnorm

    with pytest.raises(ValueError, match="BatchNorm1d.*GroupNorm"):
        refuse_batchnorm(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    # σ = 0, C huge: the trainer takes plain SGD steps (the non-private reduction).
    model = build_model("logreg", (40,), 10)
    objective = ModelObjective(model, ParamLayout.of(model))
    x, y = _batch((40,), 10, size=32)
    w0 = ParamLayout.flatten(model)
    sgd = LocalTrainer(0.1, 8, local_steps=4)
    dp = LocalTrainer(0.1, 8, local_steps=4, gradient=DpSgdGradient(1e9, 0.0))
    a = sgd.train(objective, w0, x, y, torch.Generator().manual_seed(3)).params
    b = dp.train(objective, w0, x, y, torch.Generator().manual_seed(3)).params
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_linear_path_is_for_linear_only_models():
    model = build_model("mnist_cnn", (1, 28, 28), 10)
    objective = ModelObjective(model, ParamLayout.of(model))
    x, y = _batch((1, 28, 28), 10)
    with pytest.raises(ValueError, match="nn.Linear"):
        per_example_gradients(objective, ParamLayout.flatten(model), x, y, "linear")


def test_auto_takes_the_linear_path_then_the_expanded_one_then_vmap_grad():
    """The path ``auto`` takes, by model (``auto_method``, which a host also reads to know
    whether it will take ``torch.func`` gradients)."""
    expected = {"logreg": "linear", "mlp_pca60": "linear", "mnist_cnn": "vmap_grad"}
    for name, path in expected.items():
        model = build_model(name, *MODELS[name])
        assert auto_method(ModelObjective(model, ParamLayout.of(model))) == path, name
    small = torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2)
    )
    small(torch.zeros(1, 1, 5, 5))  # materialise the lazy layer
    assert auto_method(ModelObjective(small, ParamLayout.of(small))) == "expanded"
