"""``torch._dynamo`` is imported on a thread as a host that takes ``torch.func`` gradients is
built (``algorithms.dynamo_import``), not in its first round; other hosts never import it."""

import pytest
from helpers import run_python, small_config

from cluster.runtime.store import open_store

# Each case in a fresh interpreter: an earlier host (or the pytest process) imports it once.
SCRIPT = """
import sys, threading
from helpers import small_config
from actors.client_host import ClientHost, Kernels

store_root, store, vectorize, *overrides = sys.argv[1:]
config = small_config(store_root, *overrides)
kernels = Kernels(vectorize == "True")
ClientHost(store, config.task, config.build_algorithm(), 0, [0, 1], kernels=kernels)
threads = [t for t in threading.enumerate() if t.name == "import torch._dynamo"]
for thread in threads:
    thread.join(300)
print(len(threads), "torch._dynamo" in sys.modules)
"""
# DP-SGD on the logistic regression: the linear path (plain autograd, no torch.func gradient)
SAMPLE_LEVEL = [
    "algorithm.name=dp_fedavg_sample",
    "algorithm.noise_placement=null",
    "algorithm.clip_norm=1.0",
    "algorithm.noise_multiplier=1.0",
]


@pytest.mark.parametrize(
    ("vectorize", "overrides", "imports"),
    [
        (True, [], True),  # vectorised clients: vmap(grad)
        (False, [], False),  # FedAvg one client after another: plain autograd
        (False, SAMPLE_LEVEL, False),  # DP-SGD's linear path (auto_method; test_dpsgd.py)
    ],
    ids=["vectorised", "sequential", "dp-sgd linear"],
)
def test_only_hosts_that_take_torch_func_gradients_import_dynamo_as_they_are_built(
    store_root, vectorize, overrides, imports
):
    store, _ = open_store(small_config(store_root, *overrides))
    done = run_python(SCRIPT, str(store_root), str(store.location), str(vectorize), *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    threads, imported = done.stdout.split()[-2:]
    assert (int(threads), imported == "True") == (int(imports), imports)


BUILD_HOST = """
import sys, threading
from helpers import small_config
from actors.client_host import Kernels
from actors.ray_actor import build_host

store_root, store_path = sys.argv[1:]
config = small_config(store_root)
algorithm = config.build_algorithm()
build_host(1.0, 0.0, (0, 1), dict(
    store_path=store_path, test_per_client=None, kernels=Kernels(True), task=config.task,
    algorithm=algorithm, seed=0,
))
print([t.name for t in threading.enumerate()].count("import torch._dynamo"))
print("torch._dynamo" in sys.modules)
"""


def test_a_ray_actor_answers_once_its_host_has_imported_dynamo(store_root):
    """``build_host`` (an actor's constructor, and a warm actor's ``open``) returns once the
    import has ended: an embedded Ray's driver runs the rounds itself until the actors answer,
    instead of their first round waiting for the import."""
    store, _ = open_store(small_config(store_root))
    done = run_python(BUILD_HOST, str(store_root), str(store.location))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["0", "True"]
