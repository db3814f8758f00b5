"""Run many experiments ("trials") at once on Ray: the engine of ``sweep`` and ``compare
--concurrent``.

Each trial is one ``run_experiment`` in a Ray task of its own, inside a placement group that
reserves the trial's driver and its actors together: bundle 0 is the driver (a fraction of a
CPU, ``DRIVER_CPU``: it only aggregates and accounts), bundles 1..n its actors
(``executor.cpus_per_actor``/``gpus_per_actor`` each; ``RayExecutor`` puts actor i in bundle
i + 1). A trial with ``executor.kind: local`` trains in its driver, which then reserves the
hosts' CPUs itself. As many trials run at once as the cluster's CPUs/GPUs hold
(``concurrent`` caps it further): two single-actor trials on 2 CPUs where the actor takes
0.75 CPU (``executor.cpus_per_actor``; torch still gives it one thread), so that a trial
reserves one CPU in all.

Plain Ray tasks, not Ray Tune: a Tune function trainable runs in a thread of its trial actor
(``ray.tune.trainable.function_trainable``'s ``RunnerThread``), where a run cannot install its
stop-signal handlers, and Tune's own SIGINT handler ends trials by killing their actors: a
stopped trial would leave no checkpoint and an MLflow run that stays RUNNING. A task runs on
its worker's main thread, so ``ray.cancel`` (which interrupts that thread as a SIGINT would)
stops a trial the way Ctrl-C stops ``cluster run``: after its round, with its checkpoint, its
run KILLED. Tune's search spaces, trial bookkeeping and resume (by its own experiment folder)
are not needed either: the sweep samples its own seeded space and resumes from its ledger
(MLflow, or its own folder where tracking is off: ``sweep_ledger``).

Trials write to one MLflow store at once: a SQLite store gets one writer, an ``mlflow server``
on loopback in front of it (``cluster.tracking.server``), for the whole run of trials.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.config import ConfigError, ExperimentConfig

if TYPE_CHECKING:
    from datasets.locations import Location

DRIVER_CPU = 0.25  # a trial's driver: aggregation, noise, accounting, the tracking calls
POLL_S = 0.2  # how often the engine looks for finished trials and stop signals
ABANDON_WAIT_S = 60.0  # after a second stop signal: how long running trials may take to end
# The sweep's own MLflow server (``cluster.tracking.server``) answers a log_batch in ms, but at
# load 20 on 2 cores it took over the 4 s a try that ``cluster.tracking.process.HTTP_RETRY_BUDGET``
# gives a remote server (both trials of a test failed so): a try gets a minute there.
OWN_SERVER, OWN_SERVER_TIMEOUT_S = "http://127.0.0.1:", "60"


def calibrate(config: ExperimentConfig, say: Callable[[str], None]) -> ExperimentConfig:
    """σ or the rounds for the budget (``privacy.calibrate``), as the run will use them."""
    from cluster.claims.calibration import calibrate_with_message

    return calibrate_with_message(config, say)


class RecordingFailed(RuntimeError):
    """``on_submit`` or ``on_done`` (recording a trial's start or end) raised: no trial was
    submitted after it, the trials submitted whose placement group was not created yet were
    cancelled, and the trials placed by then ran to their end, each recorded where it could be
    (``RayTrials``). ``failures``: each ``name: recording its start/end failed (error)``;
    ``not_started``: the trials that never ran (not submitted, or cancelled before their group
    was created); ``stopped_starting``: those cancelled so whose group was created before they
    ended (each may have started, and is recorded as a trial that ran)."""

    def __init__(self, failures: list[str], not_started: int, stopped_starting: int):
        self.failures = failures
        stopped = f", {stopped_starting} stopped while starting" if stopped_starting else ""
        super().__init__(
            f"{'; '.join(failures)}; no trial started after that ({not_started} not started"
            f"{stopped}), the others running then ran to their end"
        )


class RunsFailed(RuntimeError):
    """Runs that did not finish, each ``name: status error`` (``compare --concurrent``)."""

    def __init__(self, lines: list[str]):
        super().__init__(f"{len(lines)} run(s) did not finish: " + "; ".join(lines))


@dataclass(frozen=True)
class Trial:
    name: str  # its MLflow run's name, and how progress lines call it
    config: ExperimentConfig  # calibrated: as it runs
    # The checkpoint of the trial's KILLED run to continue that run from (the sweep's
    # ``sweep_resume``: checked against ``config``); None: a new run from round 0.
    resume: Location | None = None
    seconds_before: float = 0.0  # what the attempts it continues ran (``resume``'s: killed)


@dataclass
class TrialResult:
    trial: Trial
    outcome: object | None = None  # cluster.runtime.experiment.Outcome
    error: str | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)  # what a caller adds (the sweep's records)
    # False: stopped while its placement group waited for resources, so it never ran
    started: bool = True
    # True: stopped with rounds it completed in no checkpoint, or how many unknown (a second
    # stop signal abandoned its round before they were checkpointed; a forced cancel)
    abandoned: bool = False
    run_id: str | None = None  # its MLflow run where it has no outcome (a second cancel)

    @property
    def status(self) -> str:
        """FINISHED, KILLED (a stop signal ended it: its checkpoint holds every round it ran,
        so it may be continued), ABANDONED (``abandoned``: never continued), FAILED (its
        error), or NOT RUN (``started`` False: stopped before its placement group was
        created)."""
        if not self.started:
            return "NOT RUN"
        if self.abandoned:
            return "ABANDONED"
        if self.outcome is None:
            return "FAILED" if self.error is not None else "KILLED"
        return "KILLED" if self.outcome.interrupted else "FINISHED"


def bundles(config: ExperimentConfig) -> list[dict[str, float]]:
    """The trial's placement-group bundles: its driver, then one per actor."""
    e = config.executor
    actor = {"CPU": e.cpus_per_actor} | ({"GPU": e.gpus_per_actor} if e.gpus_per_actor else {})
    if e.kind == "local":  # the hosts train in the driver's process
        return [{name: amount * e.num_actors for name, amount in actor.items()}]
    return [{"CPU": DRIVER_CPU}, *[dict(actor) for _ in range(e.num_actors)]]


def resources_needed(trials: Iterable[Trial]) -> dict[str, float]:
    """The CPUs and GPUs the trials' bundles take together."""
    shapes = [bundles(trial.config) for trial in trials]
    return {r: sum(b.get(r, 0.0) for shape in shapes for b in shape) for r in ("CPU", "GPU")}


def fit_in(needed: dict[str, float], total: dict[str, float]) -> bool:
    """Whether ``needed`` (``resources_needed``) fits in the cluster's ``total``."""
    return all(need <= total.get(r, 0.0) + 1e-9 for r, need in needed.items())


def check_fits(
    trials: Iterable[Trial], total: dict[str, float], nodes: list[dict[str, float]]
) -> None:
    """A trial whose bundles the cluster cannot hold would wait for good: refused first, both
    where they exceed the cluster's ``total`` and where one bundle fits on none of its
    ``nodes`` (each node's resources: a bundle is placed on one node)."""
    for trial in trials:
        e = trial.config.executor
        shape = f"{e.num_actors} actors × {e.cpus_per_actor:g} CPU, {e.gpus_per_actor:g} GPU"
        for resource, need in resources_needed([trial]).items():
            if not fit_in({resource: need}, total):
                raise ConfigError(
                    "executor",
                    shape,
                    f"trial {trial.name} needs {need:g} {resource} (its driver "
                    f"{DRIVER_CPU:g} CPU and its actors) but the Ray cluster has "
                    f"{total.get(resource, 0.0):g}; lower executor.num_actors or "
                    "executor.cpus_per_actor / gpus_per_actor",
                )
        for bundle in bundles(trial.config):
            if not any(fit_in(bundle, node) for node in nodes):
                largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)))
                raise ConfigError(
                    "executor",
                    shape,
                    f"trial {trial.name} needs {_bundle_text(bundle)} on one node, and no node "
                    f"of the Ray cluster has it (the largest: {_bundle_text(largest)}); lower "
                    "executor.cpus_per_actor / gpus_per_actor (a local executor's hosts share "
                    "one bundle: also executor.num_actors)",
                )


