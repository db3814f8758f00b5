"""Per-round local lr decay (DP-FedSAM's and DP-FedPGN's code: η_t = η·0.998^t)."""

import math

import pytest
import torch
from helpers import Quadratic, run_local, small_config

from algorithms.aggregate import PartialAggregate
from algorithms.client import client_round
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, ModelObjective
from algorithms.presets import ClientDP, dp_fedpgn
from algorithms.server import ServerContext, ServerState
from algorithms.transforms import ClientContext
from cluster.config import ConfigError
from cluster.runtime.executors import LocalExecutor
from cluster.runtime.simulation import Simulation
from cluster.runtime.store import open_store
from models.logreg import LogisticRegression


def test_trainer_at_round_decays_geometrically_and_is_identity_without_decay():
    trainer = LocalTrainer(0.1, batch_size=8, local_steps=2, lr_decay=0.9)
    assert trainer.at_round(0).lr == 0.1
    assert trainer.at_round(3).lr == pytest.approx(0.1 * 0.9**3, rel=1e-15)
    constant = LocalTrainer(0.1, batch_size=8, local_steps=2)
    assert constant.at_round(50) is constant
    with pytest.raises(ValueError, match="underflows to 0"):  # PGN would divide by η_t·K = 0
        LocalTrainer(0.1, batch_size=8, local_steps=2, lr_decay=0.5).at_round(1200)


def test_pgn_direction_uses_the_decayed_lr():
    """g̃' = β·ĝ + (1 − β)·g̃ holds at round t only if the server divides by η_t·K, not η·K."""
    torch.manual_seed(1)
    d, k, lr, decay, t, beta = 5, 3, 0.2, 0.8, 4, 0.3
    m = torch.randn(d, d)
    objective = Quadratic(m @ m.T / d + torch.eye(d), torch.randn(d))
    trainer = LocalTrainer(lr, batch_size=4, local_steps=k, lr_decay=decay)
    algorithm = dp_fedpgn(trainer, ClientDP(math.inf, 0.0), pgn_beta=beta, pgn_rho=0.1)
    at_t = algorithm.at_round(t)
    assert at_t.trainer.lr == pytest.approx(lr * decay**t)
    assert at_t.server.direction_scale == pytest.approx(lr * decay**t * k)

    x0, direction = torch.randn(d), torch.randn(d)
    payload = {"direction": direction}
    x, y = torch.zeros(4, 1), torch.zeros(4, dtype=torch.long)
    result = at_t.trainer.train(objective, x0, x, y, torch.Generator(), payload=payload)
    shift = direction * (0.1 / direction.norm())
    w, grads = x0.clone(), []
    for _ in range(k):  # the PGN recursion by hand at η_t
        grads.append(objective.grad(w + shift))
        w = w - at_t.trainer.lr * (beta * grads[-1] + (1 - beta) * direction)
    torch.testing.assert_close(result.params, w)

    ctx = ClientContext(torch.Generator(), 1.0, payload=payload, local_steps=k, lr=at_t.trainer.lr)
    total = PartialAggregate()
    total.add({"delta": at_t.pipeline(result.params - x0, ctx)}, 1.0)
    server_ctx = ServerContext(1.0, 10)
    state = ServerState(x0, {"direction": direction})  # the g̃ the clients were sent
    state = at_t.server.step(state, total, server_ctx, False)
    expected = beta * torch.stack(grads).mean(0) + (1 - beta) * direction
    torch.testing.assert_close(state.extras["direction"], expected)


def test_run_logs_the_decayed_lr_and_decay_changes_the_model(store_root):
    overrides = ("rounds=3", "algorithm.local.lr=0.2")
    decayed = run_local(small_config(store_root, *overrides, "algorithm.local.lr_decay=0.5"))
    constant = run_local(small_config(store_root, *overrides))
    lrs = [r.metrics["local_lr"] for r in decayed.history]
    assert lrs == pytest.approx([0.2, 0.1, 0.05])
    assert [r.metrics["local_lr"] for r in constant.history] == pytest.approx([0.2] * 3)
    # Round 0 trains at the same lr, so the runs part only from round 1 on.
    assert not torch.equal(decayed.state.params, constant.state.params)


@pytest.mark.parametrize("value", [0.0, -0.5, 1.2])
def test_lr_decay_out_of_range_is_a_config_error(store_root, value):
    with pytest.raises(ConfigError, match=r"algorithm\.local\.lr_decay.*0\.998"):
        small_config(store_root, f"algorithm.local.lr_decay={value}")


# DP-SCAFFOLD-warm at l = 5/20: ⌈4/l⌉ = 16 warm-up rounds before the training rounds.
WARM_DP_SCAFFOLD = (
    "algorithm.name=dp_scaffold",
    "algorithm.clip_norm=1.0",
    "algorithm.noise_multiplier=2.0",
    "algorithm.local.batch_size=20",
    "algorithm.local.lr=0.5",
    "algorithm.warm_start=true",
)


def test_warm_start_decays_from_the_first_training_round_on_driver_and_clients(store_root):
    """The warm-up rounds (no lr) do not count towards the decay: the first training round
    trains at η, exactly as the undecayed run does; training round t at η·γ^t."""
    config = small_config(store_root, *WARM_DP_SCAFFOLD, "rounds=2", "algorithm.local.lr_decay=0.5")
    store, _ = open_store(config)
    executor = LocalExecutor(store, config.task, config.build_algorithm(), config.seed)
    try:
        decayed = Simulation(config, store, executor)
        for index in range(17):  # the warm-up and the first training round
            decayed.history.append(decayed.run_round(index))
        constant = run_local(small_config(store_root, *WARM_DP_SCAFFOLD, "rounds=1"))
        assert torch.equal(decayed.state.params, constant.state.params)  # the clients' lr too
        decayed.run()
    finally:
        executor.close()
    lrs = [r.metrics["local_lr"] for r in decayed.history]
    assert lrs == pytest.approx([0.5] * 17 + [0.25])
    assert not torch.equal(decayed.state.params, constant.state.params)


@pytest.mark.parametrize("round_index, training_lr", [(16, 0.5), (18, 0.125)])
def test_a_client_decays_its_lr_from_the_training_round(round_index, training_lr):
    """client_round at driver round r = 16 + t uploads what a client training at η·γ^t does
    (same keys, so same batches and noise)."""
    config = small_config("unused", *WARM_DP_SCAFFOLD, "algorithm.local.lr_decay=0.5")
    algorithm = config.build_algorithm()
    assert algorithm.warmup_rounds == 16
    assert algorithm.at_round(round_index).trainer.lr == training_lr
    at_training_lr = type(algorithm)(
        **{
            **vars(algorithm),
            "trainer": LocalTrainer(
                **{**vars(algorithm.trainer), "lr": training_lr, "lr_decay": 1.0}
            ),
        }
    )
    torch.manual_seed(0)
    model = LogisticRegression(6, 3)
    objective, params = ModelObjective(model, ParamLayout.of(model)), ParamLayout.flatten(model)
    x, y = torch.randn(50, 6), torch.randint(0, 3, (50,))
    payload = {"control": 0.1 * torch.randn_like(params)}
    state = {"control": 0.1 * torch.randn_like(params)}
    runs = [
        client_round(a, objective, params, payload, x, y, state, 0, round_index, 4, 5.0)
        for a in (algorithm, at_training_lr)
    ]
    for name in ("delta", "control"):
        assert torch.equal(runs[0][0][name], runs[1][0][name])
