"""How a host computes (``Kernels``): the automatic choices, and NHWC convolutions computing
what the NCHW ones do."""

import pytest
import torch
from helpers import small_config

from actors.client_host import ClientHost, Kernels
from actors.kernel_table import TABLE, choose
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, ModelObjective, _nhwc
from algorithms.rng import torch_generator
from cluster.runtime.experiment import kernel_params
from cluster.runtime.store import open_store
from models import MODELS, build_model

CPU, GPU = torch.device("cpu"), torch.device("cuda")


def _model(name: str, shape: tuple[int, ...]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, shape, 10)


def test_auto_reads_the_fixed_table_and_a_setting_overrides_it():
    auto = Kernels()
    assert auto.resolve("logreg", CPU) == choose("logreg", "cpu", "auto", "auto")
    linear, cnn = auto.resolve("logreg", CPU), auto.resolve("mnist_cnn", CPU)
    assert (linear.vectorize, linear.channels_last) == (True, False)  # batched matmuls win
    assert (cnn.vectorize, cnn.channels_last) == (False, True)  # grouped convs lose; NHWC wins
    gpu_cnn, gpu_resnet = auto.resolve("mnist_cnn", GPU), auto.resolve("resnet18_gn", GPU)
    assert (gpu_cnn.vectorize, gpu_cnn.channels_last) == (True, False)  # 7.4-7.8x on an H200
    # On the H200 the vectorised ResNet-18 round was slower (1.91 vs 1.62 s), and NHWC too.
    assert (gpu_resnet.vectorize, gpu_resnet.channels_last) == (False, False)
    assert (cnn.vectorize_from, cnn.channels_last_from) == ("table", "table")
    assert cnn.key == "mnist_cnn/cpu"
    forced = Kernels(vectorize=True, channels_last=False).resolve("resnet18_gn", GPU)
    assert (forced.vectorize, forced.channels_last) == (True, False)
    assert (forced.vectorize_from, forced.channels_last_from) == ("config", "config")
    unknown = auto.resolve("mnist_cnn", torch.device("mps"))
    assert (unknown.vectorize, unknown.channels_last) == (False, False)


def test_the_table_has_a_row_for_every_model_on_both_device_types():
    assert {kind for kind, _ in TABLE} == set(MODELS)
    assert {(kind, device) for kind in MODELS for device in ("cpu", "cuda")} == set(TABLE)


def test_the_choice_is_recorded_as_run_parameters(store_root):
    config = small_config(store_root, "executor.channels_last=true")
    params = kernel_params(config)
    assert params["kernels.vectorize"] == "True" and params["kernels.vectorize_from"] == "table"
    assert params["kernels.channels_last"] == "True"
    assert params["kernels.channels_last_from"] == "config"
    assert params["kernels.table_row"] == f"logreg/cpu: {TABLE['logreg', 'cpu'].evidence}"
    gpu = kernel_params(small_config(store_root, "executor.gpus_per_actor=1"))
    assert gpu["kernels.table_row"].startswith("logreg/cuda")


@pytest.mark.parametrize(
    ("overrides", "fraction"),
    [
        ([], 1.0),  # fedavg's SGD on the logistic regression: vectorised (auto's table row)
        (["executor.vectorize=false"], 0.0),
        # vectorize=true cannot apply to SAM's two gradients a step: one client at a time
        (
            ["algorithm.name=dp_fedsam", "algorithm.clip_norm=1", "algorithm.noise_multiplier=1"]
            + ["executor.vectorize=true"],
            0.0,
        ),
    ],
)
def test_each_round_records_the_fraction_of_clients_trained_together(
    store_root, overrides, fraction
):
    """``kernels.vectorize`` is the setting; the ``vectorized_fraction`` metric is what ran."""
    from cluster.runtime.experiment import run_experiment

    config = small_config(store_root, "rounds=2", *overrides)
    history = run_experiment(config).result.history
    assert [r.metrics["vectorized_fraction"] for r in history] == [fraction] * 2


def test_a_host_applies_the_configured_kernels(store_root):
    config = small_config(store_root)  # the synthetic logistic regression
    assert (config.executor.vectorize, config.executor.channels_last) == ("auto", "auto")
    store, _ = open_store(config)
    host = ClientHost(store.location, config.task, config.build_algorithm(), 0, [0, 1])
    assert host.vectorize is True and host.objective.channels_last is False
    forced = Kernels(vectorize=False, channels_last=True)
    host = ClientHost(store.location, config.task, config.build_algorithm(), 0, [0], kernels=forced)
    assert host.vectorize is False and host.objective.channels_last is True


