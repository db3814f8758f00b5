"""``torch._dynamo``, imported ahead of a process's first ``torch.func`` gradient.

The gradient transforms of ``torch.func`` (``grad``, ``vjp``) enter
``torch._dynamo.compiled_autograd._disable()`` on every call, so the first one imports
``torch._dynamo`` with sympy and mpmath: ≈ 900 modules, 2.6 s of import time on the 2-core
development machine (``python -X importtime``). Inside the first round, that is most of its
time (the quickstart's round 1 took 3.1 and 3.8 s on the local executor, the rounds after it 0.2 s).

A client host that will take such gradients (it vectorises its clients, or its DP-SGD takes
per-example gradients by ``vmap(grad)``: ``algorithms.dpsgd.auto_method``) starts the import
on a thread as soon as it is built. The import
then runs while the host loads its clients' rows and the process waits for the first round
(Arrow reads, torch kernels and the driver's waits leave the GIL free), instead of inside the
round. A gradient taken before the import ended waits for it: Python's import system holds a
module's lock until its code has run. A Ray actor answers only once the import has ended
(``actors.ray_actor.build_host`` calls ``wait_for_dynamo_import``): on an embedded Ray the driver
runs the first rounds itself until its actors answer (``executor.overlap_start``), so the import
delays the hand-over rather than the actors' first round. Importing computes nothing, so
results are unchanged.
The thread is not a daemon: a process that ends during the import waits for it (2.6 s of CPU;
a Ray actor ended at once on a busy 2-core machine took 8 s to exit instead of 1.3 s), since a
thread stopped inside torch's C++ import code at the interpreter's exit aborts the process
(exit 134, "terminate called after throwing an instance of ''"). A process that forks during
the import leaves its child holding the import's module locks: the child's own import of
``torch._dynamo`` then never returns. Nothing here forks (``subprocess`` and Ray's processes
exec); code that does (``multiprocessing`` with ``fork``) must do so before a host is built.

The thread imports only ``torch._dynamo`` and what it imports (torch's modules, sympy, mpmath,
numpy's and the standard library's): modules no code of this project imports while it loads
data or trains, so the two threads never wait for each other's imports in a cycle."""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_thread: threading.Thread | None = None


def start_dynamo_import() -> None:
    """Start importing ``torch._dynamo`` on a thread, once per process; nothing to do where it
    is imported (or being imported) already."""
    global _thread
    with _lock:
        if _thread is not None or "torch._dynamo" in sys.modules:
            return
        _thread = threading.Thread(target=_import_dynamo, name="import torch._dynamo")
        _thread.start()


def wait_for_dynamo_import() -> None:
    """Return once the import ``start_dynamo_import`` started has ended (at once where it did
    not start one)."""
    if _thread is not None:
        _thread.join()


def _import_dynamo() -> None:
    import torch._dynamo  # noqa: F401
