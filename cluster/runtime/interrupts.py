"""Stop signals: SIGINT (Ctrl-C) or SIGTERM (a scheduler, ``ray job stop``) end a command cleanly
at whatever phase they arrive, losing no completed round.

``StopSignals`` is installed once for a whole command (``run``, ``resume``, ``compare``; or by
``run_experiment`` for a program that calls it) and its handlers act by phase:

- **start-up** (store build, Ray start-up, the MLflow run's opening, loading a checkpoint):
  the first signal raises ``Interrupted`` at once; no round has completed, so there is nothing
  to checkpoint (a resumed run's checkpoint stays as it was).
- **rounds** (``rounds()``): the first signal asks the loop to stop after the round in
  progress, which polls ``check_round`` while it waits for its clients. Inside a round that may
  be dropped (``droppable()``: an algorithm without client state, whose round changes nothing
  outside the driver until its result is applied) the poll raises ``RoundDropped`` and the
  driver goes back to the last completed round; otherwise the round finishes (SCAFFOLD's c_i
  change on the hosts as the round runs: a checkpoint of the round before would not match
  them). After a second signal the poll raises ``Interrupted``: the round is abandoned and the
  last periodic checkpoint on disk is what remains. Nothing is raised from the handler itself
  here: an exception raised inside Ray's C++ callbacks becomes a ``SystemError``.
- **the end** (``finishing()``: from the end of the rounds to the command's exit — the final
  checkpoint, the MLflow run's end, the shutdown): a signal is recorded (the exit code says it
  came) and changes nothing: what is left is what keeps the completed rounds.

A command ended by a signal exits with ``128 + signum``: 130 for SIGINT, 143 for SIGTERM.
Handlers are installed only in the main thread (signals are delivered there); the previous
ones are restored on exit.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop signal ended the command before its work was done (a KeyboardInterrupt, so code
    that already lets Ctrl-C through lets this through too)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        # (path, round) of the last checkpoint the interrupted run wrote, where it wrote one
        self.checkpoint: tuple[object, int] | None = None
        # rounds the run completed that no checkpoint holds (a second signal abandoned the
        # round after them before a checkpoint of them was written): a resume from the
        # checkpoint left would omit them from its ε (``experiment.unsaved_rounds``)
        self.unsaved_rounds = 0
        self.run_id: str | None = None  # the interrupted run's MLflow run, once its rounds began

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class RoundDropped(BaseException):
    """Raised by ``check_round`` in a droppable round after a stop signal: it is abandoned."""


class StopSignals:
    """Context manager; ``reason`` is None until a first signal arrives (see the module doc)."""

    _active: StopSignals | None = None

    def __init__(self, say: Callable[[str], None] = print):
        self.say = say
        self.reason: str | None = None
        self.signum: int | None = None
        self._phase = "start-up"  # | "rounds" | "droppable" | "finishing"
        self._abort: int | None = None  # a second signal in the rounds
        self._settled = False  # past the rounds: "finishing" until the command ends
        self._told_finishing = False
        self._previous: dict[int, object] = {}

    @classmethod
    def active(cls) -> StopSignals | None:
        """The signals of the command in progress, if one installed them."""
        return cls._active

    @property
    def exit_code(self) -> int | None:
        """``128 + signum`` once a signal arrived, else None."""
        return None if self.signum is None else 128 + self.signum

    def _notice(self, text: str) -> None:
        try:
            self.say(text)
        except RuntimeError:  # the signal came while the main thread was printing
            os.write(2, f"{text}\n".encode())

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._phase == "finishing":
            if self.signum is None:
                self.reason, self.signum = f"interrupted by {name}", signum
            if not self._told_finishing:  # once: what happens to this and any later signal
                self._told_finishing = True
                self._notice(f"{name}: finishing the checkpoint and the run's end first")
            return
        if self._phase == "start-up":
            self.reason, self.signum = f"interrupted by {name}", signum
            raise Interrupted(signum, f"interrupted by {name}")
        if self.reason is not None:
            if self._abort is None:
                self._abort = signum
                self._notice(f"{name}: abandoning the round in progress")
            return
        self.reason, self.signum = f"interrupted by {name}", signum
        if self._phase == "droppable":
            self._notice(f"{name}: dropping the round in progress and writing a checkpoint")
        else:
            self._notice(
                f"{name}: stopping after this round and writing a checkpoint (again to abort)"
            )

    def check_round(self) -> None:
        """Polled while a round waits for its clients: ``Interrupted`` after a second signal,
        ``RoundDropped`` after a first one in a droppable round, else nothing."""
        if self._abort is not None:
            name = signal.Signals(self._abort).name
            raise Interrupted(self._abort, f"second {name}: the round in progress abandoned")
        if self.reason is not None and self._phase == "droppable":
            raise RoundDropped

    @contextmanager
    def _in_phase(self, phase: str) -> Iterator[None]:
        before, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = "finishing" if self._settled else before

    def begin(self) -> None:
        """A run starts (``compare`` runs several under one command): in the start-up phase,
        unless a signal came already, which ends the command here (``Interrupted``)."""
        if self.signum is not None:
            name = signal.Signals(self.signum).name
            raise Interrupted(self.signum, f"interrupted by {name}; the next run was not started")
        self._settled, self._phase = False, "start-up"

    def settle(self) -> None:
        """The rounds are over: from here to the end of the command a signal is only recorded
        (one way: leaving an inner phase comes back here, not to the start-up)."""
        self._settled, self._phase = True, "finishing"

    def rounds(self):
        """The round loop: a first signal stops it after the round in progress."""
        return self._in_phase("rounds")

    def droppable(self):
        """A round that a first signal may abandon (``RoundDropped``)."""
        return self._in_phase("droppable") if self._phase == "rounds" else nullcontext()

    def finishing(self):
        """From the end of the rounds to the end of the command: a signal is only recorded."""
        return self._in_phase("finishing")

    @contextmanager
    def around_ray(self) -> Iterator[None]:
        """Ray calls before the rounds (``ray.init``, the actors' start, loading their state).
        ``ray.init`` replaces the SIGTERM handler with one that exits the process (its core's
        failure handlers are left out: ``ray_runtime.connect``), and an exception the handler
        raises inside Ray's C++ frames comes out as another (``SystemError``): after a signal,
        any of them is an ``Interrupted``; the handlers are this command's again after the
        block."""
        try:
            yield
        except Interrupted:
            raise
        except BaseException as error:
            if isinstance(error, SystemExit) and error.code == signal.SIGTERM:
                self.reason, self.signum = "interrupted by SIGTERM", signal.SIGTERM
            if self.signum is None or not self._previous:
                raise
            name = signal.Signals(self.signum).name
            raise Interrupted(self.signum, f"interrupted by {name}") from None
        finally:
            if self._previous:
                for signum in _SIGNALS:
                    signal.signal(signum, self._handle)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            self._outer, StopSignals._active = StopSignals._active, self
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._previous:
            StopSignals._active = self._outer
        self._previous.clear()


@contextmanager
def stop_signals(say: Callable[[str], None] = print) -> Iterator[StopSignals]:
    """The command's ``StopSignals``: the active one, or new ones for this block."""
    active = StopSignals.active()
    if active is not None:
        yield active
        return
    with StopSignals(say) as stop:
        yield stop
