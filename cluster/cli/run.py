"""``python -m cluster run CONFIG`` and ``python -m cluster resume CHECKPOINT``: one experiment,
from its config or from the checkpoint of an earlier run, with its progress on the terminal."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING

from cluster.redaction import redact_credentials
from cluster.runtime.interrupts import Interrupted, StopSignals
from cluster.tracking.process import prestart as prestart_tracking

if TYPE_CHECKING:
    from cluster.runtime.records import RoundRecord


def _progress_line(record: RoundRecord, total: int, claim) -> str:
    parts = [f"round {record.round:>4}/{total}"]
    if record.metrics.get("warmup"):
        parts.append("warm-up (c_i⁰)")
    if claim.private:
        parts.append(claim.epsilon_text(record.epsilon, record.metrics.get("epsilon_vs_server")))
    if record.test_accuracy is not None:
        parts.append(f"acc {record.test_accuracy:.4f}")
    if "clip_fraction" in record.metrics:
        parts.append(f"clipped {record.metrics['clip_fraction']:.2f}")
    parts.append(f"{record.seconds:.2f} s/round")
    return " | ".join(parts)


# What a resumed run may change: how and how long it runs, never what it computes.
RESUMABLE_PREFIXES = (
    "rounds",
    "eval_every",
    "eval_train",
    "stop_at_bytes",
    "executor.",
    "checkpoint.",
)
# ... except these: bf16 autocast rounds the model's arithmetic differently.
NOT_RESUMABLE_PREFIXES = ("executor.precision",)


def _overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.set)
    if args.executor:
        overrides.append(f"executor.kind={args.executor}")
    if args.address:
        # JSON is YAML: the address stays a string (`[::1]:6379` is no list, `yes` no bool)
        overrides.append(f"executor.address={json.dumps(args.address)}")
    return overrides


def _start_tracking_process(verbose: bool) -> None:
    """Start the MLflow process now: its imports run on another core while this one imports
    torch. It inherits the environment as it is here (quiet MLflow, unless ``verbose``)."""
    if verbose:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO")  # read when MLflow is imported
    prestart_tracking()


def _run(args: argparse.Namespace) -> int:
    # First line before the heavy imports (torch alone takes seconds): the user sees it started.
    echoed = "".join(f" --set {a}" for a in _overrides(args))
    print(redact_credentials(f"run {args.config}{echoed}"), flush=True)
    _start_tracking_process(args.verbose)
    from cluster.config import load_config

    return _execute(load_config(args.config, _overrides(args)), None, args.verbose)


def _resume(args: argparse.Namespace) -> int:
    """Continue the run of a checkpoint, checked against its config before any work; exit 0
    at once when its rounds are all done."""
    from cluster.config import ConfigError
    from cluster.runtime.checkpoint import open_checkpoint
    from cluster.runtime.preflight import preflight

    echoed = "".join(f" --set {a}" for a in _overrides(args))
    print(redact_credentials(f"resume {args.checkpoint}{echoed}"), flush=True)
    _start_tracking_process(args.verbose)
    overrides = _overrides(args)
    for assignment in overrides:
        if assignment.startswith(NOT_RESUMABLE_PREFIXES):
            raise ConfigError(
                "--set",
                assignment,
                "executor.precision changes what the rounds compute (bf16 rounding); a resumed "
                "run keeps its checkpoint's precision: leave it out, or start a new run",
            )
        if not assignment.startswith(RESUMABLE_PREFIXES):
            raise ConfigError(
                "--set",
                assignment,
                "a resumed run keeps its config; only "
                "rounds, eval_every, eval_train, stop_at_bytes, executor.* and checkpoint.* "
                "may change",
            )
    checkpoint, config = open_checkpoint(args.checkpoint, overrides)
    if _rounds_left(config, checkpoint["simulation"]["rounds_done"]):  # refused writing nothing
        preflight(config)  # as a new run's: the store, MLflow, Ray, the checkpoint directory
    with ExitStack() as locks:
        checkpoint, config = _locked_checkpoint(
            locks, args.checkpoint, overrides, checkpoint, config
        )
        return _resume_checkpoint(args, checkpoint, config)


def _locked_checkpoint(locks: ExitStack, path: str, overrides, checkpoint: dict, config):
    """The checkpoint and config as they are once this process holds the locks of the
    checkpoint it resumes and of the one it will write (``checkpoint_lock``): read again if
    another run wrote it since it was first read (and checked, writing nothing)."""
    from cluster.config.paths import resolve
    from cluster.runtime.checkpoint import checkpoint_path, open_checkpoint
    from cluster.runtime.checkpoint_lock import checkpoint_locks
    from cluster.runtime.preflight import check_no_checkpoint_overwritten
    from datasets.locations import parse_location

    source = parse_location(path)
    before = _identity(source)
    writes = checkpoint_path(config, checkpoint.get("run_id"))
    locks.enter_context(checkpoint_locks(source, writes))
    if _identity(source) != before:
        checkpoint, config = open_checkpoint(path, overrides)
    target = resolve("checkpoint.dir", writes)
    if checkpoint.get("run_id") is None and target != resolve("CHECKPOINT", source):
        check_no_checkpoint_overwritten(config)  # another run's checkpoint may be there
    return checkpoint, config


def _identity(location) -> tuple | None:
    """(inode, size, mtime) of a local file; None elsewhere (an object: never locked)."""
    from pathlib import Path

    if not isinstance(location, Path):
        return None
    stat = location.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _resume_checkpoint(args: argparse.Namespace, checkpoint: dict, config) -> int:
    from cluster.runtime.round_metrics import byte_budget_spent

    done = checkpoint["simulation"]["rounds_done"]
    history = checkpoint["simulation"]["history"]
    spent = byte_budget_spent(config, history[-1]["metrics"] if history else None, len(history))
    if _rounds_left(config, done) == 0 or spent is not None:
        why = f"has completed all {config.rounds} rounds{_after_warmup(config)}"
        more = f"--set rounds=N, N > {config.rounds}"
        if spent is not None and _rounds_left(config, done):
            why, more = f"has run to its {spent}", "--set stop_at_bytes=B, B above the bytes spent"
        status = _checked_run_status(args.checkpoint, config, checkpoint)
        if status in (None, "FINISHED"):
            print(f"nothing to do: {args.checkpoint} {why}; continue it with {more}")
            return 0
        # The command that ran the rounds ended before it closed the run (killed as it
        # finished): its artifacts come from the checkpoint; no round runs, no ε is spent.
        print(
            f"{args.checkpoint} {why}, but its MLflow run {checkpoint['run_id']} is {status} "
            "(the command that ran them ended before closing it): closing it from the "
            "checkpoint, no round runs",
            flush=True,
        )
        return _execute(config, checkpoint, args.verbose)
    _checked_run_status(args.checkpoint, config, checkpoint)
    print(f"resuming after round {done} from {args.checkpoint}", flush=True)
    return _execute(config, checkpoint, args.verbose)


def _checked_run_status(path: str, config, checkpoint: dict) -> str | None:
    """The status of the tracked checkpoint's MLflow run (None: untracked, or the store
    unreachable, said; a run the store lacks is refused later, naming the store), once the
    run is known to be this checkpoint's and not to have gone further. Refused (exit 2): a
    checkpoint whose config differs from the run's params (in what a resume may not change:
    another run's id in it), and a resume to fewer rounds than the run has logged (another
    resume of it, writing elsewhere, went further: this one would end the run with fewer
    rounds than it released, its summary's ε below theirs)."""
    run_id = checkpoint.get("run_id")
    if not config.tracking.enabled or run_id is None:
        return None
    from mlflow.tracking import MlflowClient

    from cluster.config import ConfigError
    from cluster.tracking.process import flatten
    from cluster.tracking.settings import tracking_uri
    from cluster.tracking.tracker import logged_param

    client = MlflowClient(tracking_uri())
    try:
        run = client.get_run(run_id)
        logged = client.get_metric_history(run_id, "seconds_per_round")
    except Exception as error:  # a missing run, an unreachable store: said where it is opened
        print(f"could not read the MLflow run {run_id} ({type(error).__name__})")
        return None
    stored, params = flatten(checkpoint["config"]), run.data.params
    differs = sorted(
        k
        for k in stored.keys() & params.keys()
        if logged_param(stored[k]) != params[k] and not k.startswith(RESUMABLE_PREFIXES)
    )
    if differs:
        key = differs[0]
        raise ConfigError(
            "checkpoint",
            path,
            f"its config differs from that of the MLflow run {run_id} it names ({key} = "
            f"{stored[key]!r} here, {params[key]!r} in the run): the run did not write it; "
            "resume that run's own checkpoint, or start a new run from this config",
        )
    last = max((m.step for m in logged), default=0)
    if last > config.total_rounds:
        raise ConfigError(
            "rounds",
            config.rounds,
            f"the MLflow run {run_id} has logged {last} rounds already (a resume of it that "
            "wrote its checkpoint elsewhere went further); ending it at fewer rounds would "
            "understate what it released: resume its latest checkpoint, or --set rounds=N with "
            f"N ≥ {last - (config.total_rounds - config.rounds)}",
        )
    return run.info.status


