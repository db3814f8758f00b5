"""Assemble and run one experiment: data store → executor → Simulation → MLflow."""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from actors.client_host import Kernels
from algorithms.layout import ParamLayout
from cluster.claims.calibration import calibrate_with_message
from cluster.claims.privacy_plan import (
    PrivacyClaim,
    privacy_claim,
    privacy_report,
    privacy_warnings,
)
from cluster.config import ExperimentConfig
from cluster.config.data import ValidationConfig
from cluster.runtime import overlapped_start
from cluster.runtime.checkpoint import checkpoint_path, resume_command, save_checkpoint
from cluster.runtime.checkpoint_lock import checkpoint_locks
from cluster.runtime.executors import HostsUnavailable, LocalExecutor
from cluster.runtime.interrupts import Interrupted, StopSignals, stop_signals
from cluster.runtime.overlapped_start import OverlappedStart
from cluster.runtime.preflight import preflight
from cluster.runtime.ray_executor import RayExecutor
from cluster.runtime.records import RoundRecord
from cluster.runtime.round_metrics import final_epsilon
from cluster.runtime.run_names import (
    DESCRIPTION_TAG,
    NAME_TAG,
    UNSAVED_TAG,
    run_description,
    run_name,
    run_title,
    stopped_description,
)
from cluster.runtime.simulation import NonFiniteModel, Simulation, SimulationResult
from cluster.runtime.store import open_store
from cluster.runtime.stream_key import streams_key
from cluster.tracking.process import TrackingError, TrackingRun, flatten
from cluster.tracking.settings import tracking_uri
from datasets.locations import Location
from datasets.store import ShardStore
from datasets.tasks import TASKS


def kernels(config: ExperimentConfig) -> Kernels:
    """How the run's hosts compute (``executor.vectorize``, ``channels_last``, ``precision``)."""
    e = config.executor
    return Kernels(e.vectorize, e.channels_last, e.precision)


def kernel_params(config: ExperimentConfig) -> dict[str, str]:
    """The kernels every host of the run resolves, and from where (``actors.kernel_table``), as
    MLflow run parameters: the same table lookup as the hosts', on the hosts' device type."""
    device = torch.device(host_device(config))
    return kernels(config).resolve(TASKS[config.task].model_name, device).params()


def host_device(config: ExperimentConfig) -> str:
    """The hosts' torch device type: a GPU where actors get a share of one."""
    return "cuda" if config.executor.gpus_per_actor > 0 else "cpu"


def validation_tags(validation: ValidationConfig | None) -> dict[str, str]:
    """MLflow tags saying what the validation rows are to the tuning statement (privacy.tuning):
    held-out clients are outside the training population (public), held-out rows are not."""
    if validation is None:
        return {}
    if validation.kind == "clients":
        return {"data.validation": "held-out clients outside the training population (public)"}
    return {"data.validation": "rows of the training clients (private)"}


def make_executor(
    config: ExperimentConfig,
    store: ShardStore,
    say: Callable[[str], None] = lambda message: None,
    verbose: bool = False,
    streams: int | None = None,
):
    """The run's executor, its hosts' streams keyed by ``streams`` (the run's
    ``stream_key.streams_key``; None: the config's seed)."""
    algorithm = config.build_algorithm()
    streams = config.streams_seed if streams is None else streams
    if config.executor.kind == "local":
        return _local_executor(config, store, algorithm, streams)
    # Before Ray starts: where several nodes share one disk (the multi-node test cluster on one
    # machine shares a session directory), another node unpacking the job's working_dir rewrites
    # the package under this driver, and an import that lands in that window is not found.
    import actors.ray_actor  # noqa: F401

    stop = StopSignals.active()
    overlap, why_not = overlapped_start.applies(config, store)
    if why_not is not None:
        say(why_not)
    if overlap:  # the first rounds here while Ray starts on a thread

        def start_ray(tell: Callable[[str], None], hooks: overlapped_start.StartHooks):
            return _start_ray(config, store, algorithm, streams, tell, verbose, hooks)

        return OverlappedStart(
            lambda: _local_executor(config, store, algorithm, streams),
            start_ray,
            store,
            say,
        )
    with stop.around_ray() if stop is not None else contextlib.nullcontext():
        return _start_ray(config, store, algorithm, streams, say, verbose)


