"""DP-SCAFFOLD and DP-FedAvg at sample level (spec 004 §6.2): identities, warm start, batches,
per-client state, resume, config errors."""

import math

import numpy as np
import pytest
import torch
from helpers import run_local, small_config

from algorithms.client import client_round
from algorithms.dpsgd import DpSgdGradient
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, ModelObjective
from cluster.claims.calibration import calibrate_with_message, calibrated
from cluster.claims.privacy_plan import privacy_claim
from cluster.config import ConfigError, load_config
from cluster.runtime.executors import LocalExecutor
from cluster.runtime.experiment import run_experiment
from cluster.runtime.simulation import Simulation
from cluster.runtime.store import open_store
from models.logreg import LogisticRegression

SCAFFOLD_DP = (
    "algorithm.name=dp_scaffold",
    "algorithm.clip_norm=1.0",
    "algorithm.noise_multiplier=2.0",
    "algorithm.local.batch_size=20",
    "algorithm.local.lr=0.5",
)


class Recording:
    """A gradient rule that records every H̃ the wrapped rule returns (for identity checks)."""

    def __init__(self, rule):
        self.rule, self.seen = rule, []

    def for_round(self, payload=None, noise_stream=None, batch_size=None, steps=None):
        bound = self.rule.for_round(payload, noise_stream, batch_size, steps)

        def call(objective, w, x, y):
            out = bound(objective, w, x, y)
            self.seen.append(out[2].clone())
            return out

        return call


def _objective():
    torch.manual_seed(0)
    model = LogisticRegression(6, 3)
    return ModelObjective(model, ParamLayout.of(model)), ParamLayout.flatten(model)


