"""The driver's round loop: it holds the server state, the accountant and the RNG.

One round (DESIGN §3): sample the cohort → charge the accountant (its ε is computed on a
thread meanwhile) → broadcast → executor returns the cohort's sum → server rule (noise, mean,
server lr, control variates) → evaluate → the round's ε → report.

Losing hosts mid-run (a Ray node dies: ``HostsLost``): the driver waits until Ray has restarted
the lost actors on surviving nodes (they read their clients' shards from the store again), rolls
back and recomputes. An algorithm without client state rolls back to the start of the lost
round (a round is a pure function of the broadcast and the seeds). One with client state
(SCAFFOLD's c_i) rolls back to its last checkpoint, whose state the driver keeps (``state_dict``
is what a checkpoint saves): server state, accountant and every client's state, loaded on every
actor, the restarted and the surviving ones alike (whose c_i moved on since), so no c_i is ever
reset or mixed with a later round's; the rounds since are replayed. Randomness is keyed by
(seed, round, client): the run ends bit-identical, ε included, to an uninterrupted one.

A loss is recovered from wherever the driver meets it: in a round, while reporting a round
(``on_round``: a periodic checkpoint asks every host for its clients' states), in the final
checkpoint (``run``'s ``finish``), or as a restarted actor's refusal (``ClientStatesLost``, an
actor whose node died while it had no call). The driver's side is rolled back first, so that
when the hosts cannot come back (``HostsUnavailable``) or a stop signal ends the wait, the run
is at its last valid point and ``state_dict`` gives it without asking any host.

Memory: the roll-back point of a run with client state is the last checkpoint's state, kept
by the driver until the next: every client's state that has one (SCAFFOLD: d floats per client
that has trained, 4·d·M bytes for M clients: 0.5 GB at FEMNIST scale, 3,400 clients of the
36,895-parameter logistic regression). It is kept only for an executor that can lose hosts
(``can_lose_hosts``: Ray's, not the in-process one).
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from actors.client_host import Broadcast
from actors.client_state import ClientStateStore
from algorithms.client import upload_bytes
from algorithms.layout import ParamLayout
from algorithms.rng import Purpose, torch_generator
from algorithms.server import ServerContext, ServerState
from cluster.claims.privacy_plan import privacy_claim
from cluster.config import ExperimentConfig
from cluster.runtime.cohort import sample_cohort
from cluster.runtime.executors import MAX_RESTARTS, HostsLost, HostsUnavailable
from cluster.runtime.initial_state import initial_params, initial_state
from cluster.runtime.interrupts import RoundDropped, StopSignals
from cluster.runtime.records import RoundRecord
from cluster.runtime.round_metrics import byte_budget_spent, round_metrics
from cluster.runtime.stream_key import saved_key
from datasets.store import ShardStore


@dataclass
class Recovery:
    """One loss of hosts during a run, and the run's way back (times from the driver's
    detection of the loss, ``time.monotonic``)."""

    round: int  # the round (1-based) that was lost, recomputed
    hosts: list[int]  # the actors lost
    rolled_back_to: int  # rounds done at the state the run went back to
    detected_at: float
    restart_s: float = math.nan  # until every actor answered again, states restored
    seconds: float = math.nan  # until the lost round was recomputed: restart + replay

    @property
    def rounds_replayed(self) -> int:
        """Rounds computed again, the lost one included."""
        return self.round - self.rolled_back_to


@dataclass
class SimulationResult:
    params: torch.Tensor
    history: list[RoundRecord]
    stop_reason: str
    recoveries: list[Recovery] = field(default_factory=list)


class Simulation:
    def __init__(
        self, config: ExperimentConfig, store: ShardStore, executor, streams: int | None = None
    ):
        """``streams``: the key of the run's streams (``stream_key.streams_key``, the key
        ``executor``'s hosts were given; None: the config's seed)."""
        self.config = config
        self.store = store
        self.executor = executor
        self.streams = config.streams_seed if streams is None else streams
        self.model, params = initial_params(config, store)
        self.layout = ParamLayout.of(self.model)
        self.algorithm, self.state = initial_state(config, self.layout, params)
        # Every ε of the run comes from this claim, read off the mechanism that runs.
        self.claim = privacy_claim(config, self.algorithm, store.client_sizes)
        self.accountant = self.claim.new_accountant()
        # The round's ε and its server noise are computed here while the round trains.
        self._background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="round-background")
        self.history: list[RoundRecord] = []
        self._optimum: Future | None = None  # F(x*) for eval_train, found in the background
        self._accounting: Future | None = None  # the round in progress's ε
        # Where a loss of hosts rolls a run with client state back to: the last checkpoint's
        # state (``state_dict``), or the one loaded; kept only where hosts can be lost.
        self._checkpointed: dict | None = None
        # Client states the hosts must get back before they are asked for any (a roll-back
        # whose wait for the hosts was cut short): ``state_dict`` gives these meanwhile.
        self._states_owed: dict | None = None
        self.recoveries: list[Recovery] = []
        if config.eval_train:  # on a thread of its own: the round's noise and ε keep theirs
            decay = self.algorithm.trainer.weight_decay
            finder = ThreadPoolExecutor(1, thread_name_prefix="central-optimum")
            self._optimum = finder.submit(executor.central_optimum, config.task, decay)
            finder.shutdown(wait=False)

    def _budget_exhausted(self) -> str | None:
        target = self.config.privacy.target_epsilon
        if self.accountant is None or target is None:
            return None
        nxt = self.claim.epsilon_after(self.accountant, len(self.history))
        if nxt > target:
            return (
                f"privacy budget: round {len(self.history) + 1} would reach ε={nxt:.3f} "
                f"> target ε={target:g} at δ={self.claim.delta:g}"
            )
        return None

    def _bytes_spent(self) -> str | None:
        """Why no further round runs under ``stop_at_bytes`` (None: bytes left, or no budget):
        checked before each round, so a resumed run that spent its budget runs none."""
        last = self.history[-1].metrics if self.history else None
        return byte_budget_spent(self.config, last, len(self.history))

    def run_round(self, round_index: int, check: Callable[[], None] = lambda: None) -> RoundRecord:
        """One round; ``check`` is polled while the clients train and once after, before their
        result is applied (it may raise to leave the round)."""
        c = self.config
        start = time.perf_counter()
        self.executor.between_rounds()
        cohort = sample_cohort(
            c.cohort.sampling, c.data.num_clients, c.cohort.size, self.streams, round_index
        )
        warmup = round_index < c.warmup_rounds
        algorithm = self.algorithm.at_round(round_index)
        algorithm = algorithm.with_state(self.state.extras)
        server_only = algorithm.server.server_only
        payload = {k: v.numpy() for k, v in self.state.extras.items() if k not in server_only}
        broadcast = Broadcast(self.state.params.numpy(), payload, warmup=warmup)
        accounting = self._accounting = self._account_while_training(round_index)
        # The server's noise depends on the round and σ only: drawn while the clients train.
        context = self._background.submit(self._server_context, algorithm, round_index)
        total = self.executor.run_round(round_index, broadcast, cohort, float(c.cohort.size), check)
        if not self.keeps_client_state:  # a round polled on no thread can still be dropped;
            check()  # a SCAFFOLD round whose c_i are updated is kept, even on a second signal
        ctx = context.result()
        before = self.state.params
        if warmup:  # c_i⁰ only: x stays x⁰
            step = algorithm.server.control_step(self.state, total, ctx)
        else:
            step = algorithm.server_step(self.state, total, ctx)
        self.state = finite_step(step, round_index)
        record = RoundRecord(round_index + 1, 0.0, len(cohort), metrics=round_metrics(total))
        record.update_norms = array("f", [r.pre_clip_norm for r in total.reports if not r.dropped])
        record.metrics["warmup"] = float(warmup)
        record.metrics["local_lr"] = algorithm.trainer.lr
        model_bytes = broadcast.params.nbytes
        if algorithm.server.sparse_broadcast:  # clients apply the sparse Δ to their copy
            model_bytes = upload_bytes(self.state.params - before)
        record.metrics["download_bytes"] = float(
            model_bytes + sum(a.nbytes for a in broadcast.payload.values())
        )
        # Every byte so far, both ways (the sampled clients each download): accuracy against
        # communication, DPSFL's Fig. 5, reads off this.
        sent = record.metrics.get("upload_bytes_total", 0.0)
        sent += record.metrics["download_bytes"] * len(cohort)
        before = self.history[-1].metrics.get("communication_bytes", 0.0) if self.history else 0.0
        record.metrics["communication_bytes"] = before + sent
        if "clip_norm" in self.state.extras:
            record.metrics["clip_norm"] = float(self.state.extras["clip_norm"][0])
        spent = byte_budget_spent(c, record.metrics, round_index + 1)
        last = round_index + 1 == c.total_rounds or spent is not None  # evaluated, as the last
        if not warmup and ((round_index + 1) % c.eval_every == 0 or last):
            result = self.executor.evaluate(self.state.params.numpy())
            record.test_accuracy = result.correct / max(result.count, 1)
            record.test_loss = result.loss_sum / max(result.count, 1)
            if self.store.num_validation:  # data.validation's held-out rows, scored alike
                held = self.executor.evaluate(self.state.params.numpy(), "validation")
                record.metrics["validation_accuracy"] = held.correct / max(held.count, 1)
                record.metrics["validation_loss"] = held.loss_sum / max(held.count, 1)
            if c.data.test_per_client:
                local = self.executor.evaluate_clients(self.state.params.numpy())
                record.metrics["client_test_accuracy"] = local.correct / max(local.count, 1)
                record.metrics["client_test_loss"] = local.loss_sum / max(local.count, 1)
            if c.eval_train:
                record.metrics.update(self._train_diagnostics(algorithm))
            if "train_accuracy" in record.metrics:
                record.metrics["train_test_gap"] = (
                    record.metrics["train_accuracy"] - record.test_accuracy
                )
        if accounting is not None:
            record.epsilon, vs_server = accounting.result()
            if vs_server is not None:
                record.metrics["epsilon_vs_server"] = vs_server
        record.seconds = time.perf_counter() - start
        return record

    def _train_diagnostics(self, algorithm) -> dict[str, float]:
        """DP-SCAFFOLD's diagnostics at the new model x over all M clients' training data: the
        objective F(x) = (1/M) Σ_i F_i(x) + (λ/2)‖x‖² (λ: the local weight decay, the paper's
        ℓ2 term) and the gradient dissimilarity (1/M) Σ_i ‖∇F_i(x)‖² − ‖(1/M) Σ_i ∇F_i(x)‖²
        (λx is common to all clients and cancels there)."""
        params = self.state.params
        found = self.executor.train_diagnostics(params.numpy())
        m = max(found.clients, 1)
        decay = algorithm.trainer.weight_decay
        l2 = 0.5 * decay * float(params.double().square().sum()) if decay else 0.0
        mean_grad = found.grad_sum / m
        metrics = {
            "train_objective": found.loss_sum / m + l2,
            "gradient_dissimilarity": found.grad_sq_sum / m - float(mean_grad @ mean_grad),
        }
        optimum = self._optimum.result()  # a convex task's F(x*); None: none to compare with
        if optimum is not None and metrics["train_objective"] > optimum:
            # the paper's train-loss gap
            metrics["train_loss_gap_log10"] = math.log10(metrics["train_objective"] - optimum)
        return metrics

    def _account_while_training(self, round_index: int) -> Future | None:
        """Charge round ``round_index`` now and compute the ε it brings on a thread while the
        round trains (PLD accounting takes a good part of a second): the charge depends on the
        round's σ and q only, never on what the clients send, and nothing else touches the
        accountant until the round has waited for the result."""
        if self.accountant is None:
            return None
        self.claim.charge(self.accountant, round_index)

        def epsilons() -> tuple[float, float | None]:
            eps = self.accountant.epsilon(self.claim.delta)
            return eps, self.claim.epsilon_vs_server(round_index + 1)

        return self._background.submit(epsilons)

    def _server_context(self, algorithm, round_index: int) -> ServerContext:
        """The round's server-placed noise (on the sum, and on the adaptive clip's count)."""
        c = self.config
        noise = algorithm.pipeline.server_noise(
            self.state.params.numel(),
            self.layout,
            (self.streams, round_index),
            torch_generator(self.streams, round_index, Purpose.SERVER_NOISE),
        )
        count_noise = 0.0
        adaptive = algorithm.adaptive_clip
        if adaptive is not None and algorithm.mechanism.placement == "server":
            generator = torch_generator(self.streams, round_index, Purpose.SERVER_COUNT_NOISE)
            std = adaptive.server_noise_std(c.cohort.size, algorithm.mechanism.noise_scale)
            count_noise = std * float(torch.randn(1, generator=generator, dtype=torch.float64))
        return ServerContext(float(c.cohort.size), c.data.num_clients, noise, count_noise)

    def _server_point(self) -> dict:
        """The driver's state now, for a roll-back: server state and accountant (the history
        is kept as its first ``rounds_done`` records: rounds are appended, never changed)."""
        return {
            "rounds_done": len(self.history),
            "params": self.state.params.clone(),
            "extras": {k: v.clone() for k, v in self.state.extras.items()},
            "accountant": self.accountant.state_dict() if self.accountant else None,
        }

    def state_dict(self) -> dict:
        """Everything needed to continue bit for bit (randomness is keyed by round, not state).
        With client state and an executor that can lose hosts, also the point a loss of hosts
        rolls the run back to: this is what a checkpoint saves, and the driver keeps it until
        the next (the module's docstring: its memory)."""
        state = {
            **self._server_point(),
            "history": [asdict(r) for r in self.history],
            "client_states": self._client_states(),
            **saved_key(self.config, self.streams),
        }
        if self._keeps_rollback_point:
            self._checkpointed = state
        return state

    def _client_states(self) -> dict:
        """Every client's state: none without client state (a stopped run's checkpoint then
        needs no host, which a signal to the whole process group may have ended), those owed
        to the hosts after a cut-short roll-back, else the hosts'."""
        if not self.keeps_client_state:
            return ClientStateStore.merge([])
        if self._states_owed is not None:
            return self._states_owed
        return self.executor.client_states()

    @property
    def _keeps_rollback_point(self) -> bool:
        return self.keeps_client_state and self.executor.can_lose_hosts

    def load_state_dict(self, state: dict) -> None:
        self.history = [RoundRecord(**r) for r in state["history"]]
        self._rewind(state)
        self._pay_states()
        if self._keeps_rollback_point:
            self._checkpointed = state

    def _rewind(self, point: dict) -> None:
        """The driver back to ``point`` (``_server_point``, or a ``state_dict``): server state,
        accountant and history. Touches no host: a ``state_dict``'s client states are owed to
        them (``_pay_states``)."""
        params, extras = point["params"].clone(), {k: v.clone() for k, v in point["extras"].items()}
        self.state = ServerState(params, extras)
        if self.accountant is not None:
            self.accountant.load_state_dict(point["accountant"])
        del self.history[point["rounds_done"] :]
        if "client_states" in point and self.keeps_client_state:
            self._states_owed = point["client_states"]

    def _pay_states(self) -> None:
        """The owed client states loaded on every host, survivors and restarted alike."""
        if self._states_owed is not None:
            self.executor.load_client_states(self._states_owed)
            self._states_owed = None

    def _first_point(self) -> dict:
        """The first roll-back point of a run with client state: a fresh run's round 0 needs no
        host (no client has a state before its first round), a run already under way asks its
        hosts."""
        if self.history:
            return self.state_dict()
        return {
            **self._server_point(),
            "history": [],
            "client_states": ClientStateStore.merge([]),
        }

    def _end_reason(self, stop: StopSignals | None) -> str | None:
        """Why no further round runs, or None."""
        if len(self.history) >= self.config.total_rounds:
            reason = f"completed {self.config.rounds} rounds"
            if self.config.warmup_rounds:
                reason += f" after {self.config.warmup_rounds} warm-up rounds"
            return reason
        if stop and stop.reason:
            return f"{stop.reason} after round {len(self.history)}"
        return self._budget_exhausted() or self._bytes_spent()

    def run(
        self,
        on_round: Callable[[RoundRecord], None] = lambda r: None,
        stop: StopSignals | None = None,
        say: Callable[[str], None] = lambda message: None,
        finish: Callable[[], None] = lambda: None,
    ) -> SimulationResult:
        """Run the remaining rounds, then ``finish`` (the final checkpoint). ``stop`` (a
        command's stop signals) ends the run early: checked before each round, and polled while
        a round waits for its clients, where it can drop the round if the algorithm keeps no
        client state (the driver then stays at the last completed round) or abandon it after a
        second signal, and while a recovery waits for its hosts (the run ends at the point it
        rolled back to). A loss of hosts in a round, in ``on_round`` or in ``finish`` is
        recovered from (the module's docstring), ``MAX_RESTARTS`` times at most; ``say`` gets
        a line when it happens and one when the run is back where it was."""
        if self._keeps_rollback_point and self._checkpointed is None:
            self._checkpointed = self._first_point()  # round 0's, or the resumed round's
        stop_reason = None  # once the rounds are over
        while True:
            round_index = len(self.history)
            point = None if self.keeps_client_state else self._server_point()
            try:
                stop_reason = stop_reason or self._end_reason(stop)
                if stop_reason is not None:
                    finish()
                    if self.accountant is not None:  # the ε's accountant (after a fallback)
                        self.claim = self.claim.reported_by(self.accountant)
                    return SimulationResult(
                        self.state.params, self.history, stop_reason, self.recoveries
                    )
                record = self._round_or_drop(round_index, stop)
                self.history.append(record)
                self._recovered(record, say)
                on_round(record)
            except RoundDropped:
                stop_reason = f"{stop.reason} during round {round_index + 1} (dropped)"
            except HostsLost as lost:  # (before ``Exception``: a loss is recovered from)
                # the round lost: the one in progress, or the last completed one (its report
                # or the final checkpoint)
                lost_round = round_index if stop_reason is not None else round_index + 1
                point = self._checkpointed if self.keeps_client_state else point
                stop_reason = None
                try:
                    self._recover(lost_round, lost, point, say, stop)
                except RoundDropped:  # a stop signal while waiting for the hosts
                    stop_reason = (
                        f"{stop.reason} while lost hosts were restarted (back at round "
                        f"{len(self.history)})"
                    )
            except Exception:
                # A round that failed before its record was kept (a client's or the server's
                # error, an evaluation's): without client state the driver goes back to the
                # last completed round, which a checkpoint can then keep (``run_experiment``).
                if point is not None and len(self.history) == point["rounds_done"]:
                    self._back_to(point)
                raise

    def _back_to(self, point: dict) -> None:
        """The driver at ``point`` again, once the round's background ε is done with the
        accountant."""
        if self._accounting is not None:
            self._accounting.exception()
        self._rewind(point)

    def _recover(
        self, lost_round: int, lost: HostsLost, point: dict, say, stop: StopSignals | None
    ) -> None:
        """After ``lost`` in round ``lost_round``: roll the driver back to ``point``, wait for
        the restarted hosts, give every host the point's client states. Each loss is one
        ``Recovery``, also one during the wait or the restore, and each counts towards
        ``MAX_RESTARTS``. A first stop signal during the wait raises ``RoundDropped``, a second
        ``Interrupted``; ``HostsUnavailable`` when the hosts cannot come back. Either way the
        driver is at ``point`` and ``state_dict`` needs no host."""
        self._back_to(point)
        if len(self.recoveries) == MAX_RESTARTS:
            raise HostsUnavailable(
                f"executor: hosts lost {MAX_RESTARTS + 1} times in this run ({lost}); resume "
                "the run once the cluster is healthy"
            ) from lost
        recovery = Recovery(lost_round, lost.hosts, point["rounds_done"], lost.detected_at)
        self.recoveries.append(recovery)
        say(
            f"round {lost_round}: {lost}; waiting for Ray to restart them, then back to "
            f"round {point['rounds_done']}"
        )
        try:
            self.executor.await_hosts(check=_wait_check(stop))
            self._pay_states()
        except HostsLost as again:
            self._recover(lost_round, again, point, say, stop)
            return
        recovery.restart_s = time.monotonic() - recovery.detected_at
        replay = (
            f"recomputing rounds {point['rounds_done'] + 1}-{lost_round}"
            if point["rounds_done"] < lost_round
            else "nothing to recompute"
        )
        if point["rounds_done"] >= lost_round:  # lost after the round, which stands
            recovery.seconds = recovery.restart_s
        say(
            f"actors running again after {recovery.restart_s:.1f} s "
            f"({self.executor.describe_placement()}); {replay}"
        )

    def _recovered(self, record: RoundRecord, say) -> None:
        """Once ``record`` is the last lost round, recomputed: the recovery's time, on the
        terminal and as the round's ``recovery_seconds`` and ``rounds_replayed`` metrics."""
        recovery = self.recoveries[-1] if self.recoveries else None
        if recovery is None or record.round != recovery.round or not math.isnan(recovery.seconds):
            return
        recovery.seconds = time.monotonic() - recovery.detected_at
        record.metrics["recovery_seconds"] = recovery.seconds
        record.metrics["rounds_replayed"] = float(recovery.rounds_replayed)
        say(
            f"recovered from the loss in round {recovery.round} in {recovery.seconds:.1f} s "
            f"(restart {recovery.restart_s:.1f} s, {recovery.rounds_replayed} rounds replayed)"
        )

    @property
    def keeps_client_state(self) -> bool:
        """Whether clients keep state on their hosts (SCAFFOLD's c_i), changed as rounds run."""
        return self.algorithm.control_variates

    def _round_or_drop(self, round_index: int, stop: StopSignals | None) -> RoundRecord:
        """Round ``round_index``, ``stop.check_round`` polled while its clients train. A
        ``RoundDropped`` comes before the round's result is applied: the accountant's charge
        for it is taken back and nothing else changed."""
        if stop is None:
            return self.run_round(round_index)
        if self.keeps_client_state:
            return self.run_round(round_index, stop.check_round)
        accountant = self.accountant.state_dict() if self.accountant is not None else None
        try:
            with stop.droppable():
                return self.run_round(round_index, stop.check_round)
        except RoundDropped:
            if self._accounting is not None:  # its ε is being computed from the accountant
                self._accounting.exception()
            if accountant is not None:
                self.accountant.load_state_dict(accountant)
            raise


class NonFiniteModel(RuntimeError):
    """A round's server step left the model with an inf or NaN parameter: float32 overflowed."""


def finite_step(state: ServerState, round_index: int) -> ServerState:
    """``state``, the server step of round ``round_index`` (0-based), if every number it keeps
    (the parameters and each extra: momentum, SCAFFOLD's c, a sketch's tables) is finite; else
    ``NonFiniteModel``, before the driver takes it (a run on an inf model would go on
    evaluating and reporting an ε for a model that is no longer one, and an inf momentum or c
    reaches the parameters a round later, after a checkpoint had kept it)."""
    for name, tensor in {"parameters": state.params, **state.extras}.items():
        finite = torch.isfinite(tensor)
        if bool(finite.all()):
            continue
        bad = tensor.numel() - int(finite.sum())
        raise NonFiniteModel(
            f"round {round_index + 1}: the server step left {bad} of the {tensor.numel()} "
            f"numbers of its {name} inf or NaN (float32 overflowed): lower algorithm.local.lr, "
            "algorithm.server_lr, algorithm.noise_multiplier or algorithm.clip_norm; the run "
            f"stopped at round {round_index}"
        )
    return state


def _wait_check(stop: StopSignals | None) -> Callable[[], None] | None:
    """What a recovery polls while it waits for its hosts: a second stop signal is
    ``Interrupted`` (``check_round``), a first ends the wait (``RoundDropped``)."""
    if stop is None:
        return None

    def check() -> None:
        stop.check_round()
        if stop.reason is not None:
            raise RoundDropped

    return check
