"""The DP-FedPGN authors' code as options (spec 003 §1c): the LESAM descent perturbation and the
one-step Laplacian stencil on the averaged update; the paper's versions stay the defaults."""

import pytest
import torch
from helpers import Quadratic, run_local, small_config

from algorithms.aggregate import PartialAggregate
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, PgnGradient
from algorithms.server import MeanServerRule, ServerContext, ServerState
from algorithms.smoothing import LaplacianSmoothing, LaplacianStencil, stencil_step
from cluster.config import ConfigError

DP = ("algorithm.clip_norm=0.5", "algorithm.noise_multiplier=1.0", "rounds=3")


@pytest.mark.parametrize(("perturbation", "sign"), [("ascent", 1.0), ("descent", -1.0)])
def test_the_perturbation_moves_along_or_against_the_broadcast_direction(perturbation, sign):
    """f(w) = ½‖w‖², so ∇f(w) = w and the gradient a step takes reveals where it was taken.
    With g̃ = ∇f(w₀), ascent evaluates at w₀ + ρ·g̃/‖g̃‖ (uphill: f grows), descent at
    w₀ − ρ·g̃/‖g̃‖ (downhill); β = 1 keeps the step free of the (1 − β)·g̃ mix."""
    d, lr, rho = 4, 0.1, 0.5
    objective = Quadratic(torch.eye(d), torch.zeros(d))
    w0 = torch.tensor([3.0, 0.0, -4.0, 0.0])  # ‖w₀‖ = 5
    gradient = PgnGradient(beta=1.0, rho=rho, perturbation=perturbation)
    trainer = LocalTrainer(lr, batch_size=8, local_steps=1, gradient=gradient)
    x, y = torch.zeros(8, 1), torch.zeros(8, dtype=torch.long)
    w1 = trainer.train(objective, w0, x, y, torch.Generator(), payload={"direction": w0}).params
    point = (w0 - w1) / lr  # = the point the gradient was taken at
    torch.testing.assert_close(point, w0 * (1 + sign * rho / 5))
    assert (point.norm() > w0.norm()) == (perturbation == "ascent")
    start = trainer.train(objective, w0, x, y, torch.Generator(), payload={"direction": None})
    torch.testing.assert_close(start.params, w0 * (1 - lr))  # round 0: no g̃, δ = 0 either way


def _step(rule, params, direction, upload):
    total = PartialAggregate()
    total.add({"delta": upload}, 1.0)
    return rule.step(
        ServerState(params, {"direction": direction}), total, ServerContext(1, 10), False
    )


def test_the_stencil_steps_the_model_and_leaves_the_pseudo_gradient_unsmoothed():
    """The authors' server: x ← x + S(Δ̄), ps_c (g̃) ← −Δ̄/(ηK) from the unsmoothed mean; the
    paper's A⁻¹ smooths both (Alg. 1: g̃ ← A⁻¹g̃, then x ← x − γ·g̃)."""
    layout = ParamLayout(("w", "b"), ((3, 4), (5,)), (0, 12, 17))
    gen = torch.Generator().manual_seed(5)
    params, direction, upload = (torch.randn(17, generator=gen) for _ in range(3))
    scale, beta = 0.5, 0.3
    mean = upload.double() - (1 - beta) * scale * direction.double()  # the drift put back
    stencil = LaplacianStencil(0.2).bind(layout)
    rule = MeanServerRule(smoothing=stencil, direction_scale=scale, drift_beta=beta)
    state = _step(rule, params, direction, upload)
    stepped = torch.cat(
        [stencil_step(mean[:12].view(3, 4), 0.2).reshape(-1), stencil_step(mean[12:], 0.2)]
    )
    torch.testing.assert_close(state.params, (params.double() + stepped).float())
    torch.testing.assert_close(state.extras["direction"], (-mean / scale).float())
    inverse = LaplacianSmoothing(0.2)
    rule = MeanServerRule(smoothing=inverse, direction_scale=scale, drift_beta=beta)
    state = _step(rule, params, direction, upload)
    torch.testing.assert_close(state.extras["direction"], (-inverse(mean) / scale).float())


def test_the_papers_versions_stay_the_defaults(store_root):
    base = small_config(store_root, "algorithm.name=dp_fedpgn_ls", *DP).build_algorithm()
    explicit = small_config(
        store_root,
        "algorithm.name=dp_fedpgn_ls",
        "algorithm.pgn_perturbation=ascent",
        "algorithm.ls_operator=inverse",
        "algorithm.ls_scope=flat",
        *DP,
    ).build_algorithm()
    assert base == explicit
    assert base.trainer.gradient.perturbation == "ascent"
    assert isinstance(base.server.smoothing, LaplacianSmoothing)
    code = small_config(
        store_root,
        "algorithm.name=dp_fedpgn_ls",
        "algorithm.pgn_perturbation=descent",
        "algorithm.ls_operator=stencil",
        *DP,
    ).build_algorithm()
    assert code.trainer.gradient.perturbation == "descent"
    assert isinstance(code.server.smoothing, LaplacianStencil)
    assert code.unaccounted_reason is None and code.mechanism == base.mechanism


def test_the_code_variants_run_with_the_same_epsilon(store_root):
    """Both are DP as the paper's versions are: the descent point is local training before the
    clip and the noise, the stencil post-processes the noisy mean: ε is unchanged."""
    preset = ("algorithm.name=dp_fedpgn_ls", *DP)
    paper = run_local(small_config(store_root, *preset))
    code = run_local(
        small_config(
            store_root,
            *preset,
            "algorithm.pgn_perturbation=descent",
            "algorithm.ls_operator=stencil",
        )
    )
    assert not torch.equal(code.state.params, paper.state.params)
    assert code.history[-1].epsilon == paper.history[-1].epsilon
    assert code.claim.dp_valid and code.history[-1].test_accuracy is not None
    fedavg_ls = ("algorithm.name=dp_fedavg_ls", "algorithm.ls_operator=stencil", *DP)
    assert isinstance(
        small_config(store_root, *fedavg_ls).build_algorithm().server.smoothing, LaplacianStencil
    )


@pytest.mark.parametrize(
    ("sets", "field", "says"),
    [
        (
            (
                "algorithm.name=dp_fedpgn_ls",
                "algorithm.ls_operator=stencil",
                "algorithm.ls_scope=flat",
            ),
            "algorithm.ls_scope",
            "each tensor by its shape",
        ),
        (
            (
                "algorithm.name=dp_fedpgn",
                "algorithm.pgn_perturbation=descent",
                "algorithm.pgn_rho=0",
            ),
            "algorithm.pgn_perturbation",
            "perturbs nothing",
        ),
        (
            ("algorithm.name=dp_fedpgn", "algorithm.ls_operator=stencil"),
            "algorithm.ls_operator",
            "no such option",
        ),
        (
            ("algorithm.name=dp_fedavg_ls", "algorithm.pgn_perturbation=descent"),
            "algorithm.pgn_perturbation",
            "no such option",
        ),
        (
            ("algorithm.name=dp_fedpgn", "algorithm.pgn_perturbation=uphill"),
            "algorithm.pgn_perturbation",
            "one of",
        ),
    ],
)
def test_bad_code_variant_options_are_refused(store_root, sets, field, says):
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *sets, *DP)
    assert error.value.field_path == field and says in str(error.value)