def _bundle_text(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(r, 0.0):g} {r}" for r in ("CPU", "GPU"))


def _error_text(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:500]


def run_one(trial: Trial, parent_run_id: str | None, uri: str | None) -> TrialResult:
    """One trial, here (in a Ray task's worker, or in process): its outcome or its error. A
    trial with ``resume`` continues its run from that checkpoint."""
    if uri is not None:
        os.environ["MLFLOW_TRACKING_URI"] = uri  # tracking_uri() reads it at the run's opening
    if uri is not None and uri.startswith(OWN_SERVER):  # cluster.tracking.server's: alive, but slow
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", OWN_SERVER_TIMEOUT_S)  # when busy
    from cluster.runtime.checkpoint import load_checkpoint
    from cluster.runtime.experiment import run_experiment
    from cluster.runtime.interrupts import Interrupted

    start = time.perf_counter()
    try:
        resume = None if trial.resume is None else load_checkpoint(trial.resume)
        outcome = run_experiment(
            trial.config, resume=resume, calibrate=False, parent_run_id=parent_run_id
        )
    except Interrupted as error:  # a second cancel: KILLED, or ABANDONED where rounds it ran
        seconds = time.perf_counter() - start  # are in no checkpoint (a rerun never continues it)
        abandoned = error.unsaved_rounds > 0
        return TrialResult(trial, seconds=seconds, abandoned=abandoned, run_id=error.run_id)
    except Exception as error:  # recorded; the other trials go on
        return TrialResult(trial, error=_error_text(error), seconds=time.perf_counter() - start)
    return TrialResult(trial, outcome, seconds=time.perf_counter() - start)


