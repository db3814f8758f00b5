"""DP-FedProx, a new algorithm preset: FedProx's proximal local objective (Li et al. 2020)
under DP-FedAvg's clip and noise. ``docs/extending.md`` works through this file."""

from __future__ import annotations

from dataclasses import replace

from algorithms.algorithm import Algorithm
from algorithms.local import LocalTrainer
from algorithms.mechanism import GaussianMechanism
from algorithms.presets import ClientDP
from algorithms.regularizers import Proximal
from algorithms.server import MeanServerRule
from cluster.config import ExperimentConfig


def dp_fedprox(
    trainer: LocalTrainer, dp: ClientDP, server_lr: float = 1.0, prox_mu: float = 0.1
) -> Algorithm:
    """Local SGD on f_i(w) + (μ/2)·‖w − w₀‖₂², then DP-FedAvg's clip to C and noise σ·C."""
    proximal = replace(trainer, regularizers=(*trainer.regularizers, Proximal(prox_mu)))
    return Algorithm("dp_fedprox", proximal, dp.pipeline(), MeanServerRule(server_lr, "uniform"))


def client_dp(mechanism: GaussianMechanism) -> ClientDP:
    """The ``ClientDP`` part that built ``mechanism``: its clip, σ, placement and noise scale."""
    clip = mechanism.clip
    return ClientDP(
        clip.clip_norm,
        mechanism.noise_multiplier,
        mechanism.placement,
        mechanism.noise_scale,
        clip.scope,
        clip.rule,
    )


def building_dp_fedprox(config: ExperimentConfig, prox_mu: float) -> ExperimentConfig:
    """``config``, a ``dp_fedavg`` config, made to build DP-FedProx with the same trainer, clip,
    noise and server learning rate: what registering the preset does for a config naming it."""
    base = config.build_algorithm()
    algorithm = dp_fedprox(base.trainer, client_dp(base.mechanism), base.server.server_lr, prox_mu)
    config.build_algorithm = lambda: algorithm  # what the Simulation and the executor build
    return config
