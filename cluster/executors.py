"""Executors run a round's cohort and return its sum; the driver never sees single updates.

``LocalExecutor`` hosts every client in this process (tests, debugging). ``RayExecutor`` pins
clients to a pool of actors, broadcasts once per round with ``ray.put``, and sums the actors'
partial aggregates in actor order. Both run the same ``ClientHost`` code with per-client seeds,
so they agree up to float summation order.
"""

from __future__ import annotations

import numpy as np

from actors.client_host import AUTO_KERNELS, Broadcast, ClientHost, EvalResult, Kernels
from actors.client_state import ClientStateStore
from actors.scheduling import balance_round, pin_clients
from algorithms.aggregate import PartialAggregate
from algorithms.presets import Algorithm
from datasets.store import ShardStore

MAX_RETRIES = 3


class LocalExecutor:
    def __init__(
        self,
        store: ShardStore,
        task: str,
        algorithm: Algorithm,
        seed: int,
        device: str = "cpu",
        test_per_client: int | None = None,
        kernels: Kernels = AUTO_KERNELS,
    ):
        self.num_test = store.manifest["num_test"]
        clients = list(range(store.num_clients))
        self.host = ClientHost(
            store.location,
            task,
            algorithm,
            seed,
            clients,
            device,
            test_per_client=test_per_client,
            kernels=kernels,
        )

    def run_round(
        self, round_index: int, broadcast: Broadcast, cohort: np.ndarray, nominal: float
    ) -> PartialAggregate:
        return self.host.run_round(round_index, broadcast, [int(c) for c in cohort], nominal)

    def evaluate(self, params: np.ndarray) -> EvalResult:
        return self.host.evaluate(params, 0, self.num_test)

    def evaluate_clients(self, params: np.ndarray) -> EvalResult:
        return self.host.evaluate_clients(params)

    def client_states(self) -> dict:
        return self.host.client_states()

    def load_client_states(self, states: dict) -> None:
        self.host.load_client_states(states)

    def close(self) -> None:
        pass


class RayExecutor:
    def __init__(
        self,
        store: ShardStore,
        task: str,
        algorithm: Algorithm,
        seed: int,
        num_actors: int,
        cpus_per_actor: float = 1.0,
        gpus_per_actor: float = 0.0,
        test_per_client: int | None = None,
        kernels: Kernels = AUTO_KERNELS,
    ):
        import ray

        from actors.ray_actor import ClientHostActor

        self._ray = ray
        assignment = pin_clients(store.client_sizes, num_actors)
        self.owner = np.empty(store.num_clients, dtype=np.int64)
        for actor_index, clients in enumerate(assignment):
            self.owner[clients] = actor_index
        # Clients without state may train on any actor: each round's cohort is evened out by
        # local steps (actors.scheduling.balance_round); SCAFFOLD's stay with their c_i.
        self.steps = None
        if not algorithm.control_variates:
            self.steps = np.array([algorithm.trainer.num_steps(int(n)) for n in store.client_sizes])
        # A stateless algorithm's round is a pure function of (broadcast, seeds): Ray restarts a
        # dead actor (reloading its shards) and retries the call, with an identical result. An
        # actor holding client state (SCAFFOLD c_i) would lose it, so there a death fails the
        # run, which resumes from its last checkpoint instead.
        retries = 0 if algorithm.control_variates else MAX_RETRIES
        self.actors = [
            ClientHostActor.options(
                num_cpus=cpus_per_actor,
                num_gpus=gpus_per_actor,
                max_restarts=retries,
                max_task_retries=retries,
            ).remote(
                cpus_per_actor,
                gpus_per_actor,
                (actor_index, num_actors),
                store_path=store.location,
                test_per_client=test_per_client,
                kernels=kernels,
                task=task,
                algorithm=algorithm,
                seed=seed,
            )
            for actor_index in range(num_actors)
        ]
        bounds = np.linspace(0, store.manifest["num_test"], num_actors + 1).astype(int)
        self.eval_slices = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
        self.devices = [info["device"] for info in self.actor_info()]

    def actor_info(self) -> list[dict]:
        return self._ray.get([actor.info.remote() for actor in self.actors])

    def run_round(
        self, round_index: int, broadcast: Broadcast, cohort: np.ndarray, nominal: float
    ) -> PartialAggregate:
        ref = self._ray.put(broadcast)  # once per round, shared by every actor
        owners = self.owner[cohort]
        groups = [cohort[owners == a].tolist() for a in range(len(self.actors))]
        if self.steps is not None:
            groups = balance_round(groups, self.steps)
        futures = [
            actor.run_round.remote(round_index, ref, members, nominal)
            for actor, members in zip(self.actors, groups, strict=True)
            if members
        ]
        return PartialAggregate.combine(self._ray.get(futures))

    def evaluate(self, params: np.ndarray) -> EvalResult:
        ref = self._ray.put(params)
        futures = [
            actor.evaluate.remote(ref, start, stop)
            for actor, (start, stop) in zip(self.actors, self.eval_slices, strict=True)
            if stop > start
        ]
        return EvalResult.combine(self._ray.get(futures))

    def evaluate_clients(self, params: np.ndarray) -> EvalResult:
        ref = self._ray.put(params)
        return EvalResult.combine(
            self._ray.get([actor.evaluate_clients.remote(ref) for actor in self.actors])
        )

    def client_states(self) -> dict:
        parts = self._ray.get([a.client_states.remote() for a in self.actors])
        return ClientStateStore.merge(parts)

    def load_client_states(self, states: dict) -> None:
        futures = [
            actor.load_client_states.remote(ClientStateStore.select(states, self.owner == index))
            for index, actor in enumerate(self.actors)
        ]
        self._ray.get(futures)

    def close(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor)
