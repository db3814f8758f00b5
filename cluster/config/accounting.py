"""``cohort:`` and ``privacy:``: who takes part each round, and how the ε is accounted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from algorithms.presets import PRIVATE_PRESETS
from cluster.config.errors import ConfigError, positive
from privacy.accountant import accountants_for

if TYPE_CHECKING:
    from cluster.config.experiment import ExperimentConfig


@dataclass
class CohortConfig:
    size: int = 20  # fixed: exactly this many; poisson: this many in expectation (q = size/N)
    sampling: Literal["fixed", "poisson"] = "fixed"


@dataclass
class PrivacyConfig:
    delta: float | None = None  # default population^-1.1
    target_epsilon: float | None = None  # stop before a round would exceed it
    # auto: pld under Poisson sampling, rdp without replacement (see default_accountant);
    # sample level: pld for Poisson batches, rdp for fixed-size ones; paper: DP-SCAFFOLD's own
    accountant: Literal["auto", "rdp", "pld", "prv", "rdp_classic", "paper"] = "auto"
    # match: the assumption of the cohort sampler (poisson → poisson, fixed → without_replacement)
    sampling: Literal["match", "poisson", "without_replacement"] = "match"
    # sigma: the smallest σ reaching target_epsilon after `rounds`; rounds: the most rounds at σ
    calibrate: Literal["none", "sigma", "rounds"] = "none"
    # Noise and accounting as if each cohort had this many clients (pfl-research's noise cohort)
    noise_cohort_size: int | None = None
    population: int | None = None  # clients the ε is claimed for; default data.num_clients


# ----------------------------------------------------------------------------- checks


def validate_cohort(c: ExperimentConfig) -> None:
    positive("cohort.size", c.cohort.size, "20")
    if c.cohort.size > c.data.num_clients:
        raise ConfigError(
            "cohort.size",
            c.cohort.size,
            f"the cohort cannot exceed the population of {c.data.num_clients} "
            f"clients; lower cohort.size or raise data.num_clients",
        )


def validate_privacy(c: ExperimentConfig) -> None:
    p = c.privacy
    if p.delta is not None and not 0 < p.delta < 1:
        raise ConfigError(
            "privacy.delta", p.delta, f"δ must be in (0, 1), e.g. {c.population**-1.1:.3g}"
        )
    if p.population is not None and p.population < c.data.num_clients:
        raise ConfigError(
            "privacy.population",
            p.population,
            f"the population the ε is claimed for must include the {c.data.num_clients} "
            "simulated clients; raise it or remove it",
        )
    if p.noise_cohort_size is not None and not 1 <= p.noise_cohort_size <= c.population:
        raise ConfigError(
            "privacy.noise_cohort_size",
            p.noise_cohort_size,
            f"must be in [1, {c.population}] (the population); raise privacy.population to "
            "claim ε for a larger deployment",
        )
    if c.accountant_name == "paper" and not c.sample_level:
        raise ConfigError(
            "privacy.accountant",
            "paper",
            "DP-SCAFFOLD's accountant is for the sample-level presets; use auto, rdp, pld or prv",
        )
    paper_sampling = ("fixed", "fresh", "replace_one")  # cohort, batches, adjacency it analyses
    ran = (c.cohort.sampling, c.batch_sampling, c.algorithm.adjacency or "replace_one")
    if c.accountant_name == "paper" and c.sample_level and ran != paper_sampling:
        raise ConfigError(
            "privacy.accountant",
            "paper",
            "DP-SCAFFOLD's accountant analyses fixed cohorts, fixed-size batches drawn without "
            f"replacement and replace-one adjacency; this run has {ran[0]} cohorts, {ran[1]} "
            f"batches and {ran[2]}: use auto (its number stays in the privacy report)",
        )
    if not c.sample_level and c.accountant_name not in accountants_for(c.sampling_assumption):
        raise ConfigError(
            "privacy.accountant",
            p.accountant,
            f"{p.accountant} has no analysis of sampling without replacement (the fixed-size "
            "cohort's assumption); use accountant: rdp or auto, or cohort.sampling: poisson",
        )
    if p.calibrate != "none" and p.target_epsilon is None:
        raise ConfigError(
            "privacy.calibrate", p.calibrate, "calibration needs privacy.target_epsilon, e.g. 8.0"
        )
    budgeted = p.calibrate != "none" or p.target_epsilon is not None
    reason = c.unaccounted_reason if budgeted else None
    if reason is not None:
        field_name = "privacy.calibrate" if p.calibrate != "none" else "privacy.target_epsilon"
        raise ConfigError(
            field_name,
            getattr(p, field_name.split(".")[1]),
            f"{c.algorithm.name} as configured has no ε to calibrate or budget ({reason}); "
            "remove it and set algorithm.noise_multiplier, or use the accounted variant "
            + (
                "(clip_rule: fixed with a clip_norm)"
                if c.sample_level or c.algorithm.clip_rule == "median"
                else "(privacy.sampling: match)"
                if c.sampling_mismatch
                else "(algorithm.mean_denominator: nominal)"
                if c.algorithm.mean_denominator != "nominal"
                else "(noise_support: dense, mask_source: clean)"
            ),
        )
    if p.calibrate == "rounds" and c.algorithm.noise_multiplier is None:
        raise ConfigError(
            "privacy.calibrate",
            p.calibrate,
            "calibrating rounds needs algorithm.noise_multiplier; or use calibrate: sigma",
        )
    if p.target_epsilon is not None:
        positive("privacy.target_epsilon", p.target_epsilon, "8.0")
        if c.algorithm.name not in PRIVATE_PRESETS:
            raise ConfigError(
                "privacy.target_epsilon",
                p.target_epsilon,
                f"{c.algorithm.name} is non-private; use dp_fedavg or remove it",
            )
        if not c.algorithm.noise_multiplier and p.calibrate != "sigma":
            raise ConfigError(
                "privacy.target_epsilon",
                p.target_epsilon,
                "σ = 0 gives no privacy to budget; set algorithm.noise_multiplier > 0",
            )
