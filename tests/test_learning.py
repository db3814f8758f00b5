"""It learns: FedAvg approaches centralized training; SCAFFOLD beats FedAvg under heterogeneity."""

import numpy as np
import torch
from helpers import run_local, small_config

from cluster.runtime.store import open_store

SETUP = ("data.num_clients=30", "data.synthetic.samples_per_user=300", "cohort.size=10")


def centralized_accuracy(store) -> float:
    """Multinomial logistic regression on the pooled train data, trained to convergence."""
    x = torch.tensor(np.concatenate([store.client(c).x for c in range(store.num_clients)]))
    y = torch.tensor(np.concatenate([store.client(c).y for c in range(store.num_clients)]))
    test = store.test_rows()
    model = torch.nn.Linear(x.shape[1], store.manifest["num_classes"])
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        predictions = model(torch.tensor(test.x)).argmax(1).numpy()
    return float((predictions == test.y).mean())


def test_fedavg_on_synthetic_0_0_is_within_3_points_of_centralized(store_root):
    config = small_config(
        store_root,
        *SETUP,
        "data.synthetic.alpha=0",
        "data.synthetic.beta=0",
        "rounds=200",
        "eval_every=200",
        "algorithm.local.local_steps=2",
        "algorithm.local.lr=2.0",
        "algorithm.local.batch_size=64",
    )
    federated = run_local(config).history[-1].test_accuracy
    central = centralized_accuracy(open_store(config)[0])
    assert central > 0.6
    assert federated >= central - 0.03, (federated, central)


def test_scaffold_beats_fedavg_on_synthetic_5_5_with_50_local_steps(store_root):
    common = (
        *SETUP,
        "data.synthetic.alpha=5",
        "data.synthetic.beta=5",
        "rounds=30",
        "eval_every=30",
        "algorithm.local.local_steps=50",
        "algorithm.local.lr=0.05",
        "algorithm.local.batch_size=32",
    )
    fedavg = run_local(small_config(store_root, *common)).history[-1].test_accuracy
    scaffold = run_local(small_config(store_root, *common, "algorithm.name=scaffold"))
    assert scaffold.history[-1].test_accuracy > fedavg + 0.02, (scaffold, fedavg)
