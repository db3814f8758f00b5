"""Command line: ``python -m cluster COMMAND ...``: ``run`` and ``resume`` (``cluster.cli.run``),
and the subcommands of ``SUBCOMMANDS``, each in a module of its own."""

from __future__ import annotations

import argparse
import importlib
import sys

from cluster.cli.run import add_run_parsers
from cluster.runtime.interrupts import Interrupted, StopSignals
from cluster.tracking.process import TrackingError

# Subcommands in their own modules, imported only when chosen (torch, opacus and mlflow take
# seconds to import; `--help` and the calculators should not wait for them).
SUBCOMMANDS = {
    "privacy": (
        "cluster.cli.privacy",
        "privacy calculator: ε, calibrated σ or max rounds, side by side per accountant",
    ),
    "presets": (
        "cluster.cli.presets",
        "list the algorithm presets: paper, privacy unit, accounted, example config",
    ),
    "audit": (
        "cluster.cli.audit",
        "privacy audit: empirical ε lower bound (canary client) vs the accountant's ε",
    ),
    "partition": (
        "cluster.cli.partition",
        "build a shard store (partitioned dataset) and its partition report",
    ),
    "compare": (
        "cluster.cli.compare",
        "run several presets at the same ε over several seeds; mean ± std table",
    ),
    "sweep": (
        "cluster.cli.sweep",
        "search a space of config values × seeds, trials concurrently on Ray; select by validation",
    ),
    "landscape": (
        "cluster.cli.landscape",
        "loss-landscape slices around a checkpoint's model (filter-normalised directions)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="uv run python -m cluster", description="DP federated learning simulations on Ray"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_parsers(commands)
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(commands, help_text)
        else:  # listed in --help; its options are parsed only when it is the command
            commands.add_parser(name, help=help_text)
    args = parser.parse_args(argv)
    # SIGINT/SIGTERM from here on end the command cleanly (cluster.runtime.interrupts): 130 or 143.
    with StopSignals(lambda message: print(message, flush=True)) as stop:
        try:
            code = args.handler(args)
        except _input_errors() as error:  # bad input: one paragraph, no traceback
            print(_with_notes(error), file=sys.stderr)
            return 2
        except Interrupted as error:  # a signal before the command's work began
            print(f"aborted: {error}", file=sys.stderr)
            return error.exit_code
        except TrackingError as error:  # MLflow or its process failed once the run began
            print(_tracking_failure(error, getattr(args, "verbose", False)), file=sys.stderr)
            return stop.exit_code or 1  # a stop signal that came meanwhile still says so
        except _read_failures() as error:  # storage that stopped answering mid-run
            print(f"error: {_with_notes(error)}", file=sys.stderr)
            return stop.exit_code or 1
        return stop.exit_code or code  # a signal during the last writes still says it came


def _tracking_failure(error: TrackingError, verbose: bool) -> str:
    """One paragraph for the terminal; the tracking process's traceback only when ``verbose``."""
    if not error.details:
        return f"tracking error: {error}"
    if verbose:
        return f"tracking error: {error}\n{error.details}"
    return f"tracking error: {error} (MLflow's traceback: run again with --verbose)"


def _with_notes(error: BaseException) -> str:
    """The error's text (the actor's where it came from one) and its notes (where a run that
    failed mid-way kept its checkpoint: ``run_experiment``), a line each."""
    return "\n".join([str(raised_in_actor(error)), *getattr(error, "__notes__", ())])


def raised_in_actor(error: BaseException) -> BaseException:
    """The exception an actor raised, where Ray hands it to the driver wrapped (a
    ``RayTaskError`` subclass of its type, whose text is the actor's traceback); else
    ``error``."""
    ray = sys.modules.get("ray")
    if ray is not None and isinstance(error, ray.exceptions.RayTaskError):
        return error.cause
    return error


def _read_failures() -> tuple[type[Exception], ...]:
    """What storage that stops answering once the run began raises: a store's rows that could
    not be read, a checkpoint that could not be written (imported when needed)."""
    from cluster.runtime.checkpoint import CheckpointWriteFailed
    from datasets.store import StoreReadFailed

    return StoreReadFailed, CheckpointWriteFailed


def _input_errors() -> tuple[type[Exception], ...]:
    """What bad input raises: a config field, a file, a shard store that cannot be read as
    written, the Ray cluster's size, config values whose products overflow float32 in a round
    (``NonFiniteModel``)."""
    from cluster.config import ConfigError
    from cluster.runtime.ray_runtime import ResourceError
    from cluster.runtime.simulation import NonFiniteModel
    from datasets.store import StoreError
    from datasets.vision import SourceMissingError

    return ConfigError, SourceMissingError, StoreError, ResourceError, NonFiniteModel