def _rounds_left(config, done: int) -> int:
    """Rounds a resume after ``done`` completed rounds runs; a ``ConfigError`` when ``rounds``
    is below the rounds done (``done`` counts warm-up rounds, ``rounds`` may not)."""
    from cluster.config import ConfigError

    left = config.total_rounds - done
    if left < 0:
        trained = config.rounds - left
        raise ConfigError(
            "rounds",
            config.rounds,
            f"the checkpoint has completed {trained} rounds{_after_warmup(config)}, more than "
            f"it asks for; continue it with --set rounds=N, N > {trained}",
        )
    return left


def _after_warmup(config) -> str:
    """The warm-up rounds the driver runs before ``rounds`` (DP-SCAFFOLD-warm), if any."""
    warmup = config.total_rounds - config.rounds
    return f" after {warmup} warm-up rounds" if warmup else ""


def check_address_used(config) -> None:
    """``executor.address`` names the Ray a run connects to; one run on the local executor
    connects to none, so it would be ignored. (A sweep's or compare's trials on the local
    executor do run on the Ray it names, ``cluster.analysis.trials``: not refused there.)"""
    from cluster.config import ConfigError

    e = config.executor
    if e.kind == "local" and e.address is not None:
        raise ConfigError(
            "executor.address",
            e.address,
            "connects to a Ray cluster; the local executor runs in this process: set "
            "executor.kind=ray (--executor ray), or remove executor.address (--address)",
        )


