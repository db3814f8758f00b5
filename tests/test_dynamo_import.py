"""``torch._dynamo`` is imported on a thread as a host that takes ``torch.func`` gradients is
built (``algorithms.dynamo_import``), not in its first round; other hosts never import it."""

from helpers import run_python, small_config

from cluster.runtime.store import open_store

# In a fresh interpreter: the pytest process may have imported torch._dynamo already.
SCRIPT = """
import sys, threading
from helpers import small_config
from actors.client_host import ClientHost, Kernels

def host(vectorize, *overrides):
    config = small_config(sys.argv[1], *overrides)
    algorithm = config.build_algorithm()
    return ClientHost(sys.argv[2], config.task, algorithm, 0, [0, 1], kernels=Kernels(vectorize))

def importing():
    return [t for t in threading.enumerate() if t.name == "import torch._dynamo"]

host(False)  # FedAvg, one client after another: plain autograd
print("sequential", "torch._dynamo" in sys.modules, len(importing()))
host(False, *sys.argv[3:])  # DP-SGD's per-example gradients: torch.func
threads = importing()
for thread in threads:
    thread.join(300)
print("sample-level", len(threads), "torch._dynamo" in sys.modules)
host(True)  # vectorised clients: torch.func, and the import is not started twice
print("vectorised", len(importing()))
"""


def test_hosts_that_take_torch_func_gradients_import_dynamo_as_they_are_built(store_root):
    sample_level = ["algorithm.name=dp_fedavg_sample", "algorithm.noise_placement=null"]
    sample_level += ["algorithm.clip_norm=1.0", "algorithm.noise_multiplier=1.0"]
    small_config(store_root, *sample_level)  # refused here, not in the child, if it is bad
    store, _ = open_store(small_config(store_root))
    done = run_python(SCRIPT, str(store_root), str(store.location), *sample_level)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == [
        "sequential False 0",
        "sample-level 1 True",
        "vectorised 0",
    ], done.stdout