@pytest.mark.parametrize("lr_scaling", ["none", "inverse_sk"])
def test_new_client_control_is_the_mean_of_the_rounds_noisy_gradients(lr_scaling):
    config = small_config("unused", *SCAFFOLD_DP, f"algorithm.local.lr_scaling={lr_scaling}")
    algorithm = config.build_algorithm()
    recording = Recording(algorithm.trainer.gradient)
    trainer = LocalTrainer(**{**vars(algorithm.trainer), "gradient": recording})
    algorithm = type(algorithm)(**{**vars(algorithm), "trainer": trainer})
    objective, params = _objective()
    x, y = torch.randn(50, 6), torch.randint(0, 3, (50,))
    payload = {"control": 0.1 * torch.randn_like(params)}
    state = {"control": 0.1 * torch.randn_like(params)}
    uploads, _, new_state, report = client_round(
        algorithm, objective, params, payload, x, y, state, 0, 3, 4, 5.0
    )
    assert len(recording.seen) == report.steps == 5
    mean_h = torch.stack(recording.seen).mean(0)
    torch.testing.assert_close(new_state["control"], mean_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(uploads["control"], mean_h - state["control"], atol=1e-5, rtol=0)


def test_warm_start_control_and_trained_control_estimate_the_same_gradient():
    # c_i⁰ (the warm start's mean gradient at x) and option II's c_i⁺ = c_i − c + (x − y)/(Kη)
    # from the same batches at a small lr both carry the weight decay λ·x: without it in c_i⁰
    # they would differ by λ·x (here up to 0.02 a coordinate, against ≈ 1e-4 from the steps).
    config = small_config(
        "unused",
        "algorithm.name=dp_scaffold",
        "algorithm.clip_norm=.inf",
        "algorithm.noise_multiplier=0",
        "algorithm.local.batch_size=20",
        "algorithm.local.lr=1e-4",
        "algorithm.local.weight_decay=0.05",
    )
    algorithm = config.build_algorithm()
    objective, params = _objective()
    x, y = torch.randn(50, 6), torch.randint(0, 3, (50,))
    payload = {"control": torch.zeros_like(params)}
    args = (payload, x, y, {}, 0, 3, 4, 5.0)
    _, _, warm, _ = client_round(algorithm, objective, params, *args, warmup=True)
    _, _, trained, _ = client_round(algorithm, objective, params, *args)
    torch.testing.assert_close(warm["control"], trained["control"], atol=1e-3, rtol=0)
    assert (0.05 * params).abs().max() > 0.015


def test_inverse_sk_local_lr_and_fresh_and_poisson_batches():
    trainer = LocalTrainer(lr=0.2, batch_size=10, local_steps=4, lr_scaling="inverse_sk")
    assert trainer.local_lr(50) == pytest.approx(0.2 / (0.2 * 4))  # η₀/(sK), s = 10/50
    generator = torch.Generator().manual_seed(1)
    fresh = LocalTrainer(lr=0.1, batch_size=10, local_steps=400, batch_sampling="fresh")
    batches = list(fresh.batches(50, generator))
    assert all(len(b) == 10 == len(set(b.tolist())) for b in batches)
    counts = np.bincount(torch.cat(batches).numpy(), minlength=50)
    assert counts.min() > 40  # every record ≈ s·K = 80 times, independently per step
    poisson = LocalTrainer(lr=0.1, batch_size=10, local_steps=2000, batch_sampling="poisson")
    sizes = np.array([len(b) for b in poisson.batches(50, generator)])
    assert abs(sizes.mean() - 10) < 0.3 and sizes.std() > 2  # Binomial(50, 0.2): sd 2.83


def test_sigma_zero_infinite_clip_is_scaffold_bit_for_bit(store_root):
    common = ("algorithm.local.batch_sampling=fresh", "algorithm.local.batch_size=20")
    scaffold = run_local(small_config(store_root, "algorithm.name=scaffold", *common))
    dp = run_local(
        small_config(
            store_root,
            "algorithm.name=dp_scaffold",
            "algorithm.clip_norm=.inf",
            "algorithm.noise_multiplier=0",
            *common,
        )
    )
    assert torch.equal(scaffold.state.params, dp.state.params)
    assert torch.equal(scaffold.state.extras["control"], dp.state.extras["control"])
    assert dp.accountant is None


def test_dp_sgd_path_without_noise_and_with_a_huge_clip_is_scaffold(store_root):
    """The test above skips the DP-SGD rule (C = ∞); here it runs: per-example gradients,
    clipping to C = 1e6 (a no-op on these norms), their sum over B, σ_g = 0, 5 rounds. Equal to
    SCAFFOLD up to float32 rounding of a sum against a mean: measured max |Δ| 2.98e-8 on x and
    1.49e-8 on c (x itself up to 0.27); tolerance 1e-7."""
    common = ("algorithm.local.batch_sampling=fresh", "algorithm.local.batch_size=20")
    scaffold = run_local(small_config(store_root, "algorithm.name=scaffold", *common))
    config = small_config(
        store_root,
        "algorithm.name=dp_scaffold",
        "algorithm.clip_norm=1e6",
        "algorithm.noise_multiplier=0",
        *common,
    )
    rule = config.build_algorithm().trainer.gradient
    assert isinstance(rule, DpSgdGradient) and rule.clip_norm == 1e6
    dp = run_local(config)
    for got, want in (
        (dp.state.params, scaffold.state.params),
        (dp.state.extras["control"], scaffold.state.extras["control"]),
    ):
        difference = float((got - want).abs().max())
        print(f"max |DP-SGD − SCAFFOLD| = {difference:.3g}")
        assert difference <= 1e-7


def test_first_round_with_zero_controls_is_dp_fedavg_sample(store_root):
    runs = {
        name: run_local(
            small_config(store_root, *SCAFFOLD_DP, f"algorithm.name={name}", "rounds=1")
        )
        for name in ("dp_scaffold", "dp_fedavg_sample")
    }
    assert torch.equal(runs["dp_scaffold"].state.params, runs["dp_fedavg_sample"].state.params)
    assert runs["dp_scaffold"].history[0].epsilon == runs["dp_fedavg_sample"].history[0].epsilon


def _simulation(config):
    store, _ = open_store(config)
    executor = LocalExecutor(store, config.task, config.build_algorithm(), config.seed)
    return Simulation(config, store, executor), executor


def test_server_control_stays_the_mean_of_client_controls(store_root):
    sim, executor = _simulation(small_config(store_root, *SCAFFOLD_DP, "rounds=4"))
    sim.run()
    states = executor.hosts[0].client_state.state_dict()
    expected = torch.from_numpy(states["control"]).sum(0) / 20
    torch.testing.assert_close(sim.state.extras["control"], expected, atol=1e-6, rtol=1e-5)


def test_warm_start_moves_no_parameters_and_is_charged(store_root):
    # l = 5/20: ⌈4/l⌉ = 16 warm-up rounds, then 2 training rounds.
    config = small_config(store_root, *SCAFFOLD_DP, "algorithm.warm_start=true", "rounds=2")
    assert config.warmup_rounds == 16 and config.total_rounds == 18
    sim, _ = _simulation(config)
    initial = sim.state.params.clone()
    for index in range(16):
        sim.history.append(sim.run_round(index))
    assert torch.equal(sim.state.params, initial)  # no x update during warm-up
    assert torch.linalg.vector_norm(sim.state.extras["control"]) > 0  # c⁰ = mean c_i⁰
    sim.run()
    assert len(sim.history) == 18 and not torch.equal(sim.state.params, initial)
    cold = run_local(small_config(store_root, *SCAFFOLD_DP, "rounds=2"))
    # Every warm-up round is charged: ε after 18 rounds, not 2.
    assert sim.history[-1].epsilon == pytest.approx(sim.claim.epsilon(18), rel=1e-12)
    assert sim.history[-1].epsilon > 2 * cold.history[-1].epsilon


def test_authors_warm_start_counts_inside_the_rounds_and_charges_round_zero(store_root):
    # l = 5/20: round(4/l) = 16 of the 20 rounds collect c_i⁰ computed at x⁰ in round 0.
    extra = ("algorithm.warm_start=true", "algorithm.warm_start_variant=authors_code")
    config = small_config(store_root, *SCAFFOLD_DP, *extra, "rounds=20")
    assert config.warmup_rounds == 16 and config.total_rounds == 20
    sim, executor = _simulation(config)
    initial = sim.state.params.clone()
    for index in range(16):
        sim.history.append(sim.run_round(index))
    assert torch.equal(sim.state.params, initial)
    collected = executor.hosts[0].client_state.state_dict()
    # c = (1/N) Σ of the c_i⁰ collected once each, every one computed with round 0's keys.
    expected = torch.from_numpy(collected["control"]).sum(0) / 20
    torch.testing.assert_close(sim.state.extras["control"], expected, atol=1e-6, rtol=1e-5)
    sim.run()
    claim = sim.claim
    # Charged: one K-step release of every record (rate 1) plus 4 training rounds at l.
    assert claim.history(20) == [(2.0, 1.0, 1), (2.0, 0.25, 4)]
    assert sim.history[-1].epsilon == pytest.approx(claim.epsilon(20), rel=1e-12)
    assert claim.epsilon(20) > claim.uncounted_warm_start_epsilon(20)
    report = claim.report(20, sim.history[-1].epsilon)
    assert report["warm_start_extra_epsilon"] > 0


@pytest.mark.parametrize("augmented", [True, False])
def test_a_warm_start_draws_dropout_and_augmentation_from_the_clients_streams(augmented):
    """c_i⁰ on a model with dropout was drawn from whatever torch's global generator held (the
    clients a host ran before: a review measured 3.7e-3 between two predecessors), and on a
    task with augmentation it crashed (no augmentation stream). Now both come from the
    client's streams, as its training's do."""
    from datasets.tasks import TASKS

    task = TASKS["cifar10_cnn2"]
    config = small_config(
        "unused",
        *SCAFFOLD_DP,
        "task=cifar10_cnn2",
        "data.source=cifar10",
        "algorithm.warm_start=true",
        "algorithm.local.batch_size=4",
        "algorithm.local.local_steps=2",
    )
    torch.manual_seed(0)
    model = task.model((3, 32, 32), 10)
    objective = ModelObjective(model, ParamLayout.of(model), task.augment if augmented else None)
    assert (objective.augment is not None) == augmented and objective.draws_from_global_rng
    algorithm = config.build_algorithm().bind(objective.layout)
    params = ParamLayout.flatten(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 3, 32, 32, generator=g), torch.randint(0, 10, (12,), generator=g)
    payload = {"control": torch.zeros_like(params)}
    controls = []
    for before in (1, 2):  # what the host ran before: another global generator state
        torch.manual_seed(before)
        uploads, *_ = client_round(
            algorithm, objective, params, payload, x, y, {}, 0, 0, 7, 5.0, True
        )
        controls.append(uploads["control"])
    assert controls[0].norm() > 0 and torch.equal(controls[0], controls[1])


def test_resume_is_bit_identical_with_client_controls(store_root):
    config = small_config(store_root, *SCAFFOLD_DP, "rounds=4")
    straight, _ = _simulation(config)
    straight.run()
    first, _ = _simulation(small_config(store_root, *SCAFFOLD_DP, "rounds=2"))
    first.run()
    saved = first.state_dict()
    resumed, executor = _simulation(config)
    resumed.load_state_dict(saved)
    resumed.run()
    assert torch.equal(resumed.state.params, straight.state.params)
    assert resumed.history[-1].epsilon == straight.history[-1].epsilon


@pytest.mark.parametrize(
    "overrides, field",
    [
        (("algorithm.local.batch_sampling=epoch",), "algorithm.local.batch_sampling"),
        (("algorithm.local.local_steps=null", "algorithm.local.local_epochs=1"), "local_epochs"),
        (("algorithm.adjacency=add_remove",), "algorithm.adjacency"),
        (("algorithm.noise_placement=client",), "algorithm.noise_placement"),
        (("algorithm.clip_rule=median",), "algorithm.clip_norm"),
        (("privacy.accountant=pld",), "privacy.accountant"),
        # DP-SCAFFOLD's c_i and c live on the simulated clients: no deployment claim
        (("privacy.noise_cohort_size=10",), "privacy.noise_cohort_size"),
        (("privacy.population=1000",), "privacy.population"),
        (
            (
                "algorithm.name=dp_fedavg_sample",
                "privacy.population=1000",
                "privacy.sampling=poisson",
            ),
            "privacy.sampling",
        ),
        (("privacy.accountant=paper", "cohort.sampling=poisson"), "poisson cohorts"),
        (
            ("privacy.accountant=paper", "algorithm.local.batch_sampling=poisson"),
            "poisson batches",
        ),
    ],
)
def test_sample_level_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as error:
        small_config("unused", *SCAFFOLD_DP, *overrides)
    assert field in str(error.value)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (
            ("algorithm.name=dp_fedavg", *SCAFFOLD_DP[1:3], "algorithm.adjacency=add_remove"),
            "algorithm.adjacency",
        ),
        (("algorithm.local.batch_sampling=poisson",), "algorithm.local.batch_sampling"),
        (("privacy.accountant=paper", *SCAFFOLD_DP[1:3], "algorithm.name=dp_fedavg"), "paper"),
    ],
)
def test_sample_level_options_are_refused_elsewhere(overrides, field):
    with pytest.raises(ConfigError) as error:
        small_config("unused", *overrides)
    assert field in str(error.value)


