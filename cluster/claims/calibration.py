"""A config calibrated to its privacy budget (``privacy.calibrate``): the smallest σ that keeps
ε within ``privacy.target_epsilon`` after the run's rounds, or the most rounds at its σ, for the
run's own accountant (a sample-level run's record-level one)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time

from cluster.claims.privacy_plan import (
    accountant_factory,
    count_noise_on_sum,
    factory_for,
    format_sigma,
)
from cluster.claims.sample_claim import sample_level_claim
from cluster.config import ConfigError, ExperimentConfig
from cluster.runtime.store import open_store
from privacy.adaptive_clipping import effective_noise_multiplier, update_noise_multiplier
from privacy.calibration import calibrate_sigma, ceil_significant, max_rounds


@functools.lru_cache(maxsize=64)
def _calibrated_sigma(
    target: float, delta: float, q: float, rounds: int, accountant: str, assumption: str
) -> float:
    """Memoised: a comparison calibrates every run × seed to one budget, seconds each with PLD."""
    return calibrate_sigma(target, delta, q, rounds, factory_for(accountant, assumption))


def _sample_level_accounting(config: ExperimentConfig, client_sizes):
    """(accountant factory, δ) of a sample-level config; opens its store for the sizes."""
    if client_sizes is None:
        client_sizes = open_store(config)[0].client_sizes
    algorithm = config._build_algorithm(1.0)  # structure only; σ is the search variable
    claim = sample_level_claim(config, algorithm, client_sizes)
    return claim.factory(), claim.delta


def calibrated(config: ExperimentConfig, client_sizes=None) -> ExperimentConfig:
    """``config`` with σ or the number of rounds set by ``privacy.calibrate`` (else unchanged).

    Sample level: σ_g or T for the run's record-level accountant over all the rounds it
    charges (warm-up included). Config validation has already refused calibration for an
    unaccounted preset."""
    p = config.privacy
    if p.calibrate == "none":
        return config
    q, delta = config.accounting_sample_rate, config.delta
    if config.sample_level:  # its accountants (DP-SCAFFOLD's "paper" among them) are its own
        factory, delta = _sample_level_accounting(config, client_sizes)
        extra = config.warmup_rounds
    else:
        factory, extra = accountant_factory(config), 0
    if p.calibrate == "sigma":
        try:
            if config.sample_level:
                sigma = calibrate_sigma(p.target_epsilon, delta, q, config.total_rounds, factory)
            else:
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
        count_noise = count_noise_on_sum(config._build_algorithm(1.0), config)
        if count_noise is not None:  # the budget is σ_eff; the updates get what is left
            if sigma >= 2 * count_noise:
                per_client = count_noise / math.sqrt(config.noise_cohort_size)
                raise ConfigError(
                    "algorithm.clip_count_noise",
                    per_client,
                    f"on the count of {config.noise_cohort_size} clients the bits' noise "
                    f"σ_b√C_n = {count_noise:.4g} costs more than the whole budget "
                    f"(σ = {sigma:.4g} needs more than σ/2); raise clip_count_noise above "
                    f"{ceil_significant(sigma / (2 * math.sqrt(config.noise_cohort_size)))}",
                )
            sigma = update_noise_multiplier(sigma, count_noise)
        algorithm = dataclasses.replace(config.algorithm, noise_multiplier=sigma)
        return dataclasses.replace(config, algorithm=algorithm)
    sigma = config.algorithm.noise_multiplier
    count_noise = count_noise_on_sum(config._build_algorithm(sigma), config)
    if count_noise is not None:
        sigma = effective_noise_multiplier(sigma, count_noise)
    rounds = max_rounds(sigma, q, delta, p.target_epsilon, factory, limit=10**6) - extra
    if rounds <= 0:
        raise ConfigError(
            "privacy.target_epsilon",
            p.target_epsilon,
            f"even one round at σ={sigma:g}, q={q:g} exceeds it at δ={delta:g}; raise the "
            "budget or algorithm.noise_multiplier",
        )
    return dataclasses.replace(config, rounds=rounds)


def calibration_line(
    before: ExperimentConfig, after: ExperimentConfig, seconds: float, delta: float
) -> str:
    what = (
        f"σ = {format_sigma(after.algorithm.noise_multiplier)}"
        if before.privacy.calibrate == "sigma"
        else f"{after.rounds} rounds"
    )
    return (
        f"calibrated {what} for ε ≤ {after.privacy.target_epsilon:g} at δ = {delta:g}, "
        f"q = {after.accounting_sample_rate:g} ({after.accountant_name}, {seconds:.1f} s)"
    )


def calibrate_with_message(config: ExperimentConfig, say=print) -> ExperimentConfig:
    if config.privacy.calibrate == "none":
        return config
    start = time.perf_counter()
    after = calibrated(config)
    seconds = time.perf_counter() - start
    # A sample-level run's default δ is over its records, not its clients.
    delta = _sample_level_accounting(after, None)[1] if after.sample_level else after.delta
    say(calibration_line(config, after, seconds, delta))
    return after
