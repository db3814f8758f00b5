"""DP-FedPGN (spec 003), Laplacian smoothing and server momentum: identities and reductions."""

import pytest
import torch
from helpers import Quadratic, run_local, small_config

from algorithms.aggregate import PartialAggregate
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, PgnGradient
from algorithms.pgn import StripDrift
from algorithms.server import MeanServerRule, ServerContext, ServerState
from algorithms.smoothing import LaplacianSmoothing
from algorithms.transforms import ClientContext

DP = ("algorithm.clip_norm=0.5", "algorithm.noise_multiplier=1.0", "rounds=3")


def test_drift_identities_on_a_quadratic():
    torch.manual_seed(0)
    d, k, lr, beta, rho = 6, 4, 0.1, 0.3, 0.2
    m = torch.randn(d, d)
    objective = Quadratic(m @ m.T / d + torch.eye(d), torch.randn(d))
    x0, direction = torch.randn(d), torch.randn(d)
    trainer = LocalTrainer(lr, batch_size=8, local_steps=k, gradient=PgnGradient(beta, rho))
    payload = {"direction": direction}
    x, y = torch.zeros(8, 1), torch.zeros(8, dtype=torch.long)
    result = trainer.train(objective, x0, x, y, torch.Generator(), payload=payload)
    assert objective.grad_evals == k  # one gradient evaluation per PGN step
    delta_shift = direction * (rho / direction.norm())
    w, perturbed = x0.clone(), []
    for _ in range(k):
        perturbed.append(objective.grad(w + delta_shift))
        w = w - lr * (beta * perturbed[-1] + (1 - beta) * direction)
    ctx = ClientContext(torch.Generator(), 1.0, payload=payload, local_steps=k, lr=lr)
    stripped = StripDrift(beta).apply(result.params - x0, ctx)
    torch.testing.assert_close(stripped, -lr * beta * torch.stack(perturbed).sum(0))
    # Server: the drift back once, x ← x + Δ; g̃ ← −mean/(ηK) = β·ĝ + (1 − β)·g̃ with ĝ the
    # mean perturbed gradient.
    total = PartialAggregate()
    total.add({"delta": stripped}, 1.0)
    rule = MeanServerRule(direction_scale=lr * k, drift_beta=beta)
    state = rule.step(ServerState(x0, {"direction": direction}), total, _server_ctx(1.0), False)
    expected = beta * torch.stack(perturbed).mean(0) + (1 - beta) * direction
    torch.testing.assert_close(state.extras["direction"], expected)
    torch.testing.assert_close(state.params, result.params)


def test_pgn_memory_term_is_exact_whatever_the_cohort_size():
    """Under Poisson sampling n clients take part, the mean divides by the nominal m: the
    private part is scaled by n/m as in DP-FedAvg, the public (1 − β)·g̃ term must not be."""
    d, lr, k, beta, m = 8, 0.1, 5, 0.3, 4
    direction = torch.randn(d, generator=torch.Generator().manual_seed(2))
    grads = torch.randn(2, d, generator=torch.Generator().manual_seed(3))  # 2 of m took part
    total = PartialAggregate()
    for g in grads:  # each client's stripped update: −ηβK·(its mean perturbed gradient)
        total.add({"delta": -lr * beta * k * g}, 1.0)
    rule = MeanServerRule(direction_scale=lr * k, drift_beta=beta)
    state = rule.step(
        ServerState(torch.zeros(d), {"direction": direction}), total, _server_ctx(m), False
    )
    expected = beta * grads.sum(0) / m + (1 - beta) * direction
    torch.testing.assert_close(state.extras["direction"], expected)


def _server_ctx(m):
    return ServerContext(m, 10)


def test_pgn_beta_1_rho_0_is_dp_fedavg_bit_for_bit(store_root):
    extra = ("algorithm.noise_placement=client", *DP)
    fedavg = run_local(small_config(store_root, "algorithm.name=dp_fedavg", *extra))
    pgn = run_local(
        small_config(
            store_root,
            "algorithm.name=dp_fedpgn",
            "algorithm.pgn_beta=1.0",
            "algorithm.pgn_rho=0.0",
            *extra,
        )
    )
    assert torch.equal(pgn.state.params, fedavg.state.params)
    default = run_local(small_config(store_root, "algorithm.name=dp_fedpgn", *extra))
    assert not torch.equal(default.state.params, fedavg.state.params)
    assert default.history[-1].metrics["grad_evals_per_step"] == 1.0
    assert default.state.extras["direction"].abs().sum() > 0  # broadcast to the next round


