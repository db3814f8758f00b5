"""docs/examples/dp_fedprox.py, the preset docs/extending.md works through: it runs, its ε is
read off its own mechanism, and μ = 0 is DP-FedAvg bit for bit."""

import math
from dataclasses import replace

import torch

from docs.examples.dp_fedprox import building_dp_fedprox, client_dp, dp_fedprox
from tests.helpers import run_local, small_config

DP_FEDAVG = (
    "algorithm.name=dp_fedavg",
    "algorithm.clip_norm=0.5",
    "algorithm.noise_multiplier=1.0",
    "privacy.delta=1e-5",
    "rounds=2",
)


def test_dp_fedprox_runs_two_rounds_with_dp_fedavgs_epsilon(store_root):
    reference = run_local(small_config(store_root, *DP_FEDAVG))
    prox = run_local(building_dp_fedprox(small_config(store_root, *DP_FEDAVG), prox_mu=1.0))
    assert prox.algorithm.name == "dp_fedprox"
    assert [r.round for r in prox.history] == [1, 2]
    # Same clip, σ and sampling: the claim read off the new preset's mechanism charges the same.
    epsilons = [r.epsilon for r in prox.history]
    assert all(math.isfinite(e) and e > 0 for e in epsilons)
    assert epsilons == [r.epsilon for r in reference.history]
    # The proximal term pulls each local model towards w₀: the training differs.
    assert not torch.equal(prox.state.params, reference.state.params)


def test_dp_fedprox_without_the_proximal_term_is_dp_fedavg(store_root):
    reference = run_local(small_config(store_root, *DP_FEDAVG))
    prox = run_local(building_dp_fedprox(small_config(store_root, *DP_FEDAVG), prox_mu=0.0))
    assert torch.equal(prox.state.params, reference.state.params)


def test_the_epsilon_is_read_off_the_presets_mechanism_not_the_config(store_root):
    """A DP-FedProx built with σ = 2 from a config that says σ = 1 is charged for σ = 2."""
    config = small_config(store_root, *DP_FEDAVG)
    reference = run_local(small_config(store_root, *DP_FEDAVG))
    base = config.build_algorithm()
    louder = client_dp(replace(base.mechanism, noise_multiplier=2.0))
    algorithm = dp_fedprox(base.trainer, louder, base.server.server_lr, prox_mu=1.0)
    config.build_algorithm = lambda: algorithm
    prox = run_local(config)
    assert config.algorithm.noise_multiplier == 1.0
    assert all(
        0 < p.epsilon < r.epsilon for p, r in zip(prox.history, reference.history, strict=True)
    )
