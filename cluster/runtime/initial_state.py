"""The run's model and the server's state at round 0: what a run starts from, and what a
checkpoint is checked against before it is resumed."""

from __future__ import annotations

import torch

from algorithms.algorithm import Algorithm
from algorithms.layout import ParamLayout
from algorithms.rng import Purpose, stream_seed
from algorithms.server import ServerState
from cluster.config import ExperimentConfig
from datasets.store import ShardStore
from datasets.tasks import TASKS


def initial_params(
    config: ExperimentConfig, store: ShardStore
) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model for the store's rows and its initial flat parameters (``initial_model``)."""
    manifest = store.manifest
    return initial_model(config, tuple(manifest["x_shape"]), manifest["num_classes"])


def initial_model(
    config: ExperimentConfig, x_shape: tuple[int, ...], num_classes: int
) -> tuple[torch.nn.Module, torch.Tensor]:
    """The task's model for rows of ``x_shape`` in ``num_classes`` classes and its initial flat
    parameters, seeded by (seed, MODEL_INIT), then those of ``data.pretrained`` loaded (all
    but the classifier head)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(config.seed, Purpose.MODEL_INIT))
        model = TASKS[config.task].model(x_shape, num_classes)
    TASKS[config.task].load_pretrained(model, config.data.pretrained_folder())
    return model, ParamLayout.flatten(model)


def initial_state(
    config: ExperimentConfig, layout: ParamLayout, params: torch.Tensor
) -> tuple[Algorithm, ServerState]:
    """The config's algorithm bound to the model's ``layout``, and the server state at round 0
    (``params`` and the algorithm's extras: SCAFFOLD's c, momentum, sketches, …)."""
    algorithm = config.build_algorithm().bind(layout)
    return algorithm, ServerState(params, algorithm.initial_extras(params))