def test_poisson_batches_with_add_remove_account_with_pld(store_root):
    sim = run_local(
        small_config(
            store_root,
            *SCAFFOLD_DP,
            "algorithm.local.batch_sampling=poisson",
            "algorithm.adjacency=add_remove",
            "rounds=2",
        )
    )
    assert sim.claim.accountant_name == "pld" and sim.claim.data_rate == 0.25  # 20 of 80
    assert math.isfinite(sim.history[-1].epsilon)
    rdp = sim.claim.epsilon(2, "rdp")
    assert sim.history[-1].epsilon <= rdp  # the PLD is the tighter of the two


@pytest.mark.parametrize(
    "path, clients, records, rounds, paper",
    [
        ("configs/papers/dpscaffold_femnist_logreg.yaml", 40, 2000, 400, 11.36),
        ("configs/papers/dpscaffold_mnist_mlp.yaml", 60, 800, 100, 7.15),
    ],
)
def test_paper_configs_claim_the_papers_epsilon_with_its_accountant(
    path, clients, records, rounds, paper
):
    config = load_config(path)
    claim = privacy_claim(config, config.build_algorithm(), [records] * clients)
    assert config.warmup_rounds == 20 and claim.data_rate == 0.2
    assert claim.epsilon(rounds, "paper") == pytest.approx(paper, abs=0.05)  # spec 004 §3
    assert claim.epsilon(config.total_rounds) < claim.epsilon(config.total_rounds, "paper")


