"""The Ray actor that wraps a ``ClientHost`` on the device Ray assigns it."""

from __future__ import annotations

import os

import ray
import torch

from actors.client_host import Broadcast, ClientHost, EvalResult, TrainDiagnostics
from actors.scheduling import pin_clients
from algorithms.aggregate import PartialAggregate
from datasets.store import ShardStore


@ray.remote
class ClientHostActor:
    def __init__(
        self,
        cpus_per_actor: float,
        gpus_per_actor: float,
        pinned: tuple[int, int],
        **host_kwargs,
    ):
        """``pinned``: (this actor's index, number of actors). The actor works out its clients
        with the driver's rule (``pin_clients``) instead of receiving their ids: a list of 50,000
        ids would put the constructor's arguments in the object store, from where Ray cannot
        always restore them when it restarts the actor (ray-project/ray#53727)."""
        torch.set_num_threads(max(1, int(cpus_per_actor)))
        device = "cpu"
        # Ray sets CUDA_VISIBLE_DEVICES per actor; the first visible GPU is ours.
        if gpus_per_actor > 0 and ray.get_gpu_ids() and torch.cuda.is_available():
            device = "cuda:0"
            if gpus_per_actor < 1:
                # Ray's GPU fractions are logical; cap this process to its share of memory.
                torch.cuda.set_per_process_memory_fraction(gpus_per_actor, 0)
        index, count = pinned
        sizes = ShardStore.open(host_kwargs["store_path"]).client_sizes
        self.host = ClientHost(
            device=device, client_ids=pin_clients(sizes, count)[index], **host_kwargs
        )

    def info(self) -> dict:
        """Where this actor runs: its process id and torch device."""
        return {"pid": os.getpid(), "device": str(self.host.device)}

    def run_round(
        self, round_index: int, broadcast: Broadcast, client_ids: list[int], nominal: float
    ) -> PartialAggregate:
        return self.host.run_round(round_index, broadcast, client_ids, nominal)

    def evaluate(self, params, start: int, stop: int) -> EvalResult:
        return self.host.evaluate(params, start, stop)

    def evaluate_clients(self, params) -> EvalResult:
        return self.host.evaluate_clients(params)

    def train_diagnostics(self, params) -> TrainDiagnostics:
        return self.host.train_diagnostics(params)

    def client_states(self) -> dict:
        return self.host.client_states()

    def load_client_states(self, states: dict) -> None:
        self.host.load_client_states(states)
