"""The tuning ε of k trials of one client-level setting, by each bound ``privacy.tuning`` has.

Every trial is T = 1,000 rounds of the Poisson-subsampled Gaussian at q = 0.01, σ = 1 (ε = 1.828
at δ = 1e-5 alone, the PLD accountant's docstring setting), validated on held-out clients. For
k = 1, 2, 4, 8, 16 the markdown table gives the composition of k trials (PLD, and RDP for
comparison) and Papernot–Steinke's bound on the selected model for a random number of trials
with mean k: Poisson(k) (Thm 6) and geometric, truncated negative binomial η = 1, γ = 1/k
(0.99 at k = 1; Thm 2), each from one trial's curve (the trials are identical).

Usage (from the repository root)::

    uv run python -m benchmarks.tuning_privacy
"""

from __future__ import annotations

import dataclasses

from privacy.accountant import ADJACENCY
from privacy.tuning import (
    TrialPrivacy,
    mechanism_trial,
    papernot_steinke_epsilon,
    tuning_statement,
)

SIGMA, Q, ROUNDS, DELTA = 1.0, 0.01, 1000, 1e-5
COUNTS = (1, 2, 4, 8, 16)


def trial(accountant: str, configuration: str) -> TrialPrivacy:
    mechanism = {"kind": "client", "sampling": "poisson", "runs": [[SIGMA, Q, ROUNDS]]}
    return mechanism_trial(
        mechanism,
        ADJACENCY["poisson"],
        accountant,
        delta=DELTA,
        threat_model="trusted server",
        epsilon_for="this run",
        configuration=configuration,
        validation="clients",
        held_out="the same held-out clients",
    )


def composition(trials) -> float:
    common = {"validation": "public", "delta": DELTA, "search": "grid"}
    return tuning_statement(trials, num_trials_distribution=None, **common).epsilon


def main() -> None:
    print("| k | composition (PLD) | composition (RDP) | P–S Poisson(k) | P–S geometric 1/k |")
    print("|---|---|---|---|---|")
    for k in COUNTS:
        trials = [trial("pld", str(i)) for i in range(k)]
        rdp = [dataclasses.replace(t, accountant="rdp") for t in trials]
        poisson = {"kind": "poisson", "mean": float(k)}
        geometric = {"kind": "truncated_negative_binomial", "eta": 1, "gamma": min(1 / k, 0.99)}
        row = [composition(trials), composition(rdp)]
        row += [papernot_steinke_epsilon(rdp, d, DELTA) for d in (poisson, geometric)]
        print(f"| {k} | " + " | ".join(f"{v:.3f}" for v in row) + " |")


if __name__ == "__main__":
    main()