def _rounds_for_epsilon_2(store_root, *extra):
    """DP-SCAFFOLD at σ_g = 10 with T calibrated to ε = 2."""
    return small_config(
        store_root,
        *SCAFFOLD_DP,
        "algorithm.noise_multiplier=10",
        "privacy.target_epsilon=2.0",
        "privacy.calibrate=rounds",
        *extra,
    )


def test_calibration_uses_the_record_level_accountant(store_root):
    after = calibrated(_rounds_for_epsilon_2(store_root, "algorithm.warm_start=true"))
    claim = privacy_claim(after, after.build_algorithm(), [80] * 20)
    # T counts training rounds; the 16 warm-up rounds are charged on top of them.
    assert after.rounds > 1 and after.total_rounds == after.rounds + 16
    assert claim.epsilon(after.total_rounds) <= 2.0 < claim.epsilon(after.total_rounds + 1)
    sigma = small_config(
        store_root,
        *SCAFFOLD_DP,
        "algorithm.noise_multiplier=null",
        "privacy.target_epsilon=2.0",
        "privacy.calibrate=sigma",
    )
    after = calibrated(sigma)
    claim = privacy_claim(after, after.build_algorithm(), [80] * 20)
    assert 1.99 < claim.epsilon(after.rounds) <= 2.0
    said = []
    calibrate_with_message(sigma, said.append)  # the δ printed is the records' (R^-1.1)
    assert f"at δ = {claim.delta:g}," in said[0] and claim.delta != sigma.delta

    # DP-SCAFFOLD's own accountant ("paper") calibrates too: a sample-level config never asks
    # the client-level registry, which has no "paper" (it raised there).
    after = calibrated(_rounds_for_epsilon_2(store_root, "privacy.accountant=paper"))
    claim = privacy_claim(after, after.build_algorithm(), [80] * 20)
    assert claim.epsilon(after.total_rounds, "paper") <= 2.0
    assert claim.epsilon(after.total_rounds + 1, "paper") > 2.0


