"""The Ray actor that wraps a ``ClientHost`` on the device Ray assigns it."""

from __future__ import annotations

import os

import ray
import torch

from actors.client_host import Broadcast, ClientHost, EvalResult, TrainDiagnostics
from actors.scheduling import pin_clients
from algorithms.aggregate import PartialAggregate
from datasets.store import ShardStore


class ClientStatesLost(RuntimeError):
    """A restarted actor asked for its clients' states before they were loaded back."""


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
        # Restarted by Ray (its node or process died): its clients' states went with it.
        # Until the driver loads them back, a round or a state read would silently start
        # SCAFFOLD's c_i from zero: refused instead.
        self.index = index
        self.states_lost = (
            host_kwargs["algorithm"].control_variates
            and ray.get_runtime_context().was_current_actor_reconstructed
        )

    def info(self) -> dict:
        """Where this actor runs: its process id, torch device, Ray node id and node IP."""
        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "device": str(self.host.device),
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
        }

    def _check_states(self) -> None:
        if self.states_lost:
            raise ClientStatesLost(
                f"actor {self.index} was restarted and holds none of its clients' states: "
                "load_client_states first"
            )

    def run_round(
        self, round_index: int, broadcast: Broadcast, client_ids: list[int], nominal: float
    ) -> PartialAggregate:
        self._check_states()
        return self.host.run_round(round_index, broadcast, client_ids, nominal)

    def evaluate(self, params, start: int, stop: int, split: str = "test") -> EvalResult:
        return self.host.evaluate(params, start, stop, split)

    def evaluate_clients(self, params) -> EvalResult:
        return self.host.evaluate_clients(params)

    def train_diagnostics(self, params) -> TrainDiagnostics:
        return self.host.train_diagnostics(params)

    def client_states(self) -> dict:
        self._check_states()
        return self.host.client_states()

    def load_client_states(self, states: dict) -> None:
        self.host.load_client_states(states)
        self.states_lost = False
