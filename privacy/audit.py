"""Empirical privacy audit of one round of the client → server mechanism, with a canary client.

The audited mechanism is the algorithm's own: its ``UpdatePipeline`` (clipping, client-placed
noise) on every sampled client's update, float64 summation in a ``PartialAggregate``, and its
server rule's ``step`` (server-placed noise, the mean over the nominal cohort size, the server
learning rate). Only local training is replaced: clients send crafted updates, as in the
"update canary" audits of federated learning (e.g. Maddock et al. 2022; Andrew et al. 2024).

Neighbouring worlds, for one round:

- *with*: client 0 is the canary and sends B·e₁ with B = 10·C (clipping brings it to C);
- *without*: client 0 sends a zero update (for the mean over a nominal cohort size this is the
  same release as client 0 being absent, and it is one replace-one neighbour).

Every other client sends zero. The cohort is drawn by the run's own sampler, so the canary is
included with the configured probability. The adversary observes the released global model and
scores it by its canary coordinate, s = ⟨x_new − x_old, e₁⟩.

Test (many trials, Clopper–Pearson): the trials of each world are split in halves. On the first
halves the threshold τ maximising the bound below is chosen; on the second halves the true
and false positive rates of "s > τ" get two-sided Clopper–Pearson intervals at the stated
confidence (each at 1 − (1 − confidence)/2, a union bound). An (ε, δ)-DP mechanism satisfies
TPR ≤ e^ε·FPR + δ and 1 − FPR ≤ e^ε·(1 − TPR) + δ, so with the stated confidence

    ε ≥ max( log((TPR_low − δ)/FPR_high), log((1 − FPR_high − δ)/(1 − TPR_low)) ),

floored at 0. A correct accountant's one-round ε must be at least this lower bound (up to the
1 − confidence chance of an unlucky draw); a larger lower bound means the mechanism is
broken, e.g. noise smaller than claimed. ``noise_scale_for_testing`` multiplies the noise
the mechanism actually adds (the accountant still uses the claimed σ), so tests can check that
the audit catches an under-noised mechanism.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import beta

from algorithms.aggregate import PartialAggregate
from algorithms.layout import ParamLayout
from algorithms.presets import Algorithm
from algorithms.rng import Purpose, torch_generator
from algorithms.server import ServerContext, ServerState
from algorithms.transforms import ClientContext, GaussianNoise, UpdatePipeline

CANARY = 0
CANARY_NORM_FACTOR = 10.0


@dataclass(frozen=True)
class AuditResult:
    epsilon_lower_bound: float
    accountant_epsilon: float
    confidence: float
    delta: float
    trials: int  # per world
    threshold: float
    tpr_low: float
    fpr_high: float

    @property
    def consistent(self) -> bool:
        """The empirical lower bound does not exceed the accountant's ε."""
        return self.epsilon_lower_bound <= self.accountant_epsilon


def clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """Two-sided Clopper–Pearson interval for a binomial proportion."""
    alpha = 1.0 - confidence
    low = 0.0 if successes == 0 else float(beta.ppf(alpha / 2, successes, trials - successes + 1))
    high = (
        1.0
        if successes == trials
        else float(beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    )
    return low, high


def epsilon_from_rates(tpr: float, fpr: float, delta: float) -> float:
    """The largest ε that (ε, δ)-DP's hypothesis-testing inequalities force, floored at 0."""
    bounds = [0.0]
    if fpr > 0 and tpr - delta > 0:
        bounds.append(math.log((tpr - delta) / fpr))
    if tpr < 1 and 1 - fpr - delta > 0:
        bounds.append(math.log((1 - fpr - delta) / (1 - tpr)))
    return max(bounds)


def with_noise_scaled(algorithm: Algorithm, factor: float) -> Algorithm:
    """``algorithm`` whose Gaussian noise is multiplied by ``factor`` (test-only knob)."""
    if factor == 1.0:
        return algorithm
    transforms = tuple(
        dataclasses.replace(t, noise_multiplier=t.noise_multiplier * factor)
        if isinstance(t, GaussianNoise)
        else t
        for t in algorithm.pipeline.transforms
    )
    return dataclasses.replace(algorithm, pipeline=UpdatePipeline(transforms))


def single_layer(dim: int) -> ParamLayout:
    """The crafted updates' layout: one layer, so per-layer clipping acts as flat clipping."""
    return ParamLayout(("update",), ((dim,),), (0, dim))


def released_scores(
    algorithm: Algorithm,
    sample_cohort: Callable[[int], np.ndarray],
    nominal_cohort_size: float,
    num_clients: int,
    dim: int,
    trials: int,
    canary: bool,
    seed: int,
) -> np.ndarray:
    """Canary-coordinate score of the released model in ``trials`` independent rounds.

    The crafted updates have one layer of ``dim`` coordinates, so per-layer clipping acts as
    flat clipping here; ``algorithm`` must be bound to that layout (``audit_round`` binds it).
    """
    layout = single_layer(dim)
    bound = algorithm.pipeline.sensitivity
    canary_update = torch.zeros(dim)
    canary_update[0] = CANARY_NORM_FACTOR * bound
    zero = torch.zeros(dim)
    state = ServerState(torch.zeros(dim))
    world = 1 if canary else 2
    scores = np.empty(trials)
    for t in range(trials):
        total = PartialAggregate()
        for client in sample_cohort(t):
            ctx = ClientContext(
                torch_generator(seed, world, t, int(client), Purpose.CLIENT_NOISE),
                nominal_cohort_size,
                layout=layout,
                shared_generator=torch_generator(seed, world, t, Purpose.SHARED_MASK),
            )
            update = canary_update if canary and client == CANARY else zero
            total.add({"delta": algorithm.pipeline(update, ctx)}, 1.0)
        server_ctx = ServerContext(
            nominal_cohort_size=nominal_cohort_size,
            num_clients=num_clients,
            noise_std_on_sum=algorithm.pipeline.server_noise_std(),
            noise_generator=torch_generator(seed, world, t, Purpose.SERVER_NOISE),
        )
        released = algorithm.server.step(state, total, server_ctx, algorithm.control_variates)
        scores[t] = float(released.params[0] - state.params[0])
    return scores


def bounded_epsilon(
    with_canary: np.ndarray, without: np.ndarray, tau: float, delta: float, confidence: float
) -> tuple[float, float, float]:
    """(ε lower bound, TPR_low, FPR_high) of the test "score > τ" at ``confidence``."""
    per_rate = 1 - (1 - confidence) / 2  # union bound over the two intervals
    tpr_low, _ = clopper_pearson(int(np.sum(with_canary > tau)), with_canary.size, per_rate)
    _, fpr_high = clopper_pearson(int(np.sum(without > tau)), without.size, per_rate)
    return epsilon_from_rates(tpr_low, fpr_high, delta), tpr_low, fpr_high


def _best_threshold(
    with_canary: np.ndarray, without: np.ndarray, delta: float, confidence: float
) -> float:
    """τ with the largest bound on these trials (bounded, so that FPR = 0 is not free)."""
    candidates = np.quantile(np.concatenate([with_canary, without]), np.linspace(0, 1, 201))
    bounds = [
        bounded_epsilon(with_canary, without, tau, delta, confidence)[0] for tau in candidates
    ]
    return float(candidates[int(np.argmax(bounds))])


def audit_round(
    algorithm: Algorithm,
    sample_cohort: Callable[[int], np.ndarray],
    nominal_cohort_size: float,
    num_clients: int,
    accountant_epsilon: float,
    delta: float,
    trials: int = 2000,
    confidence: float = 0.95,
    dim: int = 16,
    seed: int = 0,
    noise_scale_for_testing: float = 1.0,
) -> AuditResult:
    """Audit one round; ``sample_cohort(t)`` returns trial t's cohort (client 0 = canary)."""
    algorithm = algorithm.bind(single_layer(dim))
    if algorithm.pipeline.noise_multiplier <= 0 or math.isinf(algorithm.pipeline.sensitivity):
        raise ValueError("the audit needs a private algorithm: clipping and Gaussian noise")
    if trials < 20:
        raise ValueError(f"trials must be >= 20 (10 to pick a threshold, 10 to test), got {trials}")
    mechanism = with_noise_scaled(algorithm, noise_scale_for_testing)
    args = (mechanism, sample_cohort, nominal_cohort_size, num_clients, dim, trials)
    with_canary = released_scores(*args, canary=True, seed=seed)
    without = released_scores(*args, canary=False, seed=seed)
    half = trials // 2
    tau = _best_threshold(with_canary[:half], without[:half], delta, confidence)
    eps, tpr_low, fpr_high = bounded_epsilon(
        with_canary[half:], without[half:], tau, delta, confidence
    )
    return AuditResult(
        epsilon_lower_bound=eps,
        accountant_epsilon=accountant_epsilon,
        confidence=confidence,
        delta=delta,
        trials=trials,
        threshold=tau,
        tpr_low=tpr_low,
        fpr_high=fpr_high,
    )