def _local_executor(
    config: ExperimentConfig, store: ShardStore, algorithm, streams: int
) -> LocalExecutor:
    """In process, each host an "actor" on a thread, with the same thread budget."""
    e = config.executor
    return LocalExecutor(
        store,
        config.task,
        algorithm,
        streams,
        num_hosts=e.num_actors,
        data_seed=config.seed,
        device=host_device(config),
        test_per_client=config.data.test_per_client,
        kernels=kernels(config),
        intra_op_threads=max(1, int(e.cpus_per_actor)),
    )


def _start_ray(
    config: ExperimentConfig,
    store: ShardStore,
    algorithm,
    streams: int,
    say: Callable[[str], None],
    verbose: bool,
    hooks: overlapped_start.StartHooks | None = None,
) -> RayExecutor | None:
    """Connect to Ray and start the actors; returns once they answer. Started on a thread of
    ``OverlappedStart``'s: its ``hooks`` are told when Ray is connected and the actors are
    created, and a start cancelled by then creates none (None)."""
    from cluster.runtime.ray_runtime import check_resources, connect

    e = config.executor
    hooks = hooks or overlapped_start.StartHooks()  # nobody cancels a start in the foreground
    session = connect(e.address, verbose)
    hooks.connected()
    if hooks.cancelled():
        return None
    say(session.describe())
    if session.embedded:
        check_resources(e.num_actors, e.cpus_per_actor, e.gpus_per_actor)
    executor = RayExecutor(
        store,
        config.task,
        algorithm,
        streams,
        e.num_actors,
        e.cpus_per_actor,
        e.gpus_per_actor,
        test_per_client=config.data.test_per_client,
        data_seed=config.seed,
        kernels=kernels(config),
        placement=e.placement,
        keep_warm_s=e.keep_warm_s,
        say=say,
        created=hooks.created,
    )
    say(executor.describe_placement())
    return executor


@dataclass
class Outcome:
    result: SimulationResult
    config: ExperimentConfig  # as run: after privacy calibration
    run_id: str | None
    tracking_uri: str | None
    checkpoint: Location  # a local path or an object-store URI (str() prints either)
    claim: PrivacyClaim  # what the run may say about privacy; every ε comes from it
    interrupted: bool = False  # stopped by SIGINT/SIGTERM after a round, checkpoint written
    run_page: str | None = None  # the MLflow run's page under `mlflow ui` (default port)
    # The SHA-256 of the rows data.validation held out (the store's validation.arrow; None:
    # none): whether two runs validated on the same clients (privacy.tuning).
    held_out: str | None = None

    @property
    def final_accuracy(self) -> float | None:
        evals = [r.test_accuracy for r in self.result.history if r.test_accuracy is not None]
        return evals[-1] if evals else None

    @property
    def final_validation_accuracy(self) -> float | None:
        """The last evaluation's accuracy on the ``data.validation`` rows (None: none)."""
        evals = [
            r.metrics["validation_accuracy"]
            for r in self.result.history
            if "validation_accuracy" in r.metrics
        ]
        return evals[-1] if evals else None

    @property
    def last_tenth_evaluations(self) -> list[float]:
        """The test accuracies of the evaluations in the last 10% of the training rounds (the
        DP-SCAFFOLD paper's table metric averages them); the last evaluation alone where none
        falls there (eval_every above T/10, or an interrupted run); empty without any."""
        history = self.result.history
        evals = [(r.round, r.test_accuracy) for r in history if r.test_accuracy is not None]
        if not evals:
            return []
        start = history[-1].round - math.ceil(self.config.rounds / 10)
        return [a for t, a in evals if t > start] or [evals[-1][1]]

    @property
    def last_tenth_accuracy(self) -> float | None:
        """The mean of ``last_tenth_evaluations`` (None without any evaluation)."""
        evals = self.last_tenth_evaluations
        return statistics.mean(evals) if evals else None

    def rounds_to(self, accuracy: float) -> int | None:
        """The first round whose test accuracy is at least ``accuracy`` (None: never reached;
        only rounds with an evaluation count, see ``eval_every``)."""
        reached = (r.round for r in self.result.history if (r.test_accuracy or 0) >= accuracy)
        return next(reached, None)

    @property
    def epsilon(self) -> float:
        """The accountant's final ε (∞ for a run without one: check ``claim.dp_valid``)."""
        return final_epsilon(self.result.history)

    @property
    def epsilon_vs_server(self) -> float | None:
        values = [r.metrics.get("epsilon_vs_server") for r in self.result.history]
        return values[-1] if values else None

    def privacy_line(self) -> str:
        """The run's final privacy statement for the terminal."""
        claim = self.claim
        if not claim.private:
            return "privacy: none (non-private run)"
        if not claim.dp_valid:
            return f"privacy: ε not available ({claim.status})"
        line = (
            f"privacy spent: ε = {self.epsilon:.3f} at δ = {claim.delta:g} "
            f"({claim.accounting_text})"
        )
        if claim.client_placed and self.epsilon_vs_server is not None:
            line += (
                f"; against a server that sees each upload: ε = {self.epsilon_vs_server:.4g} "
                f"(per-client σ {claim.client_noise_multiplier:.4g})"
            )
        return line