def run_in_process(
    trials: list[Trial], parent_run_id: str | None, on_done: Callable[[TrialResult], None]
) -> list[TrialResult]:
    """Trials one after another in this process (``compare`` without ``--concurrent``): an
    error ends the command, as a stop signal does once its trial has written its checkpoint."""
    import signal

    from cluster.runtime.experiment import run_experiment
    from cluster.runtime.interrupts import Interrupted, StopSignals
    from cluster.tracking.process import prestart as prestart_tracking

    results = []
    for index, trial in enumerate(trials):
        start = time.perf_counter()
        # This run's tracking process, and the next run's, loading while this one trains.
        tracked = [t.config.tracking.enabled for t in trials[index : index + 2]]
        prestart_tracking(sum(tracked) if tracked[0] else 0)
        outcome = run_experiment(trial.config, calibrate=False, parent_run_id=parent_run_id)
        if outcome.interrupted:
            active = StopSignals.active()  # None where no command installed them
            raise Interrupted(
                active.signum if active is not None else signal.SIGINT,
                f"{trial.name}: {outcome.result.stop_reason} (checkpoint {outcome.checkpoint}); "
                f"the {len(trials) - index - 1} runs after it were not started",
            )
        results.append(TrialResult(trial, outcome, seconds=time.perf_counter() - start))
        on_done(results[-1])
    return results


@dataclass
class Submitted:
    """A trial whose task was submitted at ``start``, in its placement ``group``; ``withheld``:
    cancelled after a recording failed, its group not created then (``RayTrials._withhold``)."""

    trial: Trial
    group: object
    start: float
    withheld: bool = False


