"""F(x*): the optimum of the federated objective, for DP-SCAFFOLD's train-loss gap.

The objective is the clients' average of their own mean losses, with the local ℓ2 term::

    F(x) = (1/M) Σ_i F_i(x) + (λ/2)‖x‖²,   F_i(x) = (1/n_i) Σ_{r ∈ client i} ℓ(x; r)

(M: the clients with training data; λ: ``algorithm.local.weight_decay``). It has one global
optimum only for a convex model: multinomial logistic regression (``logreg`` tasks), where it is
found here centrally, in float64, by full-batch L-BFGS on every client's rows at once (each
row weighted 1/(M·n_i)). Other models get none: the paper's gap log10(F(x^t) − F(x*)) is then
not logged (``eval_train`` still logs F(x^t)). It reads every client's training rows, so it
runs where the hosts do (``HostPool.central_optimum``), never on the driver.
"""

from __future__ import annotations

import numpy as np
import torch

from datasets.store import ShardStore
from datasets.tasks import TASKS


def central_optimum(store: ShardStore, task_name: str, weight_decay: float) -> float | None:
    """min_x F(x) for a logistic-regression task (None for other models)."""
    task = TASKS[task_name]
    if task.model_name != "logreg":
        return None
    rows, labels, weights = _weighted_rows(store, task)
    num_classes = int(store.manifest["num_classes"])
    w = torch.zeros(rows.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)

    def objective() -> torch.Tensor:
        losses = torch.nn.functional.cross_entropy(rows @ w + b, labels, reduction="none")
        return (weights * losses).sum() + 0.5 * weight_decay * (w.square().sum() + b.square().sum())

    # F(x*) to ≈ 1e-9 (the quickstart's 40,000 rows: 2.4 s; tolerances 1e-12/1e-15 move it
    # by 3·10⁻¹⁰ in 12 s): far below the gaps a DP run reaches.
    optimizer = torch.optim.LBFGS(
        [w, b],
        max_iter=500,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return float(objective())


def store_optimum(store_location: str, task_name: str, weight_decay: float) -> float | None:
    """``central_optimum`` of the store at ``store_location``: what a host runs, where the
    store's rows are read (the driver reads none)."""
    return central_optimum(ShardStore.open(store_location), task_name, weight_decay)


def _weighted_rows(store: ShardStore, task) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every client's training rows (float64, flattened), labels and weights 1/(M·n_i), M the
    clients with rows (one read of the client-ordered store)."""
    arrays = store.train_rows()
    sizes = store.client_sizes
    weights = np.repeat(1.0 / (np.count_nonzero(sizes) * np.maximum(sizes, 1)), sizes)
    rows = task.preprocess(torch.tensor(arrays.x)).double().flatten(1)
    return rows, torch.tensor(arrays.y, dtype=torch.long), torch.from_numpy(weights)