def _start_tracking(
    config: ExperimentConfig, store: ShardStore, run_id: str | None, parent_run_id: str | None
) -> TrackingRun | None:
    """The experiment's MLflow run, None when tracking is off. A new one opens in the tracking
    process while Ray and the actors start (``run_experiment`` waits for it before round 1);
    ``run_id`` resumed is waited for (``cluster.tracking.process.OPEN_WAIT_S`` at most), so that a
    run the store does not hold ends the command (``ConfigError``) before any training."""
    if not config.tracking.enabled:
        return None
    if run_id is not None:
        run = TrackingRun.resume(tracking_uri(), run_id)
        try:
            run.wait_open()
        except BaseException as error:
            run.abandon(_end_status(error))
            raise
        return run
    claim = privacy_claim(config, config.build_algorithm(), store.client_sizes)
    tags = {
        "algorithm": config.algorithm.name,
        "task": config.task,
        "store": store.path.name,
        **claim.tags(),
        **validation_tags(config.data.validation),
    }
    if parent_run_id is not None:  # MLflow's UI nests the run under its parent
        tags["mlflow.parentRunId"] = parent_run_id
    return TrackingRun.open(
        tracking_uri(),
        config.tracking.experiment,
        run_title(config),  # renamed with its id once open (cluster.runtime.run_names)
        {**flatten(config.to_dict()), **kernel_params(config)},
        tags,
        class_counts=store.class_counts(),  # the partition report, drawn there
    )


def run_experiment(
    config: ExperimentConfig,
    on_round: Callable[[RoundRecord], None] = lambda r: None,
    resume: dict | None = None,
    say: Callable[[str], None] = lambda message: None,
    calibrate: bool = True,
    verbose: bool = False,
    parent_run_id: str | None = None,
) -> Outcome:
    """Run (or, given a loaded checkpoint, continue) one experiment end to end.

    ``say`` receives one-line notices (calibration, privacy warnings) for the terminal. A fresh
    run calibrates σ or the rounds first (``privacy.calibrate``); a resumed run keeps the values
    its checkpoint was calibrated with; so does a caller that calibrated already
    (``calibrate=False``). Ray's own log lines reach the terminal only when ``verbose``.
    ``parent_run_id``: the MLflow run this one is listed under (``compare``'s parent run).

    SIGINT/SIGTERM end the run as ``cluster.runtime.interrupts`` describes: before the first round
    an ``Interrupted`` is raised (the MLflow run, if open, ends KILLED); during the rounds the run
    stops, writes the last completed round's checkpoint and returns ``interrupted``.
    """
    with stop_signals(say) as stop:
        stop.begin()
        preflight(config)
        if resume is None and calibrate:
            config = calibrate_with_message(config, say)
        store, _ = open_store(config)
        streams = streams_key(config, resume["simulation"] if resume is not None else None)
        algorithm = config.build_algorithm()
        if algorithm.privacy_unit != "none":
            for warning in privacy_warnings(config, store.client_sizes):
                say(f"warning: {warning}")
            privacy_claim(config, algorithm, store.client_sizes)  # refuses a δ out of range
        resumed_run = resume.get("run_id") if resume is not None else None
        run = _start_tracking(config, store, resumed_run, parent_run_id)
        try:
            executor = make_executor(config, store, say, verbose, streams)
        except BaseException as error:
            if run is not None:
                _abandon(run, error, config, None, resume)
            raise
        try:
            return _run_rounds(config, store, executor, streams, run, resume, on_round, say, stop)
        finally:
            with stop.finishing():
                executor.close()


def _abandon(
    run: TrackingRun,
    error: BaseException,
    config: ExperimentConfig,
    written: tuple[Location, int] | None,
    resume: dict | None,
    sim: Simulation | None = None,
) -> None:
    """End the run that ``error`` stopped before it finished, described by what it kept: the
    checkpoint it ``written`` last, else the one it resumed from (``resume``), unchanged. With
    the ``sim`` that ran, the claim's tags again: the accountant of the last ε it logged (after
    a fallback)."""
    resumed_rounds = resume["simulation"]["rounds_done"] if resume is not None else None
    line = stopped_description(error, written, config.total_rounds, resumed_rounds)
    unsaved = error.unsaved_rounds if isinstance(error, Interrupted) else 0
    tags = {DESCRIPTION_TAG: line} | ({UNSAVED_TAG: str(unsaved)} if unsaved else {})
    run.set_tags(_claim_tags(sim) | tags)
    run.abandon(_end_status(error))