def test_train_diagnostics_are_the_objective_and_the_gradient_dissimilarity(store_root):
    """``eval_train``: at each evaluation, F(x) = (1/M) Σ_i F_i(x) + (λ/2)‖x‖² over every
    client's training data and (1/M) Σ_i ‖∇F_i‖² − ‖(1/M) Σ_i ∇F_i‖² (DP-SCAFFOLD's
    diagnostics), the same on 1 or 2 hosts, and equal to computing them directly."""
    from actors.client_host import build_model
    from algorithms.layout import ParamLayout
    from algorithms.local import ModelObjective
    from cluster.runtime.central_optimum import central_optimum
    from cluster.runtime.store import open_store
    from datasets.tasks import TASKS

    config = small_config(
        store_root,
        "eval_train=true",
        "eval_every=2",
        "rounds=4",
        "algorithm.local.weight_decay=0.005",
    )
    one, two = run_local(config), run_local(config, num_hosts=2)
    evaluated = [r.round for r in one.history if "train_objective" in r.metrics]
    assert evaluated == [2, 4]
    store, _ = open_store(config)
    task = TASKS[config.task]
    model = build_model(store, config.task)
    objective = ModelObjective(model, ParamLayout.of(model))
    x = one.state.params
    losses, grads = [], []
    for cid in range(store.num_clients):
        rows = store.client(cid)
        xs, ys = task.preprocess(torch.tensor(rows.x)), torch.tensor(rows.y)
        loss, _, grad = objective.loss_and_grad(x, xs, ys)
        losses.append(float(loss))
        grads.append(grad.double())
    g = torch.stack(grads)
    expected_f = sum(losses) / len(losses) + 0.5 * 0.005 * float(x.double().square().sum())
    expected_d = float(g.square().sum(1).mean() - g.mean(0).square().sum())
    for sim in (one, two):
        metrics = sim.history[-1].metrics
        assert metrics["train_objective"] == pytest.approx(expected_f, rel=1e-6)
        assert metrics["gradient_dissimilarity"] == pytest.approx(expected_d, rel=1e-5)
    assert expected_d > 0  # heterogeneous synthetic clients
    # The train-loss gap against the central optimum F(x*) (convex: logistic regression).
    optimum = central_optimum(store, config.task, 0.005)
    gap = one.history[-1].metrics["train_loss_gap_log10"]
    assert gap == pytest.approx(math.log10(expected_f - optimum), abs=1e-4)
    # F(x*) independently: SciPy's L-BFGS-B on NumPy's softmax cross-entropy and its gradient.
    from scipy.optimize import minimize
    from scipy.special import log_softmax

    rows = [store.client(cid) for cid in range(store.num_clients)]
    xs = np.concatenate([task.preprocess(torch.tensor(r.x)).double().numpy() for r in rows])
    ys = np.concatenate([r.y for r in rows]).astype(np.int64)
    weights = np.concatenate([np.full(len(r.y), 1 / (len(rows) * len(r.y))) for r in rows])
    onehot = np.eye(10)[ys]

    def objective_and_gradient(theta):
        w, b = theta[:-10].reshape(xs.shape[1], 10), theta[-10:]
        logp = log_softmax(xs @ w + b, axis=1)
        value = -(weights * (onehot * logp).sum(1)).sum() + 0.0025 * (theta @ theta)
        residual = weights[:, None] * (np.exp(logp) - onehot)
        gradient = np.concatenate([(xs.T @ residual).ravel(), residual.sum(0)]) + 0.005 * theta
        return value, gradient

    found = minimize(
        objective_and_gradient,
        np.zeros(xs.shape[1] * 10 + 10),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 5000, "gtol": 1e-12, "ftol": 1e-15},
    )
    assert np.abs(found.jac).max() < 1e-6  # a stationary point of the convex F: its minimum
    assert found.fun == pytest.approx(optimum, rel=1e-8)
    objectives = [
        r.metrics["train_objective"] for r in one.history if r.metrics.get("train_objective")
    ]
    assert optimum < min(objectives)
    cnn = small_config(store_root, "task=mnist_cnn", "data.source=mnist_test_split")
    assert central_optimum(store, cnn.task, 0.0) is None  # no global optimum to compare with


