"""Shared test helpers: small configs, in-process runs and local HTTP servers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from actors.client_host import AUTO_KERNELS, Kernels
from cluster.config import load_config
from cluster.runtime.executors import LocalExecutor
from cluster.runtime.simulation import Simulation
from cluster.runtime.store import open_store
from cluster.tracking.process import _spawn

TESTS = Path(__file__).parent

# A small DP-FedAvg run on two Ray actors of half a CPU, untracked (its store root and rounds
# added by the test): for drivers that connect to a running head.
SMALL_DP_FEDAVG_ON_RAY = [
    "data.num_clients=20",
    "data.synthetic.samples_per_user=100",
    "cohort.size=5",
    "algorithm.name=dp_fedavg",
    "algorithm.clip_norm=0.5",
    "algorithm.noise_multiplier=1",
    "algorithm.local.local_steps=5",
    "algorithm.local.batch_size=16",
    "tracking.enabled=false",
    "executor.kind=ray",
    "executor.num_actors=2",
    "executor.cpus_per_actor=0.5",
]


def run_python(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (nothing imported yet) from the repository root, with
    the tests' helpers importable; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])},
        timeout=timeout,
    )


def small_config(store_root, *overrides: str):
    """A small local run of ``overrides``; synthetic data of 100 rows a user, unless an override
    names another source (``data.synthetic`` is refused for it)."""
    sources = [o.partition("=")[2] for o in overrides if o.startswith("data.source=")]
    synthetic = (
        [] if sources and sources[-1] != "synthetic" else ["data.synthetic.samples_per_user=100"]
    )
    base = [
        f"data.store_root={store_root}",
        f"checkpoint.dir={store_root}/checkpoints",
        "data.num_clients=20",
        *synthetic,
        "cohort.size=5",
        "rounds=5",
        "algorithm.name=fedavg",
        "algorithm.local.local_steps=5",
        "algorithm.local.batch_size=16",
        "executor.kind=local",
        "tracking.enabled=false",
    ]
    return load_config(None, [*base, *overrides])


def run_local(config, num_hosts: int = 1, kernels: Kernels = AUTO_KERNELS):
    """Run ``config`` in process on ``num_hosts`` host threads computing with ``kernels``;
    returns the Simulation (its state holds the final params)."""
    store, _ = open_store(config)
    executor = LocalExecutor(
        store,
        config.task,
        config.build_algorithm(),
        config.streams_seed,
        num_hosts=num_hosts,
        test_per_client=config.data.test_per_client,
        kernels=kernels,
        data_seed=config.seed,
    )
    try:
        sim = Simulation(config, store, executor)
        sim.run()
    finally:
        executor.close()
    return sim


@dataclass
class Quadratic:
    """f(w) = ½ wᵀAw − bᵀw with the ModelObjective interface the trainer uses."""

    a: torch.Tensor
    b: torch.Tensor
    augment: None = None
    grad_evals: int = 0

    def grad(self, w):
        return self.a @ w - self.b

    def loss_and_grad(self, w, x, y):
        self.grad_evals += 1
        return torch.tensor(0.0), torch.zeros(len(y), 2), self.grad(w)


@contextmanager
def http_server(
    handler: type[BaseHTTPRequestHandler], **attributes
) -> Iterator[ThreadingHTTPServer]:
    """A server on 127.0.0.1 (a free port) answering with ``handler``, served by a thread for
    the block; ``attributes`` are set on it first (its handlers read them as
    ``self.server.<name>``)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in attributes.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def tracking_process_environment() -> dict[str, str]:
    """The environment a tracking process is started with (``_spawn``), read from ``/proc``
    once it answers a call: Popen returns as its exec begins, before ``/proc`` shows the new
    environment (read at once, it was empty in 11 of 15 spawns on a loaded machine)."""
    process, conn = _spawn(preload=False)
    try:
        conn.send(("flush", (), True))
        assert conn.recv() == ("ok", None)
        entries = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
    finally:
        conn.close()
        process.wait(60)
    return dict(entry.decode().partition("=")[::2] for entry in entries if entry)