def _claim_tags(sim: Simulation | None) -> dict[str, str]:
    """The claim's tags as its last logged ε's accountant reports it; none without a
    simulation, or where asking the accountant fails too (the run's error is the one to raise)."""
    if sim is None or sim.accountant is None:
        return {}
    try:
        return sim.claim.reported_by(sim.accountant).tags()
    except Exception:  # noqa: BLE001  (the tags set at the run's start stay)
        return {}


def unsaved_rounds(
    ran: int | None, written: tuple[Location, int] | None, resume: dict | None
) -> int:
    """How many of the ``ran`` rounds (None: the simulation never started, so none beyond the
    checkpoint resumed from) the run's checkpoint lacks: the one it ``written`` last, else the
    one it resumed from (``resume``), unchanged, else none. Above 0 only where a second stop
    signal abandoned a round before the rounds before it were checkpointed: a resume from that
    checkpoint would run them again, their released outputs missing from its ε."""
    if ran is None:
        return 0
    if written is not None:
        return ran - written[1]
    return ran - (resume["simulation"]["rounds_done"] if resume is not None else 0)


def _end_status(error: BaseException) -> str:
    """The MLflow status of a run ended by ``error``: a stop signal is the user's, not a
    failure."""
    return "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"


def _run_rounds(*args) -> Outcome:
    """``_run_rounds_locked`` holding its checkpoint's lock (``checkpoint_lock``) from when
    the checkpoint's name is known to the end: no other command writes it meanwhile."""
    with ExitStack() as locks:
        return _run_rounds_locked(locks, *args)


