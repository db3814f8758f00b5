"""``python -m cluster privacy``: ε, calibrated σ or a round budget, under every accountant."""

from __future__ import annotations

import argparse
import functools
import math
import sys

from cluster.cli.ranges import Range, at_least_one, check_ranges, positive, rate

# The accountants (client level: NumPy/SciPy only, no torch, dp-accounting or scipy.stats,
# tests/test_privacy_numpy.py; sample level: dp-accounting) are imported when a calculation
# runs, so that `privacy --help` starts at once.


def _rows() -> list[tuple[str, str, str]]:
    """(label, accountant, sampling) rows of the client-level table: rdp, pld, prv, rdp-wor."""
    from privacy.accountant import accountants_for

    return [(name, name, "poisson") for name in accountants_for("poisson")] + [
        (f"{name}-wor", name, "without_replacement")
        for name in accountants_for("without_replacement")
    ]


def add_parser(commands, help_text: str) -> None:
    p = commands.add_parser(
        "privacy",
        help=help_text,
        description="Client level (default): one q-subsampled Gaussian per round. Give --sigma "
        "and --rounds for ε; --target-epsilon and --rounds for σ; --sigma and --target-epsilon "
        "for the largest number of rounds. Rows rdp/pld/prv: Poisson sampling, add/remove-one "
        "adjacency; rdp-wor: a fixed-size cohort without replacement, replace-one adjacency. "
        "--sample-level: record-level DP-SGD in the clients: the default accountant (each "
        "record protected by its own client's noise against a server that sees every upload), "
        "DP-SCAFFOLD's own accountant and the aggregation PLD, each with its assumption.",
    )
    p.add_argument("--sigma", type=float, help="noise multiplier σ")
    p.add_argument("--q", type=float, help="client sampling rate (client level)")
    p.add_argument("--rounds", type=int, help="number of rounds T")
    p.add_argument("--delta", type=float, help="δ (sample level default: 1/(M·R_train))")
    p.add_argument("--target-epsilon", type=float, help="privacy budget ε*")
    p.add_argument(
        "--count-noise",
        type=float,
        help="adaptive clipping: σ_b of the noisy clipped-count release (Andrew et al. 2021); "
        "--sigma is then the update noise and ε is charged at σ_eff = (σ⁻² + (2σ_b)⁻²)^(-1/2)",
    )
    p.add_argument(
        "--client-cohort",
        type=int,
        help="noise added by the clients of a cohort of this size: also print ε against a server "
        "that sees each upload (per-client multiplier σ/√C_n, participation ~ Binomial(T, q))",
    )
    p.add_argument("--sample-level", action="store_true", help="record-level DP-SGD in clients")
    p.add_argument("--l", type=float, help="client sampling rate (sample level)")
    p.add_argument("--s", type=float, help="data sampling rate inside a client (sample level)")
    p.add_argument("--local-steps", type=int, help="noisy local steps K per round")
    p.add_argument("--clients", type=int, help="number of clients M (sample level)")
    p.add_argument("--samples-per-client", type=int, help="training records per client R_train")
    p.add_argument(
        "--batches",
        choices=["fresh", "poisson"],
        default="fresh",
        help="sample level: fixed-size batches without replacement (the paper) or Poisson",
    )
    p.add_argument(
        "--adjacency",
        choices=["replace_one", "add_remove"],
        default="replace_one",
        help="sample level: neighbouring datasets (replace_one: the paper, noise 2Cσ_g)",
    )
    p.add_argument(
        "--dpsfl-paper",
        action="store_true",
        help="DPSFL's own noise: ρ from --target-epsilon and --delta (ε = ρ + 2√(ρ ln 1/δ)) and "
        "the per-counter σ = C√(l/(2ρ)) it adds (--clip, --sketch-rows; --cohort for the mean); "
        "no ε holds for it (its sensitivity C√l is a single coordinate's)",
    )
    p.add_argument("--clip", type=float, default=1.5, help="--dpsfl-paper: C (default 1.5)")
    p.add_argument("--sketch-rows", type=int, default=5, help="--dpsfl-paper: l (default 5)")
    p.add_argument("--cohort", type=int, help="--dpsfl-paper: clients averaged per round")
    p.set_defaults(handler=run)


