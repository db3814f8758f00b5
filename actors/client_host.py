"""A host of many virtual clients: loads their shards once, runs their rounds, pre-aggregates.

``ClientHost`` is plain Python (no Ray): the ``LocalExecutor`` uses it in process and the
``RayExecutor`` wraps it in an actor, so both run exactly the same client code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from actors.client_data import DEFAULT_CACHE_BYTES, ClientDataCache
from actors.client_state import ClientStateStore
from actors.kernel_table import KernelChoice, choose
from algorithms.aggregate import PartialAggregate
from algorithms.algorithm import Algorithm
from algorithms.client import client_round
from algorithms.clients_tail import batchable, sum_trained_clients
from algorithms.control_variates import local_correction
from algorithms.dpsgd import auto_method
from algorithms.dynamo_import import start_dynamo_import
from algorithms.layout import ParamLayout
from algorithms.local import LocalResult, ModelObjective, autocast_dtype
from algorithms.rng import Purpose, client_generators
from algorithms.vectorized import train_clients, vectorizable
from datasets.store import ShardStore
from datasets.tasks import TASKS


@dataclass(frozen=True)
class Broadcast:
    """What the driver sends every client of a round: ``ray.put`` once per round."""

    params: np.ndarray
    payload: dict[str, np.ndarray] = field(default_factory=dict)
    warmup: bool = False  # DP-SCAFFOLD-warm: clients compute c_i⁰ only, no local training


class _Summed:
    """Per-host results of one evaluation, combined field by field in host order."""

    @classmethod
    def combine(cls, parts: list) -> _Summed:
        return cls(*(sum(getattr(p, f.name) for p in parts) for f in fields(cls)))


@dataclass(frozen=True)
class EvalResult(_Summed):
    loss_sum: float
    correct: int
    count: int


@dataclass(frozen=True)
class TrainDiagnostics(_Summed):
    """Sums over clients at one model x: Σ_i F_i(x), Σ_i ‖∇F_i(x)‖², Σ_i ∇F_i(x) (float64),
    F_i the mean loss on client i's training data (full batch, dropout off)."""

    loss_sum: float
    grad_sq_sum: float
    grad_sum: np.ndarray
    clients: int


@dataclass(frozen=True)
class Kernels:
    """How a host computes its clients' steps; never what (results equal up to float rounding,
    or bf16's under ``precision``).

    ``vectorize``: train a round's clients as vmapped batches where that is the same computation
    (``algorithms.vectorized``). ``channels_last``: NHWC convolutions (``ModelObjective``). Each
    is True, False or "auto": the fixed table's entry for the model kind and device type
    (``actors.kernel_table``), never a timing at run time. ``precision``: "bf16" runs the
    model's forward (and so its backward) under bf16 autocast, the parameters, the update, its
    clip and its noise in float32 (``ModelObjective.autocast``).
    """

    vectorize: bool | str = "auto"
    channels_last: bool | str = "auto"
    precision: str = "float32"

    def resolve(self, model_kind: str, device: torch.device) -> KernelChoice:
        """The kernels for the model kind (``models.MODELS`` name) on this device."""
        return choose(model_kind, device.type, self.vectorize, self.channels_last)


AUTO_KERNELS = Kernels()


def build_model(store: ShardStore, task: str) -> torch.nn.Module:
    manifest = store.manifest
    return TASKS[task].model(tuple(manifest["x_shape"]), manifest["num_classes"])