def test_dp_scaffold_and_dp_fedavg_cost_the_same_epsilon_at_the_same_noise():
    """DP-SCAFFOLD's Claim 4.1: at the same σ_g, batches, cohorts and rounds its ε is
    DP-FedAvg's (the control variates are post-processing of the same noisy releases)."""
    config = load_config("configs/papers/dpscaffold_mnist_mlp.yaml")
    fedavg = load_config(
        "configs/papers/dpscaffold_mnist_mlp.yaml",
        ["algorithm.name=dp_fedavg_sample", "algorithm.warm_start=null"],
    )
    sizes = [800] * 60
    scaffold = privacy_claim(config, config.build_algorithm(), sizes)
    plain = privacy_claim(fedavg, fedavg.build_algorithm(), sizes)
    for rounds in (1, 50, 400):
        assert scaffold.epsilon(rounds) == plain.epsilon(rounds)
        assert scaffold.epsilon(rounds, "paper") == plain.epsilon(rounds, "paper")


DEPLOYMENT = ("privacy.noise_cohort_size=40", "privacy.population=400", "privacy.delta=1e-5")


def test_dp_fedavg_sample_claims_the_deployment_of_its_noise_cohort():
    """5 of 20 simulated clients standing for 40 of 400: l = 40/400, each simulated client's
    noise × √(5/40), and ε that of a run of the deployment itself (its clients no smaller)."""
    fedavg = ("algorithm.name=dp_fedavg_sample", *SCAFFOLD_DP[1:])
    sizes = [100] * 20
    config = small_config("unused", *fedavg, *DEPLOYMENT)
    algorithm = config.build_algorithm()
    assert algorithm.sample_dp.simulation_noise_factor == pytest.approx(math.sqrt(5 / 40))
    assert algorithm.sample_dp.noise_multiplier == 2.0  # the deployment client's σ_g
    claim = privacy_claim(config, algorithm, sizes)
    assert (claim.client_rate, claim.num_clients) == (0.1, 400)
    assert claim.deployment == "40 of 400 clients per round"
    assert "deployment of 40 of 400" in claim.notices()[0]
    assert "0.3536·σ_g" in claim.notices()[0]
    assert claim.tags()["privacy.epsilon_for"] == "40 of 400 clients per round"
    deployed = small_config(
        "unused", *fedavg, "data.num_clients=400", "cohort.size=40", "privacy.delta=1e-5"
    )
    direct = privacy_claim(deployed, deployed.build_algorithm(), sizes)
    assert direct.deployment is None and direct.notices()[0].startswith("privacy: record-level")
    assert claim.epsilon(30) == direct.epsilon(30)
    alone = small_config("unused", *fedavg, "privacy.delta=1e-5")
    simulated = privacy_claim(alone, alone.build_algorithm(), sizes)
    assert claim.epsilon(30) < simulated.epsilon(30)  # l = 0.1, not the simulated 0.25
    # The paper's accountant reads the deployment too (lM = C_n = 40), as the run's accountant
    # and as the side number, and equals that of the deployment run directly.
    paper = small_config("unused", *fedavg, *DEPLOYMENT, "privacy.accountant=paper")
    paper_claim = privacy_claim(paper, paper.build_algorithm(), sizes)
    assert paper_claim.epsilon(30) == claim.epsilon(30, "paper") == direct.epsilon(30, "paper")
    assert paper_claim.epsilon(30) != claim.epsilon(30)