# Each numeric argument's range (cluster.cli.ranges): a NaN σ or q would never end the RDP
# series, δ ≥ 1 gives a negative ε, negative rounds an ε of nothing.
_RANGES: dict[str, Range] = {
    "sigma": (lambda v: 0.0 <= v < math.inf, "a finite noise multiplier >= 0"),
    "q": (rate, "a sampling rate in (0, 1]"),
    "l": (rate, "a sampling rate in (0, 1]"),
    "s": (rate, "a sampling rate in (0, 1]"),
    "delta": (lambda v: 0.0 < v < 1.0, "a δ in (0, 1), such as 1e-5"),
    "target_epsilon": (positive, "a finite ε > 0"),
    "count_noise": (positive, "a finite σ_b > 0"),
    "clip": (positive, "a finite clip norm > 0"),
    "rounds": (at_least_one, "at least 1 round"),
    "client_cohort": (at_least_one, "at least 1 client"),
    "local_steps": (at_least_one, "at least 1 step"),
    "clients": (at_least_one, "at least 1 client"),
    "samples_per_client": (at_least_one, "at least 1 record"),
    "sketch_rows": (at_least_one, "at least 1 row"),
    "cohort": (at_least_one, "at least 1 client"),
}


def _need(args: argparse.Namespace, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")


def _client_level(args: argparse.Namespace) -> None:
    _need(args, "q", "delta")  # before the accountants' imports (seconds): bad input fails fast
    if args.count_noise is not None:
        _need(args, "sigma")
    given = [n for n in ("sigma", "rounds", "target_epsilon") if getattr(args, n) is not None]
    if len(given) < 2:
        raise ValueError("give two of --sigma, --rounds, --target-epsilon")

    from privacy.accountant import accountant_class
    from privacy.adaptive_clipping import effective_noise_multiplier
    from privacy.calibration import (
        as_run_accountant,
        calibrate_sigma,
        ceil_significant,
        epsilon_for,
        max_rounds,
    )

    if args.count_noise is not None:
        charged = effective_noise_multiplier(args.sigma, args.count_noise)
        print(
            f"adaptive clipping: update noise σ={args.sigma:g} and count noise σ_b="
            f"{args.count_noise:g} are charged as one Gaussian with σ_eff={charged:.4g}"
        )
        args.sigma = charged
    if args.sigma is not None and args.rounds is not None:
        header, compute = (
            "ε",
            lambda cls: epsilon_for(args.sigma, args.q, args.rounds, args.delta, cls),
        )
    elif args.target_epsilon is not None and args.rounds is not None:
        # As a run calibrates (``cluster.claims.calibration``), printed rounded up: the σ shown
        # meets the target itself (1.110337 would print as 1.11, which gives ε 8.004 > 8).
        header, compute = (
            "σ",
            lambda cls: ceil_significant(
                calibrate_sigma(
                    args.target_epsilon, args.delta, args.q, args.rounds, as_run_accountant(cls)
                )
            ),
        )
    else:  # σ and ε*
        header, compute = (
            "max rounds",
            lambda cls: max_rounds(args.sigma, args.q, args.delta, args.target_epsilon, cls),
        )
    print(f"client level, subsampled Gaussian, q={args.q:g}, δ={args.delta:g}")
    print(f"{'accountant':<12}{header}")
    for label, name, sampling in _rows():
        try:
            value = compute(accountant_class(name, sampling))
            print(f"{label:<12}{value:.4g}")
        except ValueError as error:
            print(f"{label:<12}n/a ({error})")
    if args.client_cohort is not None:
        _vs_server(args)


def _vs_server(args: argparse.Namespace) -> None:
    """ε against a server that sees every upload of client-placed noise (privacy.participation)."""
    from privacy.participation import epsilon_vs_server

    _need(args, "sigma", "rounds")
    per_client = args.sigma / math.sqrt(args.client_cohort)
    print(f"against a server that sees each upload (per-client σ/√C_n = {per_client:.4g}):")
    for label, factor in (("zero-out", 1.0), ("replace-one", 2.0)):
        eps = epsilon_vs_server(per_client, args.q, args.rounds, args.delta, factor)
        print(f"{label:<12}{eps:.4g}")


def _sample_level(args: argparse.Namespace) -> None:
    from privacy.calibration import max_rounds
    from privacy.record_level import ASSUMPTIONS, RecordLevelAccountant, methods_for
    from privacy.subsampling_wor import dpscaffold_delta

    _need(args, "sigma", "l", "s", "local_steps", "clients")
    if args.delta is None:
        _need(args, "samples_per_client")
        args.delta = dpscaffold_delta(args.clients, args.samples_per_client)
    if args.rounds is None and args.target_epsilon is None:
        raise ValueError("give --rounds or --target-epsilon")
    methods = methods_for(args.batches, args.adjacency)
    if not methods:
        raise ValueError("fixed-size batches are analysed under --adjacency replace_one only")
    print(
        f"sample level, l={args.l:g}, s={args.s:g}, K={args.local_steps}, M={args.clients}, "
        f"σ_g={args.sigma:g}, {args.batches} batches, {args.adjacency}, δ={args.delta:g}"
    )
    for method in methods:
        factory = functools.partial(
            RecordLevelAccountant,
            args.s,
            args.local_steps,
            args.batches,
            args.adjacency,
            method,
            args.clients,
        )
        default = " [default]" if method == methods[0] else ""
        print(f"{method}{default}: {ASSUMPTIONS[method]}")
        try:
            if args.rounds is not None:
                eps = factory().epsilon_of(args.sigma, args.l, args.rounds, args.delta)
                print(f"  ε after {args.rounds} rounds: {eps:.4g}")
            if args.target_epsilon is not None:
                best = max_rounds(args.sigma, args.l, args.delta, args.target_epsilon, factory)
                print(f"  max rounds at ε={args.target_epsilon:g}: {best}")
        except ValueError as error:
            print(f"  n/a ({error})")


def _dpsfl_paper(args: argparse.Namespace) -> None:
    """DPSFL's Alg. 1 noise, for reproducing its settings (unaccounted: see algorithms.sketch)."""
    from algorithms.sketch import noise_multiplier_for_rho, rho_from_epsilon

    _need(args, "target_epsilon", "delta")
    rho = rho_from_epsilon(args.target_epsilon, args.delta)
    counter_std = args.clip * math.sqrt(args.sketch_rows) * noise_multiplier_for_rho(rho)
    print(f"DPSFL's noise for ε={args.target_epsilon:g}, δ={args.delta:g}: ρ = {rho:.4f}")
    print(
        f"per client and counter: σ = C·√(l/(2ρ)) = {counter_std:.4f} (C={args.clip:g}, "
        f"l={args.sketch_rows})"
    )
    if args.cohort:
        mean_std = counter_std / math.sqrt(args.cohort)
        print(f"on the mean of {args.cohort} clients: σ/√N = {mean_std:.4f}")
    print(
        "dp_valid=false: C·√l bounds a change of one coordinate; a whole clipped gradient moves "
        "the sketch by up to 2C·√(Σ_j maxload_j) (23.1·C at 6.57M × 5 × 500k), so no ε holds"
    )


def run(args: argparse.Namespace) -> int:
    try:
        check_ranges(args, _RANGES)
        if args.dpsfl_paper:
            _dpsfl_paper(args)
            return 0
        (_sample_level if args.sample_level else _client_level)(args)
    except ValueError as error:
        print(f"privacy: {error}", file=sys.stderr)
        return 2
    return 0