class ClientHost:
    def __init__(
        self,
        store_path: str,
        task: str,
        algorithm: Algorithm,
        seed: int,
        client_ids: list[int],
        device: str = "cpu",
        eval_batch_size: int = 4096,
        test_per_client: int | None = None,
        kernels: Kernels = AUTO_KERNELS,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        data_seed: int | None = None,
    ):
        """``seed`` keys the clients' streams (the config's ``streams_seed``); ``data_seed``
        the matched test sets, as the driver draws them (the config's ``seed``; None:
        ``seed``)."""
        self.device = torch.device(device)
        self.client_ids = list(client_ids)  # pinned here: each client's state lives here
        self.store = ShardStore.open(store_path)
        self.seed = seed
        self.task = TASKS[task]
        model = build_model(self.store, task).to(self.device)
        self.kernels = kernels.resolve(self.task.model_name, self.device)
        self.vectorize = self.kernels.vectorize
        self.objective = ModelObjective(
            model,
            ParamLayout.of(model),
            self.task.augment_for(self.store.manifest.get("x_dtype", "float32")),
            channels_last=self.kernels.channels_last,
            autocast=autocast_dtype(kernels.precision, self.device),
        )
        self.algorithm = algorithm.bind(self.objective.layout)
        if self.vectorize or (  # torch.func's gradients: while the rows load, not in round 1
            self.algorithm.sample_dp is not None and auto_method(self.objective) == "vmap_grad"
        ):
            start_dynamo_import()
        self.eval_batch_size = eval_batch_size
        # Read from the store when sampled, kept up to a byte budget (actors/client_data.py).
        self.data = ClientDataCache(self.store, self._tensors, cache_bytes)
        self.data.preload(client_ids)
        self.client_state = ClientStateStore(self.device)  # c_i on disk, not in memory
        self._test_cache: dict[tuple[str, int, int], list] = {}
        # Per-client test sets in each hosted client's label mix (optional evaluation).
        self.client_tests = {}
        if test_per_client:
            sets = self.store.matched_test_sets(
                test_per_client, seed if data_seed is None else data_seed
            )
            self.client_tests = {
                cid: self._tensors(self.store.test_take(sets[cid])) for cid in client_ids
            }

    def _tensors(self, arrays) -> tuple[torch.Tensor, torch.Tensor]:
        """Model-ready tensors on this host's device (uint8 images → normalised float32)."""
        return (
            self.task.preprocess(torch.tensor(arrays.x, device=self.device)),
            torch.tensor(arrays.y, device=self.device),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.tensor(array, device=self.device)

    def run_round(
        self,
        round_index: int,
        broadcast: Broadcast,
        client_ids: list[int],
        nominal_cohort_size: float,
    ) -> PartialAggregate:
        """Train the given hosted clients and return their sum (one partial aggregate)."""
        params = self._to_device(broadcast.params)
        payload = {k: self._to_device(v) for k, v in broadcast.payload.items()}
        trained = self._train_vectorized(round_index, params, payload, client_ids, broadcast.warmup)
        if trained and batchable(self.algorithm):  # the clients' tails as one: same results
            results = [trained[cid] for cid in client_ids]
            sizes = [self.data.num_records(cid) for cid in client_ids]
            partial = sum_trained_clients(self.algorithm, params, results, client_ids, sizes)
        else:
            partial = self._run_clients(round_index, broadcast, params, payload, client_ids,
                                        nominal_cohort_size, trained)  # fmt: skip
        for report in partial.reports:  # what ran: the setting is not always possible
            report.stats["vectorized"] = float(report.client_id in trained)
        return partial.cpu()

    def _run_clients(
        self,
        round_index: int,
        broadcast: Broadcast,
        params: torch.Tensor,
        payload: dict[str, torch.Tensor],
        client_ids: list[int],
        nominal_cohort_size: float,
        trained: dict[int, LocalResult],
    ) -> PartialAggregate:
        """Each client's round, one after the other, its local training from ``trained`` where
        the clients trained together."""
        partial = PartialAggregate()
        noise = client_generators(
            self.seed, round_index, client_ids, Purpose.CLIENT_NOISE, device=params.device
        )
        for cid, noise_generator in zip(client_ids, noise, strict=True):
            x, y = self.data[cid]
            uploads, weight, state, report = client_round(
                self.algorithm,
                self.objective,
                params,
                payload,
                x,
                y,
                self.client_state.get(cid),
                self.seed,
                round_index,
                cid,
                nominal_cohort_size,
                warmup=broadcast.warmup,
                trained=trained.get(cid),
                noise_generator=noise_generator,
            )
            self.client_state.put(cid, state)
            if report.dropped:
                partial.add_noise_share(uploads)
            else:
                partial.add(uploads, weight)
            partial.reports.append(report)
        return partial

    def _train_vectorized(
        self,
        round_index: int,
        params: torch.Tensor,
        payload: dict[str, torch.Tensor],
        client_ids: list[int],
        warmup: bool,
    ) -> dict[int, LocalResult]:
        """The round's local training for all ``client_ids`` at once, where vectorising is on
        and it is the same computation (``algorithms.vectorized``); else {} (sequential). The
        streams are the sequential path's: each client's ``LOCAL_TRAINING`` batches and
        ``SAMPLE_NOISE`` DP-SGD noise; SCAFFOLD's c − c_i from its stored c_i (0 at a cold
        start). The authors' warm start (a missing c_i computed in the client's round) trains
        sequentially."""
        algorithm = self.algorithm
        if not self.vectorize or warmup or algorithm.warm_start == "authors_code":
            return {}
        trainer = algorithm.at_round(round_index).trainer
        sizes = [self.data.num_records(cid) for cid in client_ids]
        if len(client_ids) < 2 or min(sizes) == 0 or not vectorizable(trainer, self.objective):
            return {}
        seed, device = self.seed, params.device
        generators = client_generators(seed, round_index, client_ids, Purpose.LOCAL_TRAINING)
        noise = None
        if algorithm.sample_dp is not None and algorithm.sample_dp.noise_multiplier > 0:
            noise = client_generators(seed, round_index, client_ids, Purpose.SAMPLE_NOISE, device)
        corrections = None
        if algorithm.control_variates:
            corrections = self._corrections(payload["control"], client_ids)
        rows = self.data.rows(client_ids)
        results = train_clients(
            trainer, self.objective, params, rows, generators, corrections, noise
        )
        return dict(zip(client_ids, results, strict=True))

    def _corrections(self, server_control: torch.Tensor, client_ids: list[int]) -> torch.Tensor:
        """[n, d]: SCAFFOLD's c − c_i of every client, c_i = 0 where it has none yet."""
        zero = torch.zeros_like(server_control)
        controls = [self.client_state.get(cid).get("control", zero) for cid in client_ids]
        return local_correction(server_control, torch.stack(controls))

    def client_states(self) -> dict:
        """Per-client algorithm state (e.g. SCAFFOLD c_i) as arrays, for checkpoints."""
        return self.client_state.state_dict()

    def load_client_states(self, states: dict) -> None:
        self.client_state.load_state_dict(states)

    def _test_batches(
        self, start: int, stop: int, split: str = "test"
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This host's slice of the test (or validation) rows, loaded onto its device once and
        kept, like client data."""
        if (split, start, stop) not in self._test_cache:
            self._test_cache[(split, start, stop)] = [
                self._tensors(
                    self.store.held_out_rows(split, lo, min(lo + self.eval_batch_size, stop))
                )
                for lo in range(start, stop, self.eval_batch_size)
            ]
        return self._test_cache[(split, start, stop)]

    def evaluate(
        self, params: np.ndarray, start: int, stop: int, split: str = "test"
    ) -> EvalResult:
        """Loss and accuracy of ``params`` on rows [start, stop) of ``split`` (test, validation)."""
        return self._evaluate(params, self._test_batches(start, stop, split))

    def evaluate_clients(self, params: np.ndarray) -> EvalResult:
        """Loss and accuracy summed over the hosted clients' matched test sets."""
        return self._evaluate(params, list(self.client_tests.values()))

    def train_diagnostics(self, params: np.ndarray) -> TrainDiagnostics:
        """F_i(x) and ∇F_i(x) of every pinned client, summed (``TrainDiagnostics``)."""
        flat = self._to_device(params)
        # Sums kept on the device (float64), read once: no host sync per client.
        loss_sum, grad_sq_sum = (flat.new_zeros((), dtype=torch.float64) for _ in range(2))
        grad_sum = flat.new_zeros(flat.numel(), dtype=torch.float64)
        clients = 0
        self.objective.model.eval()  # dropout off: the objective itself, not a noisy estimate
        try:
            for cid in self.client_ids:
                x, y = self.data[cid]
                if len(y) == 0:  # no F_i (the central optimum leaves such clients out too)
                    continue
                clients += 1
                loss, _, grad = self.objective.loss_and_grad(flat, x, y)
                loss_sum += loss
                grad_sq_sum += torch.linalg.vector_norm(grad, dtype=torch.float64).square()
                grad_sum += grad
        finally:
            self.objective.model.train()
        return TrainDiagnostics(
            float(loss_sum), float(grad_sq_sum), grad_sum.cpu().numpy(), clients
        )

    def _evaluate(self, params: np.ndarray, batches: list) -> EvalResult:
        return evaluate_batches(self.objective, self._to_device(params), batches)


@torch.no_grad()
def evaluate_batches(objective: ModelObjective, flat: torch.Tensor, batches) -> EvalResult:
    """Summed cross-entropy and correct predictions of the flat parameters ``flat`` over
    ``(x, y)`` batches, dropout off; the model's own parameters and mode are left as they were."""
    loss_sum, correct, count = 0.0, 0, 0
    model = objective.model
    was_training = model.training
    model.eval()
    try:
        for x, y in batches:
            logits = objective.logits(flat, x)
            loss_sum += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
            count += len(y)
    finally:
        model.train(was_training)
    return EvalResult(loss_sum, correct, count)