def _execute(config, checkpoint: dict | None, verbose: bool) -> int:
    check_address_used(config)
    try:
        return _execute_in_session(config, checkpoint, verbose)
    finally:
        from cluster.runtime.ray_runtime import disconnect

        with StopSignals.active().finishing():  # a signal now waits for Ray's shutdown
            disconnect()


def _execute_in_session(config, checkpoint: dict | None, verbose: bool) -> int:
    with ExitStack() as locks:
        return _execute_locked(locks, config, checkpoint, verbose)


def _execute_locked(locks: ExitStack, config, checkpoint: dict | None, verbose: bool) -> int:
    from cluster.claims.calibration import calibrate_with_message
    from cluster.claims.privacy_plan import privacy_claim
    from cluster.runtime.checkpoint import checkpoint_path, resume_command
    from cluster.runtime.checkpoint_lock import checkpoint_locks
    from cluster.runtime.experiment import run_experiment
    from cluster.runtime.preflight import check_no_checkpoint_overwritten, preflight

    def say(message: str) -> None:
        print(message, flush=True)

    if checkpoint is None:
        preflight(config)  # before the σ search: a missing file fails at once
        check_no_checkpoint_overwritten(config)  # refused before anything is written
        config = calibrate_with_message(config, say)
        if not config.tracking.enabled:  # named by experiment, preset and seed: may collide
            locks.enter_context(checkpoint_locks(checkpoint_path(config, None)))
            check_no_checkpoint_overwritten(config)  # no other run wrote it meanwhile

    a = config.algorithm
    print(
        f"{a.name} on {config.task}: {config.data.num_clients} clients, cohort "
        f"{config.cohort.size} ({config.cohort.sampling}), {config.rounds} rounds, executor "
        f"{config.executor.kind}",
        flush=True,
    )
    claim = privacy_claim(config, config.build_algorithm())
    try:
        outcome = run_experiment(
            config,
            lambda r: print(_progress_line(r, config.total_rounds, claim), flush=True),
            checkpoint,
            say,
            calibrate=False,
            verbose=verbose,
        )
    except Interrupted as error:  # before the first round, or a second signal mid-round
        print(f"aborted: {error}; {_what_is_kept(error, checkpoint)}", file=sys.stderr)
        return error.exit_code
    result, config = outcome.result, outcome.config
    if outcome.interrupted:  # run_experiment said where its checkpoint is
        return StopSignals.active().exit_code  # 130 for SIGINT (Ctrl-C), 143 for SIGTERM
    print(f"done: {result.stop_reason}")
    if outcome.final_accuracy is not None:
        print(f"final test accuracy {outcome.final_accuracy:.4f}")
    if outcome.claim.private:
        print(outcome.privacy_line())
    more = "rounds=N" if config.stop_at_bytes is None else "rounds=N or stop_at_bytes=B"
    print(
        f"checkpoint: {outcome.checkpoint} (continue with: {resume_command(outcome.checkpoint)} "
        f"--set {more})"
    )
    if outcome.run_id:
        shown = redact_credentials(outcome.tracking_uri)  # the terminal may be a job's log
        print(f"MLflow run {outcome.run_id} in {shown}")
        if not outcome.tracking_uri.startswith("http"):  # a masked password: the variable
            uri = shlex.quote(shown) if shown == outcome.tracking_uri else '"$MLFLOW_TRACKING_URI"'
            print(f"browse it with: uv run mlflow ui --backend-store-uri {uri}")
        print(f"run page: {redact_credentials(outcome.run_page)}")
    return 0


