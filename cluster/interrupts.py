"""Graceful stops: SIGINT (Ctrl-C) or SIGTERM (a scheduler, ``ray job stop``) ends a run cleanly.

The first signal asks the round loop to stop after the round in progress: the run then writes
its checkpoint, marks its MLflow run KILLED (not FAILED) and says how to resume. A second signal
aborts at once (``KeyboardInterrupt``). Handlers are installed only in the main thread (signals
are delivered there) and the previous ones are restored on exit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """Context manager; ``reason`` is None until a first signal arrives."""

    def __init__(self, say: Callable[[str], None] = print):
        self.say = say
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None:
            raise KeyboardInterrupt(f"second {name}: aborting without a checkpoint")
        self.reason = f"interrupted by {name}"
        self.say(f"{name}: stopping after this round and writing a checkpoint (again to abort)")

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