def _run_rounds_locked(
    locks: ExitStack,
    config: ExperimentConfig,
    store: ShardStore,
    executor,
    streams: int,
    run: TrackingRun | None,
    resume: dict | None,
    on_round: Callable[[RoundRecord], None],
    say: Callable[[str], None],
    stop: StopSignals,
) -> Outcome:
    """The rounds, the checkpoints and the MLflow run's end, on a started executor."""
    every = config.checkpoint.every
    announced = False

    def announce_once_open() -> None:
        """Print where the checkpoint goes, once its name (the MLflow run id) is known."""
        nonlocal announced
        if not announced and (run is None or run.is_open()):
            announced = True
            path = checkpoint_path(config, run.run_id if run is not None else None)
            say(f"checkpoint: {path} ({f'every {every} rounds and ' if every else ''}at the end)")

    announce_once_open()
    written: tuple[Location, int] | None = None  # the last checkpoint this run wrote, its round
    sim: Simulation | None = None
    try:
        if run is not None:  # it opened while Ray started; a store that refused it ends the
            run.wait_open()  # command here (exit 2), before any round
            run.set_tags({NAME_TAG: run_name(config, run.run_id)})
            announce_once_open()
        locks.enter_context(checkpoint_locks(checkpoint_path(config, run and run.run_id)))
        with stop.around_ray():  # the hosts answer through Ray
            sim = Simulation(config, store, executor, streams)
            if resume is not None:
                sim.load_state_dict(resume["simulation"])
        for notice in sim.claim.notices():
            say(notice)

        def checkpoint_here() -> Location:
            run_id = None
            failure = None
            if run is not None:  # named by the MLflow run, whose rounds are all in it first
                try:
                    run.flush()
                except TrackingError as error:  # MLflow failed: the rounds are kept all the same
                    failure = error
                run_id = run.run_id  # opened before the first round: never raises
                announce_once_open()
            path = checkpoint_path(config, run_id)
            save_checkpoint(path, sim.state_dict(), config.to_dict(), run_id)
            nonlocal written
            written = (path, len(sim.history))
            if failure is not None:
                say(
                    f"checkpoint of round {len(sim.history)} kept: {path} (once MLflow works "
                    f"again: {resume_command(path)})"
                )
                raise failure
            return path

        def keep_stopped_run() -> str:
            """The checkpoint of a run stopped at its last completed round (by lost hosts or a
            failed round: it needs no host), and where."""
            failure = None
            try:
                checkpoint_here()
            except Exception as error:  # said in the message, which is the run's error
                failure = error
            rounds = len(sim.history)
            if written is not None and written[1] == rounds:
                return (
                    f"the run stopped at round {rounds}, its checkpoint {written[0]}: resume it "
                    f"with: {resume_command(written[0])}"
                )
            kept = f"; the last written, of round {written[1]}: {written[0]}" if written else ""
            return f"no checkpoint of round {rounds} could be written ({failure}){kept}"

        if config.privacy.secret_streams and resume is None:
            # The secret key is in no other place: kept before any round releases anything,
            # so that a run that fails before its first checkpoint resumes the same streams
            # (a new run's new key would be a second, unaccounted release).
            checkpoint_here()

        def report(record: RoundRecord) -> None:
            if run is not None:
                run.log_round(record)
                announce_once_open()
            if every and record.round % every == 0:  # signals only flag the loop meanwhile
                checkpoint_here()
            on_round(record)

        def finish() -> None:  # in sim.run: a loss of hosts here is rolled back, then retried
            with stop.finishing():  # a signal only sets the exit code
                checkpoint_here()

        with stop.rounds():
            try:
                result = sim.run(report, stop, say, finish)
            except HostsUnavailable as error:  # the driver is at its last valid point: kept
                with stop.finishing():
                    raise HostsUnavailable(f"{error}; {keep_stopped_run()}") from error
            except NonFiniteModel as error:  # no checkpoint of the inf model: the last one kept
                kept = "no checkpoint was written"
                if written is not None:
                    kept = f"its last checkpoint, of round {written[1]}: {written[0]}"
                raise NonFiniteModel(f"{error}; {kept}") from error
            except Exception as error:  # a failed round: the driver is at the last completed
                if not sim.keeps_client_state:  # one (``Simulation.run``), which is kept
                    with stop.finishing():
                        error.add_note(keep_stopped_run())
                raise
            stop.settle()  # from here to the command's end a signal only sets the exit code
        # A signal that came as the last round ended stopped nothing: the run is complete.
        interrupted = stop.reason is not None and result.stop_reason.startswith(stop.reason)
        path = written[0]
        if interrupted:  # at once: a scheduler's SIGKILL may follow within seconds
            say(f"{result.stop_reason}: checkpoint {path}; resume with: {resume_command(path)}")
        if run is not None:
            _finish_run(run, config, sim, result, path, interrupted)
    except BaseException as error:
        if isinstance(error, Interrupted):  # say where the completed rounds are kept
            error.checkpoint = written
            ran = len(sim.history) if sim is not None else None
            error.unsaved_rounds = unsaved_rounds(ran, written, resume)
            if sim is not None and run is not None:  # open before the simulation was made
                error.run_id = run.run_id
        if run is not None:  # a second Ctrl-C is the user's stop, not a failure
            _abandon(run, error, config, written, resume, sim)
        raise
    run_id = run.run_id if run is not None else None
    uri = run.uri if run is not None else None
    page = run.run_page() if run is not None else None
    held_out = store.manifest["checksums"].get("validation.arrow")
    return Outcome(result, config, run_id, uri, path, sim.claim, interrupted, page, held_out)


def _finish_run(
    run: TrackingRun,
    config: ExperimentConfig,
    sim: Simulation,
    result: SimulationResult,
    checkpoint: Location,
    interrupted: bool,
) -> None:
    """The MLflow run's tags, summary, privacy report and model, then its end (KILLED when a
    signal stopped it)."""
    ParamLayout.of(sim.model).load_into(sim.model, result.params)
    eps = final_epsilon(result.history)
    tags = {"stop_reason": result.stop_reason, "checkpoint": str(checkpoint)}
    if isinstance(sim.executor, OverlappedStart):  # the rounds before the actors took over
        tags["executor.rounds_in_process"] = str(sim.executor.rounds_in_process)
    line = run_description(sim.claim, result.history, config.total_rounds, result.stop_reason, eps)
    # the claim's tags again: its accountant is the one whose ε stands (after a fallback)
    run.set_tags({**tags, **sim.claim.tags(), DESCRIPTION_TAG: line})
    summary = {
        "rounds": len(result.history),
        "stop_reason": result.stop_reason,
        "epsilon": eps if math.isfinite(eps) else None,
        "epsilon_vs_server": sim.claim.epsilon_vs_server(len(result.history)),
        "dp_valid": sim.claim.dp_valid,
        "delta": sim.claim.delta,
    }
    report = privacy_report(config, sim.claim, len(result.history), eps)
    status = "KILLED" if interrupted else "FINISHED"
    run.finish(config.to_dict(), result.history, sim.model.state_dict(), summary, report, status)
