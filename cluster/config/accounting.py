"""``cohort:`` and ``privacy:``: who takes part each round, and how the ε is accounted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    # The key of the run's random streams (cohorts, local batches, noise) drawn from the
    # operating system's entropy and kept only in the run's checkpoint, never logged: the
    # logged seed then does not regenerate the noise (the run is not repeatable bit for bit;
    # a resume continues its streams). false: the streams are keyed by `stream_seed`/`seed`.
    secret_streams: bool = False