def _what_is_kept(error: Interrupted, resumed: dict | None) -> str:
    """Where the rounds an aborted run completed are kept."""
    from cluster.runtime.checkpoint import resume_command

    written = getattr(error, "checkpoint", None)
    if written is not None:
        path, rounds = written
        return f"round {rounds}'s checkpoint: {path} ({resume_command(path)})"
    if resumed is not None:
        done = resumed["simulation"]["rounds_done"]
        return f"the checkpoint resumed from is unchanged (round {done})"
    return "no round completed: nothing to resume"


def _add_execution_options(parser: argparse.ArgumentParser, set_help: str) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    parser.add_argument("--executor", choices=["local", "ray"], help="override executor.kind")
    parser.add_argument(
        "--address", help="Ray cluster address (default: $RAY_ADDRESS or an embedded Ray)"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show Ray's own log lines and the workers' output (default: only the run's "
        "progress; Ray's logs stay in the log directory printed at start)",
    )


def add_run_parsers(commands) -> None:
    """The ``run`` and ``resume`` subcommands."""
    run = commands.add_parser("run", help="run one experiment from a YAML config")
    run.add_argument("config", help="experiment YAML, e.g. configs/quickstart.yaml")
    _add_execution_options(run, "override a config field, e.g. --set rounds=10 (repeatable)")
    run.set_defaults(handler=_run)
    resume = commands.add_parser("resume", help="continue a run from its checkpoint")
    resume.add_argument("checkpoint", help="checkpoint file written by a run")
    _add_execution_options(
        resume,
        "change rounds, eval_every, eval_train, stop_at_bytes, executor.* or checkpoint.* only",
    )
    resume.set_defaults(handler=_resume)