def test_pgn_noise_on_the_mean_has_std_sigma_c_over_m(store_root):
    config = small_config(store_root, "algorithm.name=dp_fedpgn", *DP)
    d, m = 20_000, 5
    algorithm = config.build_algorithm().bind(ParamLayout(("w",), ((d,),), (0, d)))
    payload = {"direction": torch.ones(d)}
    total = PartialAggregate()
    for client in range(m):
        ctx = ClientContext(
            torch.Generator().manual_seed(client), m, payload=payload, local_steps=5, lr=0.1
        )
        total.add({"delta": algorithm.pipeline(torch.zeros(d), ctx)}, 1.0)
    mean = total.sums["delta"] / m
    assert float(mean.std()) == pytest.approx(1.0 * 0.5 / m, rel=0.02)


def test_laplacian_smoothing_and_server_momentum_steps():
    d = 64
    upload = torch.randn(d, generator=torch.Generator().manual_seed(1))
    total = PartialAggregate()
    total.add({"delta": upload}, 1.0)
    params = torch.zeros(d)
    smooth = MeanServerRule(smoothing=LaplacianSmoothing(0.5))
    state = smooth.step(ServerState(params), total, _server_ctx(2.0), False)
    torch.testing.assert_close(state.params, LaplacianSmoothing(0.5)(upload.double() / 2).float())
    momentum = MeanServerRule(momentum=0.9)
    state = ServerState(params, momentum.initial_extras(params))
    for _ in range(2):
        state = momentum.step(state, total, _server_ctx(2.0), False)
    torch.testing.assert_close(state.params, upload / 2 * (1 + 1.9))


def test_per_tensor_smoothing_smooths_each_tensor_of_the_bound_model(store_root):
    layout = ParamLayout(("w", "b"), ((12,), (4,)), (0, 12, 16))
    upload = torch.randn(16, generator=torch.Generator().manual_seed(4))
    total = PartialAggregate()
    total.add({"delta": upload}, 1.0)
    rule = MeanServerRule(smoothing=LaplacianSmoothing(0.5, "tensor")).bind(layout)
    state = rule.step(ServerState(torch.zeros(16)), total, _server_ctx(1.0), False)
    flat = LaplacianSmoothing(0.5)
    expected = torch.cat([flat(upload[:12].double()), flat(upload[12:].double())]).float()
    torch.testing.assert_close(state.params, expected)
    runs = {}
    for scope in ("flat", "tensor"):
        options = (
            "algorithm.name=dp_fedavg_ls",
            f"algorithm.ls_scope={scope}",
            "algorithm.ls_sigma=1",
        )
        runs[scope] = run_local(small_config(store_root, *options, *DP)).state.params
    assert not torch.equal(runs["flat"], runs["tensor"])


def test_ls_presets_run(store_root):
    for name in ("dp_fedavg_ls", "dp_fedpgn_ls"):
        sim = run_local(small_config(store_root, f"algorithm.name={name}", *DP))
        assert sim.history[-1].test_accuracy is not None


def test_the_mean_rule_leaves_its_inputs_as_they_were():
    """The server's mean and step work in place on new vectors only: the round's sum and the
    previous state (float32 or float64: ``double()`` of a float64 tensor is the tensor itself)
    stay as they were, e.g. for an audit's released − previous difference."""
    for dtype in (torch.float32, torch.float64):
        params = torch.zeros(4, dtype=dtype)
        summed = torch.ones(4, dtype=torch.float64)
        total = PartialAggregate({"delta": summed}, 2.0, 2)
        rule = MeanServerRule(server_lr=0.5)
        for noise in (None, torch.full((4,), 2.0, dtype=torch.float64)):
            new = rule.step(ServerState(params, {}), total, ServerContext(2.0, 10, noise), False)
            expected = 0.5 * (1.0 + (0.0 if noise is None else 2.0)) / 2.0
            assert torch.equal(new.params, torch.full((4,), expected, dtype=dtype))
            assert not params.any() and torch.equal(summed, torch.ones(4, dtype=torch.float64))