def test_deployment_default_delta_counts_the_deployments_records():
    fedavg = ("algorithm.name=dp_fedavg_sample", *SCAFFOLD_DP[1:])
    config = small_config("unused", *fedavg, *DEPLOYMENT[:2])
    claim = privacy_claim(config, config.build_algorithm(), [100] * 20)
    assert claim.delta == pytest.approx((100 * 20 * 400 / 20) ** -1.1, rel=1e-12)


def test_a_partition_that_copies_records_has_no_record_level_epsilon():
    """``dirichlet`` with ``samples_per_client`` refills class pools: a record may sit in
    several clients, so its influence is up to its copy count times what the accountant
    assumes. The run trains, dp_valid=false with the reason; budgets are refused."""
    fedavg = ("algorithm.name=dp_fedavg_sample", *SCAFFOLD_DP[1:], "privacy.delta=1e-5")
    copying = "data.partition={method: dirichlet, alpha: 0.5, samples_per_client: 200}"
    config = small_config("unused", *fedavg, copying)
    claim = privacy_claim(config, config.build_algorithm(), [200] * 20)
    assert not claim.dp_valid and claim.new_accountant() is None
    assert "a record may sit in several clients" in claim.unaccounted_reason
    assert claim.tags()["privacy.dp_valid"] == "false"
    with pytest.raises(ConfigError, match="remove data.partition.samples_per_client"):
        small_config("unused", *fedavg, copying, "privacy.target_epsilon=5")
    disjoint = small_config("unused", *fedavg, "data.partition={method: dirichlet, alpha: 0.5}")
    assert privacy_claim(disjoint, disjoint.build_algorithm(), [100] * 20).dp_valid
    client_level = small_config("unused", "algorithm.name=dp_fedavg", *SCAFFOLD_DP[1:3], copying)
    assert client_level.record_copies is None  # a client's data is the unit: copies are data


def test_a_record_level_delta_below_the_pld_floor_is_refused_before_any_work(store_root):
    """δ = R^-1.1 for a deployment of 10⁷ clients like these 20 (80 training records each) is
    1.6e-10, below ``privacy.pld.MIN_DELTA``, where the pld accountant's FFT is not accurate:
    refused before the executor starts (the rdp accountant takes it)."""
    sets = (
        "algorithm.name=dp_fedavg_sample",
        "algorithm.clip_norm=1.0",
        "algorithm.noise_multiplier=1.0",
        "algorithm.noise_placement=null",
        "algorithm.local.batch_sampling=poisson",
        "algorithm.adjacency=add_remove",
        "privacy.population=10000000",
    )
    assert small_config(store_root, *sets).accountant_name == "pld"
    with pytest.raises(ConfigError, match="below 1e-09, where the pld accountant"):
        run_experiment(small_config(store_root, *sets, "rounds=1"))
    sim = run_local(small_config(store_root, *sets, "rounds=1", "privacy.accountant=rdp"))
    assert sim.claim.delta < 1e-9 and math.isfinite(sim.history[-1].epsilon)
