"""Empirical privacy audit of one round of a preset's real mechanism, with a canary client.

What runs is the preset's own: its ``UpdatePipeline`` (sparsifiers, clipping, the
``GaussianMechanism`` with its placement and noise support, post-processing) on every client of
the cohort, float64 summation in a ``PartialAggregate`` and its server rule's ``step``
(server-placed noise, the mean, momentum, smoothing). Only local training is replaced by
crafted updates, as in the "update canary" audits of federated learning (Maddock et al. 2022;
Andrew et al. 2024):

- every other client sends a realistic, varied update: a shared direction plus its own
  Gaussian part on per-coordinate scales where half of each layer's parameters move (log-normal
  scales) and half barely do, with norms spread around the clip norm (some clipped, some not);
  each brings its own gradient for LUS and sees the same public drift direction (DP-FedPGN);
- the canary puts a large update B = 10·S on its canary coordinates: one per layer (so that
  per-layer clipping gives it the full sensitivity S = C·√L), a quiet coordinate of each layer
  (which the other clients' top-k masks leave alone), or, with a shared public mask (rand-k),
  the least-moving coordinate of each layer that the round's mask releases.

Neighbouring worlds of one round, with the canary always in the cohort (the audit tests the
mechanism — clipping, support, noise — not the amplification by sampling, which is the
accountant's and is checked against reference values elsewhere):

- replace-one adjacency (fixed cohorts): the canary's update is +B·v in one world and −B·v in
  the other (its clipped difference is 2S, the sensitivity the accountant assumes);
- add/remove adjacency (Poisson): the canary sends +B·v, or is absent.

The score of a trial is the released model's move along v. The claim to test is the ε(δ) of
one Gaussian release with μ = Δ/(σ·S) (Δ = 2S or S): the unamplified one-round ε the
mechanism's σ stands for. For an unaccounted mechanism (a paper's literal top-k) the claim is
what the paper's accounting assumes of the same σ.

Test. The trials of each world are split in halves. On the first halves the δ of a grid, the
threshold τ and the direction of the test are chosen to maximise the lower bound minus the
claim; on the second halves the true and false positive rates of that test get two-sided
Clopper–Pearson intervals at the stated confidence (each at 1 − (1 − confidence)/2). An
(ε, δ)-DP mechanism has TPR ≤ e^ε·FPR + δ and 1 − FPR ≤ e^ε·(1 − TPR) + δ, so with that
confidence

    ε ≥ max( log((TPR_low − δ)/FPR_high), log((1 − FPR_high − δ)/(1 − TPR_low)) ),

floored at 0. A lower bound above the claim at that δ means the mechanism leaks more than its
σ says. ``noise_scale_for_testing`` multiplies the noise the mechanism actually adds (the claim
keeps σ), so tests can show that the audit catches an under-noised mechanism.

Power. ``detectable_noise_scale`` is the largest factor s such that a Gaussian mechanism whose
noise is s × the claimed noise is flagged at this size, under the Gaussian model of the score
and expected counts (the median audit): the audit reports what it could have found, not only
pass or fail.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from scipy.stats import beta, norm

from algorithms.aggregate import PartialAggregate
from algorithms.algorithm import Algorithm
from algorithms.layout import ParamLayout
from algorithms.mechanism import SharedMaskSupport
from algorithms.rng import Purpose, numpy_rng, torch_generator
from algorithms.server import ServerContext, ServerState
from algorithms.transforms import ClientContext, layer_segments
from privacy.participation import gaussian_epsilon

Adjacency = Literal["replace_one", "add_remove"]
CANARY_NORM_FACTOR = 10.0
DELTA_GRID = (0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 1e-3)
LOCAL_STEPS, LOCAL_LR = 5, 0.1  # the crafted clients' K and η (DP-FedPGN's public drift)


@dataclass(frozen=True)
class AuditResult:
    epsilon_lower_bound: float
    claimed_epsilon: float  # ε(δ) of one release at the claimed σ, at the audit's δ
    delta: float  # the δ of the grid chosen on the first half
    confidence: float
    trials: int  # per world
    threshold: float
    tpr_low: float
    fpr_high: float
    dp_valid: bool  # the mechanism is accounted (its support is public)
    detectable_noise_scale: float  # power: noise ≤ this × the claim is flagged at this size

    @property
    def consistent(self) -> bool:
        """The empirical lower bound does not exceed the claim."""
        return self.epsilon_lower_bound <= self.claimed_epsilon


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


def claimed_mu(noise_multiplier: float, adjacency: Adjacency) -> float:
    """μ = Δ/(σS) of one release: Δ = 2S for replace-one, S for add/remove."""
    return (2.0 if adjacency == "replace_one" else 1.0) / noise_multiplier


def with_noise_scaled(algorithm: Algorithm, factor: float) -> Algorithm:
    """``algorithm`` whose mechanism adds ``factor`` × its noise (test-only knob)."""
    if factor == 1.0:
        return algorithm
    pipeline = algorithm.pipeline
    mechanism = dataclasses.replace(
        pipeline.mechanism, noise_multiplier=pipeline.mechanism.noise_multiplier * factor
    )
    return dataclasses.replace(
        algorithm, pipeline=dataclasses.replace(pipeline, mechanism=mechanism)
    )


def audit_layout(dim: int) -> ParamLayout:
    """Three layers of d/2, d/4 and d/4 coordinates: per-layer clipping and masks act."""
    sizes = (dim - 2 * (dim // 4), dim // 4, dim // 4)
    offsets = tuple(int(o) for o in np.cumsum((0, *sizes)))
    return ParamLayout(("a", "b", "c"), tuple((s,) for s in sizes), offsets)


@dataclass(frozen=True)
class CraftedRound:
    """The public side of the audit's rounds: coordinate scales, layout, drift direction."""

    layout: ParamLayout
    profile: torch.Tensor  # per-coordinate scale of the clients' updates (heavy-tailed)
    clip_norm: float
    sensitivity: float

    @classmethod
    def make(cls, dim: int, clip_norm: float, sensitivity: float, seed: int) -> CraftedRound:
        """Half of each layer's coordinates active (log-normal scales), half quiet (1/100):
        the other clients' top-k masks keep their active coordinates, not the quiet ones."""
        rng = numpy_rng(seed, Purpose.DATA)
        layout = audit_layout(dim)
        profile = np.full(dim, 0.01)
        for start, stop in layer_segments(layout, dim):
            active = start + rng.permutation(stop - start)[: (stop - start + 1) // 2]
            profile[active] = rng.lognormal(0.0, 0.5, size=active.size)
        return cls(layout, torch.tensor(profile, dtype=torch.float32), clip_norm, sensitivity)

    def canary_direction(self, algorithm: Algorithm, round_key: tuple[int, int]) -> torch.Tensor:
        """Unit v on the least-moving coordinate of each layer that the round releases."""
        size = self.profile.numel()
        support = algorithm.mechanism.support if algorithm.mechanism else None  # sample level
        released = (
            support.public_mask(size, self.layout, round_key)
            if isinstance(support, SharedMaskSupport)
            else None
        )
        scores = self.profile.double().clone()
        if released is not None:
            scores[released == 0] = math.inf
        v = torch.zeros(size)
        for start, stop in layer_segments(self.layout, size):
            v[start + int(torch.argmin(scores[start:stop]))] = 1.0
        return v / torch.linalg.vector_norm(v)

    def client_updates(self, generator: torch.Generator, count: int) -> torch.Tensor:
        """``count`` realistic updates (rows): a shared and an own direction on heavy-tailed
        coordinate scales, norms spread log-normally around C (some clipped, some not)."""
        size = self.profile.numel()
        shared = torch.randn(size, generator=generator) * self.profile
        own = torch.randn(count, size, generator=generator) * self.profile
        rows = 0.5 * shared / shared.norm() + own / own.norm(dim=1, keepdim=True)
        spread = torch.exp(0.5 * torch.randn(count, 1, generator=generator))
        return rows / rows.norm(dim=1, keepdim=True) * self.clip_norm * spread

    def gradients(self, generator: torch.Generator, count: int) -> torch.Tensor:
        """Each client's ∇f at its final weights (LUS's score), on the same coordinate scales."""
        return torch.randn(count, self.profile.numel(), generator=generator) * self.profile


def released_scores(
    algorithm: Algorithm,
    crafted: CraftedRound,
    cohort_size: int,
    num_clients: int,
    trials: int,
    canary_sign: float | None,
    seed: int,
    world: int,
) -> np.ndarray:
    """The release's move along the canary direction in ``trials`` independent rounds.

    ``canary_sign`` +1 / −1: the canary sends ±B·v; None: it is absent (add/remove).
    The other clients and the public randomness of trial t are the same in every world; the
    noise is drawn afresh per world.
    """
    size = crafted.profile.numel()
    magnitude = CANARY_NORM_FACTOR * crafted.sensitivity
    state = ServerState(torch.zeros(size), algorithm.server.initial_extras(torch.zeros(size)))
    scores = np.empty(trials)
    for t in range(trials):
        round_key = (seed, t)
        data = torch_generator(seed, t, Purpose.DATA)  # the same in every world
        updates = crafted.client_updates(data, cohort_size)
        gradients = crafted.gradients(data, cohort_size)
        direction = torch.randn(size, generator=data)
        drift = crafted.clip_norm / (LOCAL_STEPS * LOCAL_LR)  # ‖(1−β)Kη·g̃‖ ≤ C
        payload = {"direction": direction / torch.linalg.vector_norm(direction) * drift}
        v = crafted.canary_direction(algorithm, round_key)
        if canary_sign is not None:
            updates[0] = canary_sign * magnitude * v
        noise_generator = torch_generator(seed, world, t, Purpose.CLIENT_NOISE)
        total = PartialAggregate()
        for client in range(0 if canary_sign is not None else 1, cohort_size):
            ctx = ClientContext(
                noise_generator,  # one stream per trial and world: independent draws
                float(cohort_size),
                layout=crafted.layout,
                round_key=round_key,
                local_gradient=lambda kind, g=gradients[client]: g,
                payload=payload,
                local_steps=LOCAL_STEPS,
                lr=LOCAL_LR,
            )
            total.add({"delta": algorithm.pipeline(updates[client], ctx)}, 1.0)
        noise = algorithm.pipeline.server_noise(
            size,
            crafted.layout,
            round_key,
            torch_generator(seed, world, t, Purpose.SERVER_NOISE),
        )
        server_ctx = ServerContext(float(cohort_size), num_clients, noise)
        released = algorithm.server.step(state, total, server_ctx, algorithm.control_variates)
        scores[t] = float(torch.dot((released.params - state.params).double(), v.double()))
    return scores


def _bounds(
    positives: np.ndarray, negatives: np.ndarray, taus: np.ndarray, delta: float, confidence: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ε lower bound, TPR_low, FPR_high) of "score > τ" at ``confidence``, for every τ."""
    per_rate = 1 - (1 - confidence) / 2  # union bound over the two intervals
    tp = (positives[None, :] > taus[:, None]).sum(axis=1)
    fp = (negatives[None, :] > taus[:, None]).sum(axis=1)
    return _rate_bounds(tp, positives.size, fp, negatives.size, delta, per_rate)


def _rate_bounds(tp, n_pos, fp, n_neg, delta, per_rate):
    """Clopper–Pearson TPR_low and FPR_high from counts (vectorised), and the ε they force."""
    tp, fp = np.asarray(tp), np.asarray(fp)
    tpr_low = np.where(tp > 0, beta.ppf(1 - per_rate, np.maximum(tp, 1), n_pos - tp + 1), 0.0)
    fpr_high = np.where(fp < n_neg, beta.ppf(per_rate, fp + 1, np.maximum(n_neg - fp, 1)), 1.0)
    eps = np.array(
        [epsilon_from_rates(a, b, delta) for a, b in zip(tpr_low, fpr_high, strict=True)]
    )
    return eps, tpr_low, fpr_high


def _choose_test(
    positives: np.ndarray, negatives: np.ndarray, claims: dict[float, float], confidence: float
) -> tuple[float, float, float]:
    """(δ, τ, sign) with the largest lower bound minus claim on these trials."""
    best, choice = -math.inf, (DELTA_GRID[0], 0.0, 1.0)
    for sign in (1.0, -1.0):  # "score > τ" or "score < −τ"
        pos, neg = sign * positives, sign * negatives
        taus = np.quantile(np.concatenate([pos, neg]), np.linspace(0, 1, 201))
        for delta, claim in claims.items():
            margins = _bounds(pos, neg, taus, delta, confidence)[0] - claim
            if margins.max() > best:
                best, choice = float(margins.max()), (delta, float(taus[margins.argmax()]), sign)
    return choice


def _expected_margin(mu_true: float, claims: dict[float, float], half: int, confidence: float):
    """max over (δ, τ) of the expected-count lower bound minus the claim (Gaussian model)."""
    per_rate = 1 - (1 - confidence) / 2
    taus = np.linspace(-2.0, mu_true + 6.0, 161)
    tp = np.round(half * norm.sf(taus - mu_true)).astype(int)
    fp = np.round(half * norm.sf(taus)).astype(int)
    return max(
        float((_rate_bounds(tp, half, fp, half, delta, per_rate)[0] - claim).max())
        for delta, claim in claims.items()
    )


def detectable_noise_scale(mu: float, trials: int, confidence: float) -> float:
    """Largest s in (0, 1] whose mechanism (noise s × claimed, μ/s) this audit size flags."""
    claims = {delta: gaussian_epsilon(mu, delta) for delta in DELTA_GRID}
    half = trials - trials // 2

    def flagged(scale: float) -> bool:
        return _expected_margin(mu / scale, claims, half, confidence) > 0

    if not flagged(0.02):
        return 0.0
    lo, hi = 0.02, 1.0
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if flagged(mid) else (lo, mid)
    return lo


def audit_round(
    algorithm: Algorithm,
    cohort_size: int,
    num_clients: int,
    adjacency: Adjacency,
    trials: int = 1000,
    confidence: float = 0.95,
    dim: int = 16,
    seed: int = 0,
    noise_scale_for_testing: float = 1.0,
) -> AuditResult:
    """Audit one round of ``algorithm``'s mechanism; the canary is client 0 of the cohort."""
    check_audit_inputs(algorithm, trials)
    if dim < 8:
        raise ValueError(f"dim must be >= 8 (three layers of the audit layout), got {dim}")
    claim_algorithm = algorithm.bind(audit_layout(dim))
    mechanism = claim_algorithm.mechanism
    crafted = CraftedRound.make(dim, mechanism.clip.clip_norm, mechanism.sensitivity, seed)
    return audit_two_worlds(
        released_scores,
        claim_algorithm,
        crafted,
        (cohort_size, num_clients, trials),
        adjacency,
        confidence,
        seed,
        noise_scale_for_testing,
    )


def check_audit_inputs(algorithm: Algorithm, trials: int) -> None:
    if algorithm.mechanism is None or algorithm.pipeline.noise_multiplier <= 0:
        raise ValueError("the audit needs a private algorithm: clipping and Gaussian noise")
    if trials < 20:
        raise ValueError(f"trials must be >= 20 (10 to pick a test, 10 to run it), got {trials}")


def audit_two_worlds(
    scores,
    claim_algorithm: Algorithm,
    crafted: CraftedRound,
    cohort: tuple[int, int, int],
    adjacency: Adjacency,
    confidence: float,
    seed: int,
    noise_scale_for_testing: float,
) -> AuditResult:
    """``scores(run, crafted, cohort_size, num_clients, trials, canary_sign, seed, world)`` of
    the canary's world (+B·v) and its neighbour (−B·v, or absent), against the one-release claim
    of the bound algorithm's σ."""
    mechanism = claim_algorithm.mechanism
    mu = claimed_mu(mechanism.noise_multiplier * mechanism.noise_scale, adjacency)
    run = with_noise_scaled(claim_algorithm, noise_scale_for_testing)
    positives = scores(run, crafted, *cohort, canary_sign=1.0, seed=seed, world=1)
    other = -1.0 if adjacency == "replace_one" else None
    negatives = scores(run, crafted, *cohort, canary_sign=other, seed=seed, world=2)
    valid = claim_algorithm.unaccounted_reason is None
    return audit_result(positives, negatives, mu, confidence, valid)


def audit_result(
    positives: np.ndarray, negatives: np.ndarray, mu: float, confidence: float, dp_valid: bool
) -> AuditResult:
    """The test chosen on the first halves of the two worlds' scores, run on the second
    halves, against the claim of a Gaussian release with μ (at every δ of the grid)."""
    claims = {delta: gaussian_epsilon(mu, delta) for delta in DELTA_GRID}
    trials = len(positives)
    half = trials // 2
    delta, tau, sign = _choose_test(positives[:half], negatives[:half], claims, confidence)
    eps, tpr_low, fpr_high = (
        float(x[0])
        for x in _bounds(
            sign * positives[half:], sign * negatives[half:], np.array([tau]), delta, confidence
        )
    )
    return AuditResult(
        epsilon_lower_bound=eps,
        claimed_epsilon=claims[delta],
        delta=delta,
        confidence=confidence,
        trials=trials,
        threshold=sign * tau,
        tpr_low=tpr_low,
        fpr_high=fpr_high,
        dp_valid=dp_valid,
        detectable_noise_scale=detectable_noise_scale(mu, trials, confidence),
    )