class RayTrials:
    """Trials as Ray tasks in placement groups (see the module doc), at most ``concurrent`` at
    once (0: as many as the cluster holds). ``on_submit`` (where given) is called with each
    trial before its task is submitted, since the task may run from then on: where it raises,
    the trial is not submitted. A trial is submitted only once its bundles fit in the cluster's
    CPUs and GPUs beside those of the trials running (``_has_room``); it may still wait for its
    placement group (the bundles packed on a node, Ray's other work). ``on_done`` is called in
    this thread as each submitted trial ends; ``TrialResult.started`` False where its placement
    group was never created (it never ran: the GCS's word, asked once the trial ended).

    A first stop signal (``StopSignals`` in its rounds phase) cancels every running trial: each
    stops after its round and writes its checkpoint (one still waiting for its group never
    runs); no new trial starts (nor is one submitted after it, even within a pass that submits
    many), and ``run`` raises ``Interrupted`` once they have ended. A second one cancels them
    again (each abandons its round: ABANDONED where rounds it completed are in no checkpoint,
    ``run_one``) and waits ``ABANDON_WAIT_S`` at most, then cancels those left by force (each
    ABANDONED: the rounds it ran past its checkpoint are unknown).

    An exception in ``on_submit`` or ``on_done`` is kept, not raised at once: no trial is
    submitted after it (nor the one whose ``on_submit`` raised), those submitted whose placement
    group is not created yet are cancelled (``_withhold``), the trials placed by then run to
    their end and each is passed to ``on_done``, then ``run`` raises ``RecordingFailed`` (or,
    where a stop signal came meanwhile, ``Interrupted``, naming the failures too). Any other
    exception (Ray's, the GCS's, a launch's) is raised again once the running trials were
    cancelled and have ended, each passed to ``on_done`` (``_drain``)."""

    def __init__(self, concurrent: int, parent_run_id: str | None, uri: str | None):
        import ray

        from cluster.runtime.code_shipping import remote_function

        self._ray = ray
        self.concurrent = concurrent
        self.parent_run_id, self.uri = parent_run_id, uri
        self._remote = remote_function(run_one)
        self._running: dict = {}  # object ref → Submitted
        self._on_submit: Callable[[Trial], None] | None = None
        self._on_done: Callable[[TrialResult], None] = lambda result: None
        self._failures: list[str] = []  # what on_submit/on_done raised (``_call``)
        self._unsubmitted = 0  # trials not submitted once a recording failed
        self._withheld_placed: list[bool] = []  # per withheld trial ended: its group created
        self._forced: set = set()  # the object refs cancelled by force (``_stop``)

    def run(
        self,
        trials: list[Trial],
        on_done: Callable[[TrialResult], None],
        on_submit: Callable[[Trial], None] | None = None,
    ) -> list[TrialResult]:
        from cluster.runtime.interrupts import StopSignals

        stop = StopSignals.active()
        queue, results = list(trials), []
        self._on_submit, self._on_done, self._failures = on_submit, on_done, []
        self._unsubmitted, self._withheld_placed, self._forced = 0, [], set()
        self._total = self._ray.cluster_resources()
        withheld = False  # the trials waiting for their groups once a recording failed
        try:
            while queue or self._running:
                if _stopping(stop):
                    return self._stop(stop, self._unsubmitted + len(queue), results)
                while (
                    queue
                    and not self._failures
                    and self._has_room(queue[0])
                    and not _stopping(stop)
                ):
                    self._submit(queue.pop(0))
                if self._failures and not withheld:  # before the poll's wait
                    self._unsubmitted += len(queue)
                    queue.clear()
                    self._withhold()
                    withheld = True
                self._record_ends(results)
        except BaseException as error:  # a stop's Interrupted (none left running), Ray's error
            self._drain(stop, results, error)
            raise
        if self._failures:
            placed = self._withheld_placed
            raise RecordingFailed(
                self._failures, self._unsubmitted + placed.count(False), placed.count(True)
            )
        return results

    def _has_room(self, trial: Trial) -> bool:
        """Whether ``trial`` may be submitted now: fewer than ``concurrent`` running (0: no
        cap), and its bundles fit in the cluster's CPUs and GPUs beside those of the trials
        submitted (so that, with no cap, a trial is submitted only once its group can be
        created, not all at the start, each one SUBMITTED in the ledger)."""
        if self.concurrent and len(self._running) >= self.concurrent:
            return False
        running = (submitted.trial for submitted in self._running.values())
        return fit_in(resources_needed([trial, *running]), self._total)

    def _submit(self, trial: Trial) -> None:
        """``on_submit`` (where given), then the trial's task; where ``on_submit`` raised, the
        trial is not submitted (the failure kept: ``_call``)."""
        if self._on_submit is not None and not self._call(
            self._on_submit, trial, trial, "its start", ": not started"
        ):
            self._unsubmitted += 1
            return
        ref, group = self._launch(trial)
        self._running[ref] = Submitted(trial, group, time.perf_counter())

    def _launch(self, trial: Trial) -> tuple[object, object]:
        """The trial's placement group (``bundles``) and its task in bundle 0: (the task's
        object ref, the group)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        shape = bundles(trial.config)
        group = placement_group(shape, strategy="PACK")
        driver = shape[0]
        ref = self._remote.options(
            num_cpus=driver["CPU"],
            num_gpus=driver.get("GPU", 0),
            max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
        ).remote(trial, self.parent_run_id, self.uri)
        return ref, group

    def _call(
        self, callback: Callable, argument, trial: Trial, what: str, consequence: str = ""
    ) -> bool:
        """``callback(argument)``; False where it raised: the exception is kept for ``run`` to
        raise at the end (``RecordingFailed``), so that the other trials still end recorded."""
        try:
            callback(argument)
        except Exception as error:
            self._failures.append(
                f"{trial.name}: recording {what} failed ({_error_text(error)}){consequence}"
            )
            return False
        return True

    def _record_ends(self, results: list[TrialResult]) -> None:
        """The trials that ended within a poll (``POLL_S``), each passed to ``on_done``."""
        for result in self._finished(POLL_S):
            results.append(result)
            self._call(self._on_done, result, result.trial, "its end")

    def _withhold(self) -> None:
        """After a recording failed, no trial starts: cancel each submitted one whose placement
        group is not created yet (the GCS's word). Its task never runs, unless its group is
        created as the cancel goes out (it then stops as at a stop signal): ``_collect`` tells
        the two apart by its group once it ended. Those placed run to their end."""
        for ref, submitted in self._running.items():
            if not self._placed(submitted):
                submitted.withheld = True
                self._ray.cancel(ref, recursive=False)

    def _placed(self, submitted: Submitted) -> bool:
        """Whether the trial's placement group was created (its task may have run since). Where
        the GCS does not say (no state for the group, or an error asking), it may have been: the
        safe side, the trial counted as one that ran."""
        try:
            table = self._ray.util.placement_group_table(submitted.group)
        except Exception:
            return True
        return table.get("state") != "PENDING"

    def _finished(self, timeout: float) -> list[TrialResult]:
        if not self._running:
            return []
        done, _ = self._ray.wait(list(self._running), num_returns=1, timeout=timeout)
        return [self._collect(ref) for ref in done]

    def _collect(self, ref) -> TrialResult:
        """The ended trial of ``ref``. One whose placement group was not created by now never
        ran (``started`` False): its task needs the group, and it has ended."""
        from ray.exceptions import RayError

        submitted = self._running.pop(ref)
        placed = self._placed(submitted)
        if submitted.withheld:
            self._withheld_placed.append(placed)
        try:
            result = self._ray.get(ref)
        except RayError as error:  # cancelled (KILLED), or its worker died (FAILED)
            cancelled = isinstance(error, self._ray.exceptions.TaskCancelledError)
            cause = getattr(error, "cause", None)
            stopped = cancelled or isinstance(cause, KeyboardInterrupt)
            result = TrialResult(submitted.trial, error=None if stopped else _error_text(error))
            result.seconds, result.started = time.perf_counter() - submitted.start, placed
            # forced: its worker killed mid-round, how many rounds it ran past its checkpoint
            # unknown
            result.abandoned = stopped and ref in self._forced
        finally:  # and any actor left in it; where that fails, the disconnect removes them
            with contextlib.suppress(Exception):
                self._ray.util.remove_placement_group(submitted.group)
        return result

    def _stop(self, stop, not_started: int, results: list) -> list[TrialResult]:
        """Cancel the running trials, wait for them to end (a second signal: abandon the rounds
        in progress, ``ABANDON_WAIT_S`` at most), then raise ``Interrupted``."""
        from cluster.runtime.interrupts import Interrupted

        pending = sum(not self._placed(submitted) for submitted in self._running.values())
        stop.say(
            f"sweep: stopping {len(self._running) - pending} running trial(s) after their round "
            f"(each writes its checkpoint); {not_started + pending} not started"
        )
        before = len(results)
        self._cancel_once()
        self._wait_out(stop, results)
        ran = sum(result.started for result in results[before:])  # NOT RUN: never started
        failed = "".join(f"; {failure}" for failure in self._failures)
        raise Interrupted(
            stop.signum,
            f"{stop.reason}: {ran} trial(s) stopped, "
            f"{not_started + len(results) - before - ran} not started{failed}; "
            "rerun the same command to resume",
        )

    def _drain(self, stop, results: list[TrialResult], error: BaseException) -> None:
        """After ``error`` out of ``run``'s loop: cancel every running trial once (each stops
        after its round, with its checkpoint; one waiting for its group never runs) and wait
        for them to end as at a stop signal, each passed to ``on_done`` (one that never ran gets
        its earlier ledger entry back), so that none is killed unrecorded by the disconnect. An
        error meanwhile ends the wait, noted on ``error``: the trials left are killed by the
        disconnect, their SUBMITTED entries earlier attempts to a rerun."""
        try:
            self._cancel_once()
            self._wait_out(stop, results)
        except Exception as failure:
            error.add_note(f"waiting for the running trials to end failed: {_error_text(failure)}")

    def _cancel_once(self) -> None:
        """Cancel each running trial but the withheld (cancelled already): one that started
        stops after its round and keeps it."""
        withheld = {ref for ref, submitted in self._running.items() if submitted.withheld}
        self._cancel_all(skip=withheld)

    def _wait_out(self, stop, results: list[TrialResult]) -> None:
        """Wait for the cancelled trials to end, each passed to ``on_done``. A second stop
        signal (``stop``: None where none are installed) cancels them again (each abandons its
        round), and those left after ``ABANDON_WAIT_S`` are cancelled by force."""
        from cluster.runtime.interrupts import Interrupted

        deadline = None
        while self._running:
            try:
                if stop is not None:
                    stop.check_round()
            except Interrupted:
                if deadline is None:  # the second signal: the trials abandon their rounds
                    self._cancel_all()
                    deadline = time.monotonic() + ABANDON_WAIT_S
            if deadline is not None and time.monotonic() > deadline:
                for ref in self._running:
                    self._forced.add(ref)
                    self._ray.cancel(ref, force=True)
            self._record_ends(results)

    def _cancel_all(self, skip: set = frozenset()) -> None:
        """Interrupt each running trial's task but those in ``skip`` (its stop handler ends it:
        ``run_experiment``; a second interruption abandons its round). Not recursively: that
        would cancel the actor calls of the round it waits on, which then raise
        ``TaskCancelledError`` in the trial, its run ending FAILED without a checkpoint."""
        for ref in self._running:
            if ref not in skip:
                self._ray.cancel(ref, recursive=False)


def _stopping(stop) -> bool:
    """Whether a stop signal came (``stop``: the command's ``StopSignals``, or None)."""
    return stop is not None and stop.reason is not None


RAY_START_TRIES = 3


def start_ray(address: str | None) -> None:
    """``ray_runtime.connect``, tried again where an embedded node missed Ray's start-up
    deadline (30 s, fixed in ``ray._private.node``: on the 2-core machine at load 15-30, 4 of
    7 starts missed it); the failed start is shut down before the next."""
    from cluster.runtime.ray_runtime import connect, disconnect

    for attempt in range(1, RAY_START_TRIES + 1):
        try:
            connect(address)
            return
        except Exception as error:
            if "timed out during startup" not in str(error) or attempt == RAY_START_TRIES:
                raise
            disconnect()


def run_concurrently(
    trials: list[Trial],
    concurrent: int,
    parent_run_id: str | None,
    on_done: Callable[[TrialResult, str | None], None],
    on_submit: Callable[[Trial], None] | None = None,
) -> list[TrialResult]:
    """``trials`` on Ray (``RayTrials``): the cluster of their ``executor.address`` (an
    embedded Ray where none), each checked to fit first; tracked runs through one writer
    (``cluster.tracking.server``). ``on_done(result, uri)``: ``uri`` is where the runs are
    tracked; ``on_submit(trial)``: before its task is submitted (it may run from then on),
    which a trial whose ``on_submit`` raised never is. ``RecordingFailed`` where either
    raised: the trials running then ended first, and no other started."""
    import contextlib

    from cluster.runtime.interrupts import StopSignals
    from cluster.runtime.ray_runtime import disconnect
    from cluster.tracking.server import single_writer
    from cluster.tracking.settings import tracking_uri

    if not trials:
        return []
    stop = StopSignals.active()
    tracked = any(t.config.tracking.enabled for t in trials)
    try:
        with stop.around_ray() if stop is not None else contextlib.nullcontext():
            start_ray(trials[0].config.executor.address)  # first: the server has no such deadline
            import ray

            nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
            check_fits(trials, ray.cluster_resources(), nodes)
        writer = single_writer(tracking_uri()) if tracked else contextlib.nullcontext(None)
        with writer as uri:
            engine = RayTrials(concurrent, parent_run_id, uri)
            with stop.rounds() if stop is not None else contextlib.nullcontext():
                return engine.run(trials, lambda result: on_done(result, uri), on_submit)
    finally:
        with stop.finishing() if stop is not None else contextlib.nullcontext():
            disconnect()