@pytest.mark.parametrize("channels", [1, 3])
def test_nhwc_views_have_channels_last_strides_and_the_same_values(channels):
    t = torch.randn(4, channels, 6, 5)
    view = _nhwc(t)
    assert view.stride() == (6 * 5 * channels, 1, 5 * channels, channels)
    assert torch.equal(view, t)


def test_channels_last_training_equals_nchw_per_client():
    model = _model("mnist_cnn", (1, 28, 28))
    layout, params = ParamLayout.of(model), ParamLayout.flatten(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)
    trainer = LocalTrainer(lr=0.05, batch_size=16, local_epochs=2, momentum=0.5)
    runs = {
        flag: trainer.train(
            ModelObjective(model, layout, channels_last=flag), params, x, y, torch_generator(0, 1)
        )
        for flag in (False, True)
    }
    assert (runs[True].params - runs[False].params).abs().max() < 1e-5
    assert runs[True].correct == runs[False].correct
    assert runs[True].loss_sum == pytest.approx(runs[False].loss_sum, rel=1e-5)


@pytest.mark.parametrize("channels_last", [False, True])
def test_plain_sgd_steps_tensor_by_tensor_exactly_as_through_the_flat_gradient(channels_last):
    """Plain SGD updates each parameter tensor in place with its own gradient
    (``ModelObjective.sgd_step_``); the general path assembles the flat gradient first
    (forced here by a regularizer that contributes nothing): the same numbers, bit for bit."""
    from algorithms.regularizers import Proximal

    model = _model("mnist_cnn", (1, 28, 28))
    objective = ModelObjective(model, ParamLayout.of(model), channels_last=channels_last)
    params = ParamLayout.flatten(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)
    plain = LocalTrainer(lr=0.05, batch_size=16, local_epochs=2)
    general = LocalTrainer(lr=0.05, batch_size=16, local_epochs=2, regularizers=(Proximal(0),))
    assert plain._plain_sgd(plain.gradient, None) and not general._plain_sgd(general.gradient, None)
    fast, flat = (t.train(objective, params, x, y, torch_generator(0, 1)) for t in (plain, general))
    assert torch.equal(fast.params, flat.params) and not torch.equal(fast.params, params)
    assert (fast.loss_sum, fast.correct, fast.steps) == (flat.loss_sum, flat.correct, flat.steps)
    assert fast.grad_evals == flat.grad_evals == 6


SHAPES = {"mnist_cnn": (1, 28, 28), "resnet10_gn": (3, 32, 32), "reddi_cnn": (1, 28, 28)}


@pytest.mark.parametrize("name", ["logreg", "mnist_cnn", "reddi_cnn", "resnet10_gn"])
def test_parameters_set_in_place_give_functional_calls_numbers(name):
    """A forward with the model's parameters swapped for the flat vector's views
    (``_call_with``, slots found once) equals ``functional_call``'s, values and gradients bit
    for bit, dropout included (the same global seed); the module keeps its own parameters."""
    from torch.func import functional_call

    shape = SHAPES.get(name, (60,))
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    objective = ModelObjective(model, ParamLayout.of(model))
    assert objective._slots is not None
    own = [p for p in model.parameters()]
    flat = ParamLayout.flatten(model).clone() + 0.01
    x = torch.randn(4, *shape)
    results = []
    for forward in (objective.logits, None):
        leaf = flat.detach().requires_grad_(True)
        torch.manual_seed(1)  # dropout's draws
        if forward is None:
            out = functional_call(model, objective.layout.unflatten(leaf), (x,))
        else:
            out = forward(leaf, x)
        (grad,) = torch.autograd.grad(out.square().sum(), leaf)
        results.append((out.detach(), grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert all(p is q for p, q in zip(model.parameters(), own, strict=True))


def test_tied_parameters_fall_back_to_functional_call():
    """One tensor under two names: ``functional_call`` ties the alias, the slots would not."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3, bias=False)
            self.b = torch.nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    model = Tied()
    objective = ModelObjective(model, ParamLayout.of(model))
    assert objective._slots is None
    flat = torch.ones(9)
    assert torch.equal(objective.logits(flat, torch.ones(1, 3)), torch.full((1, 3), 9.0))
