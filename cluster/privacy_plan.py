"""What a run's ε rests on: the accountant it uses, calibration before it starts, and the report.

The driver charges one subsampled Gaussian per round at the accounting rate q = C_n/N (the
noise cohort, by default the cohort, over the population) with the configured σ. The sampling
assumption follows the cohort sampler unless ``privacy.sampling`` overrides it; an override is
recorded and warned about, because the ε is then an approximation (e.g. a fixed-size cohort
accounted as Poisson, as the DP-FedSAM paper does).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

from cluster.config import ConfigError, ExperimentConfig
from privacy.accountant import (
    ADJACENCY,
    accountant_class,
    accountants_for,
    assumption_for_sampler,
)
from privacy.calibration import calibrate_sigma, epsilon_for, max_rounds


def accountant_factory(config: ExperimentConfig):
    """A zero-argument factory of the run's accountant."""
    return _factory(config.accountant_name, config.sampling_assumption)


def _factory(name: str, assumption: str):
    cls = accountant_class(name, assumption)
    return lambda: cls(fallback_to_rdp=True)


def make_accountant(config: ExperimentConfig):
    return accountant_factory(config)()


def mismatch_warning(config: ExperimentConfig) -> str | None:
    """Why the ε is an approximation, when the sampler and the accountant's assumption differ."""
    sampler = config.cohort.sampling
    if config.sampling_assumption == assumption_for_sampler(sampler):
        return None
    return (
        f"privacy: the cohort is sampled {sampler} but ε is accounted as "
        f"{config.sampling_assumption.replace('_', ' ')} (privacy.sampling); "
        "the reported ε is an approximation, not a guarantee for this sampler"
    )


@functools.lru_cache(maxsize=64)
def _calibrated_sigma(
    target: float, delta: float, q: float, rounds: int, accountant: str, assumption: str
) -> float:
    """Memoised: a comparison calibrates every run × seed to one budget, seconds each with PLD."""
    return calibrate_sigma(target, delta, q, rounds, _factory(accountant, assumption))


def calibrated(config: ExperimentConfig) -> ExperimentConfig:
    """``config`` with σ or the number of rounds set by ``privacy.calibrate`` (else unchanged)."""
    p = config.privacy
    if p.calibrate == "none":
        return config
    q, delta = config.accounting_sample_rate, config.delta
    if p.calibrate == "sigma":
        try:
            sigma = _calibrated_sigma(
                p.target_epsilon,
                delta,
                q,
                config.rounds,
                config.accountant_name,
                config.sampling_assumption,
            )
        except ValueError as error:
            raise ConfigError("privacy.target_epsilon", p.target_epsilon, str(error)) from error
        algorithm = dataclasses.replace(config.algorithm, noise_multiplier=sigma)
        return dataclasses.replace(config, algorithm=algorithm)
    sigma = config.algorithm.noise_multiplier
    rounds = max_rounds(sigma, q, delta, p.target_epsilon, accountant_factory(config), limit=10**6)
    if rounds == 0:
        raise ConfigError(
            "privacy.target_epsilon",
            p.target_epsilon,
            f"even one round at σ={sigma:g}, q={q:g} exceeds it at δ={delta:g}; raise the "
            "budget or algorithm.noise_multiplier",
        )
    return dataclasses.replace(config, rounds=rounds)


def calibration_line(before: ExperimentConfig, after: ExperimentConfig, seconds: float) -> str:
    what = (
        f"σ = {after.algorithm.noise_multiplier:.4g}"
        if before.privacy.calibrate == "sigma"
        else f"{after.rounds} rounds"
    )
    return (
        f"calibrated {what} for ε ≤ {after.privacy.target_epsilon:g} at δ = {after.delta:g}, "
        f"q = {after.accounting_sample_rate:g} ({after.accountant_name}, {seconds:.1f} s)"
    )


def calibrate_with_message(config: ExperimentConfig, say=print) -> ExperimentConfig:
    if config.privacy.calibrate == "none":
        return config
    start = time.perf_counter()
    after = calibrated(config)
    say(calibration_line(config, after, time.perf_counter() - start))
    return after


def privacy_tags(config: ExperimentConfig, noise_multiplier: float) -> dict[str, str]:
    """MLflow tags: what the ε rests on."""
    if not noise_multiplier:
        return {"privacy.unit": "none"}
    assumption = config.sampling_assumption
    return {
        "privacy.unit": "client",
        "privacy.accountant": config.accountant_name,
        "privacy.assumption": f"{assumption}-subsampled gaussian",
        "privacy.adjacency": ADJACENCY[assumption],
        "privacy.cohort_sampler": config.cohort.sampling,
        "privacy.assumption_mismatch": str(mismatch_warning(config) is not None).lower(),
        "privacy.delta": f"{config.delta:g}",
        "privacy.noise_multiplier": f"{noise_multiplier:g}",
        "privacy.sample_rate": f"{config.accounting_sample_rate:g}",
    }


def _epsilon_under(
    config: ExperimentConfig, name: str, sigma: float, rounds: int
) -> float | str | None:
    """ε under accountant ``name`` (no RDP fallback), "n/a: why" where it refuses; None for ∞."""
    try:
        cls = accountant_class(name, config.sampling_assumption)
        epsilon = epsilon_for(sigma, config.accounting_sample_rate, rounds, config.delta, cls)
    except ValueError as error:
        return f"n/a: {error}"
    return epsilon if math.isfinite(epsilon) else None


def privacy_report(
    config: ExperimentConfig, noise_multiplier: float, rounds: int, epsilon: float | None
) -> dict:
    """The JSON privacy report a run attaches to MLflow."""
    p = config.privacy
    report = {
        "unit": "client" if noise_multiplier else "none",
        "rounds": rounds,
        "delta": config.delta,
        "epsilon": epsilon if epsilon is not None and math.isfinite(epsilon) else None,
    }
    if not noise_multiplier:
        return report
    report.update(
        accountant=config.accountant_name,
        sampling_assumption=config.sampling_assumption,
        adjacency=ADJACENCY[config.sampling_assumption],
        cohort_sampler=config.cohort.sampling,
        assumption_warning=mismatch_warning(config),
        noise_multiplier=noise_multiplier,
        clip_norm=config.algorithm.clip_norm,
        clipping=f"fixed, {config.algorithm.clip_scope or 'flat'} L2",
        noise_placement=config.noise_placement,
        sample_rate=config.accounting_sample_rate,
        cohort_size=config.cohort.size,
        noise_cohort_size=config.noise_cohort_size,
        noise_std_on_mean=noise_multiplier * config.algorithm.clip_norm / config.noise_cohort_size,
        population=config.population,
        calibrate=p.calibrate,
        target_epsilon=p.target_epsilon,
        epsilon_by_accountant={
            name: _epsilon_under(config, name, noise_multiplier, rounds)
            for name in accountants_for(config.sampling_assumption)
        },
    )
    return report
