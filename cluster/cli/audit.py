"""``python -m cluster audit CONFIG``: an empirical lower bound on ε next to the mechanism's claim.

It audits the mechanism the ε is claimed for: one round of the configured preset's update
pipeline and server rule with the canary in the cohort (with a noise cohort: a cohort of
``noise_cohort_size``, as accounted), against the ε of one release at the preset's σ. The
papers' unaccounted top-k variants are audited against the σ they claim. See ``privacy.audit``.
Sample-level presets: one client round with a canary record in every batch, against the K
composed Gaussian steps at σ_g (``privacy.audit_sample``). Sketched presets: the sketch's
adversarial canary against the noisy sketch sum, or the canary's own upload under DPSFL's
per-client counter noise (``privacy.audit_sketch``; ``--dim`` must give several coordinates
per counter).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import TYPE_CHECKING

from cluster.cli.ranges import Range, at_least_one, check_ranges, positive

# The audits (torch) are imported when one runs, so that `audit --help` starts at once.
if TYPE_CHECKING:
    from cluster.config import ExperimentConfig
    from privacy.audit import AuditResult


def add_parser(commands, help_text: str) -> None:
    p = commands.add_parser(
        "audit",
        help=help_text,
        description="Runs one round of the configured client→server mechanism many times with "
        "and without a canary client and reports a Clopper–Pearson lower bound on ε. Exit code "
        "1 when the lower bound exceeds the accountant's ε (a broken mechanism).",
    )
    p.add_argument("config", help="experiment YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--trials", type=int, default=1000, help="rounds per world (default 1000)")
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


# Each numeric option's range (cluster.cli.ranges), checked before the config is read.
_RANGES: dict[str, Range] = {
    # privacy.audit.check_audit_inputs's minimum: 10 trials to pick a test, 10 to run it
    "trials": (lambda v: v >= 20, "at least 20 trials per world"),
    "confidence": (lambda v: 0.0 < v < 1.0, "a confidence level in (0, 1), such as 0.95"),
    "dim": (at_least_one, "an update dimension of at least 1"),
    "seed": (lambda v: 0 <= v < 2**63, "a seed in [0, 2**63)"),
    "noise_scale_for_testing": (positive, "a finite factor > 0 (1: the mechanism's own noise)"),
}


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
    """Audit the configured preset's mechanism at the σ it runs with (calibrated if asked)."""
    from algorithms.presets import SKETCH_PRESETS
    from cluster.claims.calibration import calibrated
    from privacy.audit import audit_round
    from privacy.audit_sketch import audit_sketch_round

    mechanism = accounted_mechanism(calibrated(config))
    adjacency = "add_remove" if config.sampling_assumption == "poisson" else "replace_one"
    audit = audit_sketch_round if config.algorithm.name in SKETCH_PRESETS else audit_round
    return audit(
        mechanism.build_algorithm(),
        mechanism.cohort.size,
        mechanism.data.num_clients,
        adjacency,
        trials=trials,
        confidence=confidence,
        dim=dim,
        seed=seed,
        noise_scale_for_testing=noise_scale_for_testing,
    )


def run(args: argparse.Namespace) -> int:
    from algorithms.presets import PRIVATE_PRESETS
    from cluster.claims.calibration import calibrated
    from cluster.config import ConfigError, load_config
    from privacy.audit_sample import audit_sample_round

    try:
        check_ranges(args, _RANGES)
        config = load_config(args.config, args.set)
        noised = (
            config.algorithm.noise_multiplier
            or config.privacy.calibrate == "sigma"
            or config.paper_sketch_noise
        )
        if config.algorithm.name not in PRIVATE_PRESETS or not noised:
            raise ConfigError(
                "algorithm.name", config.algorithm.name, "the audit needs a DP preset with σ > 0"
            )
        if config.algorithm.clip_rule == "median":
            raise ConfigError(
                "algorithm.clip_rule",
                "median",
                "the median clip has no fixed bound for the canary to reach or for a claim to "
                "rest on; audit the fixed-clip run (clip_rule: fixed with a clip_norm)",
            )
        start = time.perf_counter()
        options = (args.trials, args.confidence, args.dim, args.seed, args.noise_scale_for_testing)
        if config.sample_level:
            mechanism = accounted_mechanism(calibrated(config))  # a deployment's clients
            result = audit_sample_round(mechanism.build_algorithm(), *options)
        else:
            result = audit_config(config, *options)
    except (ConfigError, ValueError) as error:
        print(f"audit: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    if config.sample_level:
        print(
            f"audit of one client round of {config.algorithm.name} (canary record in every "
            f"batch, the server sees the upload): K = {config.algorithm.local.local_steps}, "
            f"{args.trials} trials per world, {seconds:.1f} s"
        )
    else:
        print(
            f"audit of one round of {config.algorithm.name} (canary always in the cohort): "
            f"cohort {config.cohort.size} of {config.data.num_clients}, {args.trials} trials "
            f"per world, {seconds:.1f} s"
        )
    if args.noise_scale_for_testing != 1.0:
        print(f"TEST KNOB: the mechanism's noise is scaled by {args.noise_scale_for_testing:g}")
    if not result.dp_valid:
        print(
            f"note: {config.algorithm.name} as configured is unaccounted (dp_valid=false): the "
            "claim below is what its σ would give a correct mechanism; the run reports no ε"
        )
    print(
        f"claimed ε of one release at δ = {result.delta:g} (the audit's δ): "
        f"{result.claimed_epsilon:.4f}"
    )
    print(
        f"empirical lower bound at {result.confidence:.0%} confidence: "
        f"ε ≥ {result.epsilon_lower_bound:.4f} (TPR ≥ {result.tpr_low:.4f}, "
        f"FPR ≤ {result.fpr_high:.4f})"
    )
    print(
        f"power: at this size the audit flags a Gaussian mechanism whose noise is ≤ "
        f"{result.detectable_noise_scale:.2f} × the claimed noise (expected counts)"
    )
    if result.consistent:
        print("consistent: the lower bound does not exceed the claim")
        return 0
    print("VIOLATION: the mechanism leaks more than its σ claims")
    return 1
