"""``python -m cluster audit CONFIG``: an empirical lower bound on ε next to the accountant's.

It audits the mechanism the ε is claimed for: one round of the configured algorithm's update
pipeline and server rule, with a cohort drawn by the configured sampler (with a noise cohort:
``noise_cohort_size`` clients of ``population``, as accounted). See ``privacy.audit``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from algorithms.presets import PRIVATE_PRESETS
from cluster.cohort import sample_cohort
from cluster.config import ConfigError, ExperimentConfig, load_config
from cluster.privacy_plan import accountant_factory, calibrated
from privacy.audit import AuditResult, audit_round
from privacy.calibration import epsilon_for


def add_parser(commands) -> None:
    p = commands.add_parser(
        "audit",
        help="privacy audit: empirical ε lower bound (canary client) vs the accountant's ε",
        description="Runs one round of the configured client→server mechanism many times with "
        "and without a canary client and reports a Clopper–Pearson lower bound on ε. Exit code "
        "1 when the lower bound exceeds the accountant's ε (a broken mechanism).",
    )
    p.add_argument("config", help="experiment YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--trials", type=int, default=2000, help="rounds per world (default 2000)")
    p.add_argument("--confidence", type=float, default=0.95, help="default 0.95")
    p.add_argument("--dim", type=int, default=16, help="update dimension (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--noise-scale-for-testing",
        type=float,
        default=1.0,
        help="TEST ONLY: multiply the noise the mechanism adds (the accountant keeps σ)",
    )
    p.set_defaults(handler=run)


def accounted_mechanism(config: ExperimentConfig) -> ExperimentConfig:
    """The config of the mechanism the ε is claimed for (a noise cohort becomes the cohort)."""
    p = config.privacy
    if p.noise_cohort_size is None and p.population is None:
        return config
    return dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, num_clients=config.population),
        cohort=dataclasses.replace(config.cohort, size=config.noise_cohort_size),
        privacy=dataclasses.replace(p, noise_cohort_size=None, population=None),
    )


def audit_config(
    config: ExperimentConfig,
    trials: int,
    confidence: float,
    dim: int,
    seed: int,
    noise_scale_for_testing: float = 1.0,
) -> AuditResult:
    mechanism = accounted_mechanism(calibrated(config))
    algorithm = mechanism.build_algorithm()
    sigma = algorithm.pipeline.noise_multiplier
    one_round = epsilon_for(
        sigma, config.accounting_sample_rate, 1, config.delta, accountant_factory(config)
    )
    c = mechanism.cohort

    def cohort(trial: int):
        return sample_cohort(c.sampling, mechanism.data.num_clients, c.size, seed, trial)

    return audit_round(
        algorithm,
        cohort,
        float(c.size),
        mechanism.data.num_clients,
        one_round,
        config.delta,
        trials=trials,
        confidence=confidence,
        dim=dim,
        seed=seed,
        noise_scale_for_testing=noise_scale_for_testing,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.set)
        noised = config.algorithm.noise_multiplier or config.privacy.calibrate == "sigma"
        if config.algorithm.name not in PRIVATE_PRESETS or not noised:
            raise ConfigError(
                "algorithm.name", config.algorithm.name, "the audit needs a DP preset"
            )
        start = time.perf_counter()
        result = audit_config(
            config, args.trials, args.confidence, args.dim, args.seed, args.noise_scale_for_testing
        )
    except (ConfigError, ValueError) as error:
        print(f"audit: {error}", file=sys.stderr)
        return 2
    print(
        f"audit of one round of {config.algorithm.name}: cohort {config.cohort.size} "
        f"({config.cohort.sampling}) of {config.data.num_clients}, {args.trials} trials per world, "
        f"{time.perf_counter() - start:.1f} s"
    )
    if args.noise_scale_for_testing != 1.0:
        print(f"TEST KNOB: the mechanism's noise is scaled by {args.noise_scale_for_testing:g}")
    print(
        f"accountant ({config.accountant_name}, {config.sampling_assumption}) ε for one round: "
        f"{result.accountant_epsilon:.4f} at δ = {result.delta:g}"
    )
    print(
        f"empirical lower bound at {result.confidence:.0%} confidence: "
        f"ε ≥ {result.epsilon_lower_bound:.4f} (TPR ≥ {result.tpr_low:.4f}, "
        f"FPR ≤ {result.fpr_high:.4f})"
    )
    if result.consistent:
        print("consistent: the lower bound does not exceed the accountant's ε")
        return 0
    print("VIOLATION: the mechanism leaks more than the accountant claims")
    return 1