def test_a_realised_denominator_divides_by_the_uploads_and_has_no_epsilon():
    """BLUR+LUS's Alg. 1 divides by |P_t|, the number of uploads: the mean of 3 uploads with
    noise Z is (Σ + Z)/3, where the default divides by the nominal cohort (10); no ε holds."""
    total = PartialAggregate()
    for value in (1.0, 2.0, 6.0):
        total.add({"delta": torch.full((4,), value)}, 1.0)
    ctx = ServerContext(10.0, 100, noise_on_sum=torch.full((4,), 3.0, dtype=torch.float64))
    realised = MeanServerRule(denominator="realised")
    assert torch.equal(realised.noisy_mean(total, 4, ctx), torch.full((4,), 4.0).double())
    nominal = MeanServerRule().noisy_mean(total, 4, ctx)
    assert torch.equal(nominal, torch.full((4,), 12.0, dtype=torch.float64) / 10)
    assert MeanServerRule().unaccounted_reason is None
    assert "|P_t|" in realised.unaccounted_reason


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (("algorithm.name=dp_scaffold", *DP), "client-level mean's option"),
        (("algorithm.name=dpsfl", *DP), "client-level mean's option"),
        (("algorithm.name=fedavg", "algorithm.weighting=samples"), "sample weighting"),
    ],
)
def test_a_realised_denominator_is_refused_where_it_has_no_meaning(store_root, sets, says):
    from cluster.config import ConfigError

    with pytest.raises(ConfigError) as error:
        small_config(store_root, *sets, "algorithm.mean_denominator=realised")
    assert "algorithm.mean_denominator" in str(error.value) and says in str(error.value)


def test_a_local_gradient_norm_clip_scales_each_raw_gradient_before_pgn_mixes_it():
    """``max_grad_norm`` M (the DP-FedPGN authors' code: 10): each mini-batch gradient g becomes
    min(1, M/(‖g‖ + 1e-6))·g before the step, and under PGN before the β-mix with g̃."""
    torch.manual_seed(1)
    d, lr, big = 5, 0.1, 100.0
    objective = Quadratic(torch.eye(d), big * torch.ones(d))  # ∇f(0) = −100·1, ‖·‖ ≈ 224
    x, y = torch.zeros(8, 1), torch.zeros(8, dtype=torch.long)
    w0 = torch.zeros(d)

    def one_step(**options):
        trainer = LocalTrainer(lr, batch_size=8, local_steps=1, **options)
        return trainer.train(objective, w0, x, y, torch.Generator()).params

    g = objective.grad(w0)
    clipped = g * (2.0 / (g.norm() + 1e-6))
    torch.testing.assert_close(one_step(max_grad_norm=2.0), -lr * clipped)
    torch.testing.assert_close(one_step(max_grad_norm=1e6), -lr * g)  # within M: unchanged
    direction = torch.randn(d)
    pgn = PgnGradient(beta=0.5, rho=0.0)
    trainer = LocalTrainer(lr, batch_size=8, local_steps=1, max_grad_norm=2.0, gradient=pgn)
    mixed = trainer.train(
        objective, w0, x, y, torch.Generator(), payload={"direction": direction}
    ).params
    torch.testing.assert_close(mixed, -lr * (0.5 * clipped + 0.5 * direction))


def test_a_local_gradient_norm_clip_is_sequential_and_refused_where_clients_clip_already(
    store_root,
):
    from algorithms.local import ModelObjective
    from algorithms.vectorized import vectorizable
    from cluster.config import ConfigError

    model = torch.nn.Linear(4, 3)
    objective = ModelObjective(model, ParamLayout.of(model))
    assert vectorizable(LocalTrainer(0.1, 8, 2), objective)
    assert not vectorizable(LocalTrainer(0.1, 8, 2, max_grad_norm=10.0), objective)
    private = ("algorithm.name=dp_fedavg", *DP)
    config = small_config(store_root, "algorithm.local.max_grad_norm=10", *private)
    assert config.build_algorithm().trainer.max_grad_norm == 10.0
    with pytest.raises(ConfigError, match="algorithm.local.max_grad_norm"):
        small_config(store_root, "algorithm.local.max_grad_norm=0", *private)
    for preset in ("dp_scaffold", "dpsfl"):  # per-example clipping; the sketched batch gradient
        with pytest.raises(ConfigError, match="clip their gradients already"):
            small_config(
                store_root, "algorithm.local.max_grad_norm=10", f"algorithm.name={preset}", *DP
            )


@pytest.mark.parametrize("preset", ["dp_fedpgn", "dp_fedsam", "dp_fedavg"])
def test_runs_with_a_local_gradient_norm_clip(store_root, preset):
    """End to end on the real model objective: a tight clip slows local training (smaller
    updates before the update's own clipping) and changes nothing else about the run."""
    private = (f"algorithm.name={preset}", *DP, "algorithm.clip_norm=100")
    free = run_local(small_config(store_root, *private, "algorithm.noise_multiplier=0"))
    tight = run_local(
        small_config(
            store_root,
            *private,
            "algorithm.noise_multiplier=0",
            "algorithm.local.max_grad_norm=0.01",
        )
    )
    assert (
        tight.history[0].metrics["mean_pre_clip_norm"]
        < free.history[0].metrics["mean_pre_clip_norm"]
    )
    assert (
        tight.history[0].metrics["grad_evals_per_step"]
        == free.history[0].metrics["grad_evals_per_step"]
    )
