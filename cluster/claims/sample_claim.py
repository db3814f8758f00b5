"""What a sample-level run's ε rests on: DP-SGD in the clients, a record-level accountant.

``SampleLevelClaim`` has ``PrivacyClaim``'s interface (terminal text, MLflow tags, the report,
the accountant) for the presets whose local steps are DP-SGD (``dp_fedavg_sample``,
``dp_scaffold``). It reads σ_g, C, the clipping scope, the adjacency and the clip rule off the
trainer's ``DpSgdGradient``; l, K, the batches and δ off the config; and the record rate s off
the store's client sizes (s = B/n of the smallest client: the most exposed record).

The default ε (``privacy.record_level``) holds against a server that sees every upload; the
paper's accountant (``privacy.accountant: paper``) and the aggregation PLD rest on the
aggregation assumption and are labelled with it wherever they appear.

A deployment (``privacy.noise_cohort_size`` C_n, ``privacy.population`` N; DP-FedAvg at sample
level only, ``cluster.config.families``): the ε is that of the deployment's mechanism, C_n of N
clients per round (l = C_n/N), each running K DP-SGD steps at σ_g on records sampled at rate
s = B/n (n: the smallest simulated client, the deployment's clients assumed no smaller). That
is exactly what the default accountants compute, since against the server a record has its own
client's noise only: C_n enters through l alone. It is *not* the ε of this simulation, whose m
of M clients each add √(m/C_n)·σ_g so that their mean update carries the noise of a C_n-client
mean (exactly where the local update is affine in the noise, e.g. K = 1; to first order
otherwise); that ε (far larger when C_n > m) is not reported. The side numbers (``paper``,
``aggregate``) read the deployment too (M = N, so lM = C_n); the default δ counts its records,
R·N/M for R simulated records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from algorithms.dpsgd import DpSgdGradient
from cluster.claims.claim_status import ClaimStatus
from cluster.config.errors import ConfigError
from privacy.pld import MIN_DELTA
from privacy.record_level import ASSUMPTIONS, RecordLevelAccountant, methods_for

THREAT_SAMPLE = (
    "record level, no trusted party: each client adds DP-SGD noise to every local step; ε "
    "holds against a server that sees every upload and knows the cohorts (so also against "
    "anyone who sees the models)"
)
THREAT_PAPER = (
    "record level under DP-SCAFFOLD's aggregation assumption: a third party who sees x^T "
    "only; against the server the paper's own bound is ε_s ≈ ε·√(M/l)"
)


def record_rate(batch_size: int, client_sizes) -> float:
    """s = B/n of the smallest client (every record's rate is at most this)."""
    smallest = int(np.min(np.asarray(client_sizes)))
    return min(1.0, batch_size / max(smallest, 1))


def record_delta(client_sizes, population_scale: float = 1.0) -> float:
    """Default δ for record-level DP: R^-1.1 for R training records in all, R the simulated
    clients' records times ``population_scale`` N/M (a deployment of N clients like them)."""
    return (float(np.sum(np.asarray(client_sizes))) * population_scale) ** -1.1


@dataclass(frozen=True)
class SampleLevelClaim(ClaimStatus):
    unit = "record"

    preset: str
    rule: DpSgdGradient | None  # None: σ_g = 0 and C = ∞ (plain SGD)
    unaccounted_reason: str | None
    client_rate: float  # l = m/M
    data_rate: float  # s = B/n (nan before the store is open)
    local_steps: int  # K
    num_clients: int  # M
    batch_sampling: str
    accountant_name: str
    delta: float
    warmup_rounds: int = 0
    cohort_sampler: str = "fixed"
    warm_start: str | None = None  # None, paper, authors_code
    deployment: str | None = None  # the deployment of a noise cohort the ε is claimed for
    fallback_accountant: str | None = None  # set by ``reported_by`` after a run
    secret_streams: bool = False  # privacy.secret_streams

    @property
    def noise_multiplier(self) -> float:
        return 0.0 if self.rule is None else self.rule.noise_multiplier

    @property
    def sample_rate(self) -> float:
        """What each round charges the accountant: the participation rate l."""
        return self.client_rate

    client_placed = False  # DP-SGD noise is each client's own; no secure aggregation assumed

    @property
    def adjacency(self) -> str:
        return self.rule.adjacency if self.rule else "replace_one"

    @property
    def assumption(self) -> str:
        return ASSUMPTIONS[self.accountant_name]

    def _accountant(self, method: str) -> RecordLevelAccountant:
        if math.isnan(self.data_rate):
            raise ValueError("the record rate s needs the store's client sizes")
        return RecordLevelAccountant(
            self.data_rate,
            self.local_steps,
            self.batch_sampling,
            self.adjacency,
            method,
            self.num_clients,
        )

    def new_accountant(self) -> RecordLevelAccountant | None:
        return self._accountant(self.accountant_name) if self.dp_valid else None

    def factory(self):
        """A zero-argument factory of the run's accountant (for calibration)."""
        return lambda: self._accountant(self.accountant_name)

    def round_charge(self, round_index: int) -> float | None:
        """The participation rate round ``round_index`` is charged at (None: nothing new).

        Every round is K steps at rate l, except under the authors' warm start: round 0 computes
        every client's c_i⁰ (a K-step release of every record, rate 1), and the rest of its
        warm-up only collects those."""
        if self.warm_start == "authors_code" and round_index < self.warmup_rounds:
            return 1.0 if round_index == 0 else None
        return self.client_rate

    def history(self, rounds: int) -> list[tuple[float, float, int]]:
        """(σ_g, rate, count) runs charged by ``rounds`` rounds (as ``round_charge`` says)."""
        sigma = self.noise_multiplier
        if self.warm_start != "authors_code":
            return [(sigma, self.client_rate, rounds)] if rounds else []
        training = max(rounds - self.warmup_rounds, 0)
        runs = [(sigma, 1.0, 1)] if rounds else []
        return runs + ([(sigma, self.client_rate, training)] if training else [])

    def charge(self, accountant: RecordLevelAccountant, round_index: int) -> None:
        rate = self.round_charge(round_index)
        if rate is not None:
            accountant.step(self.noise_multiplier, rate)

    def epsilon_after(self, accountant: RecordLevelAccountant, round_index: int) -> float:
        rate = self.round_charge(round_index)
        if rate is None:
            return accountant.epsilon(self.delta)
        return accountant.epsilon_after(self.noise_multiplier, rate, self.delta)

    def epsilon(self, rounds: int, method: str | None = None) -> float:
        if not self.dp_valid:
            raise ValueError(f"{self.preset} has no ε: {self.status}")
        accountant = self._accountant(method or self.accountant_name)
        return accountant.epsilon_of_history(self.history(rounds), self.delta)

    def uncounted_warm_start_epsilon(self, rounds: int) -> float | None:
        """ε the authors' code would claim for its warm start (the training rounds only)."""
        if self.warm_start != "authors_code" or not self.dp_valid:
            return None
        accountant = self._accountant(self.accountant_name)
        training = max(rounds - self.warmup_rounds, 0)
        return accountant.epsilon_of(self.noise_multiplier, self.client_rate, training, self.delta)

    def epsilon_vs_server(self, rounds: int) -> float | None:
        """The default ε already holds against the server; the paper's does not."""
        return None

    @property
    def valid_threat_model(self) -> str:
        return THREAT_PAPER if self.accountant_name in ("paper", "aggregate") else THREAT_SAMPLE

    def _epsilon_qualifier(self, vs_server: float | None) -> str:
        return " (paper's accountant)" if self.accountant_name == "paper" else ""

    @property
    def _assumption_text(self) -> str:
        return f": {self.assumption}"

    def _mechanism_notices(self) -> list[str]:
        lines = [
            f"privacy: record-level DP-SGD in every local step (σ_g {self.noise_multiplier:g}, "
            f"C {self.rule.clip_norm:g}, {self.adjacency}, s {self.data_rate:.4g}, "
            f"K {self.local_steps}, l {self.client_rate:.4g}); ε by {self.accountant_name}: "
            f"{self.assumption}"
        ]
        if self.warm_start == "paper":
            lines.append(
                f"privacy: {self.warmup_rounds} warm-up rounds (c_i⁰, no model update) are "
                "charged like training rounds"
            )
        elif self.warm_start == "authors_code":
            lines.append(
                "privacy: the authors' warm start computes every client's c_i⁰ in round 0: one "
                "K-step release of every record (rate 1), charged; the authors do not count it"
            )
        return lines

    def _deployment_notice(self) -> str:
        factor = self.rule.simulation_noise_factor
        return (
            f"privacy: ε is that of a deployment of {self.deployment} "
            "(privacy.noise_cohort_size, privacy.population), each client adding DP-SGD noise "
            f"σ_g in every local step; this simulation's clients add σ_g·√(m/C_n) = "
            f"{factor:.4g}·σ_g, so that their mean update carries the deployment's noise "
            "(exactly for one local step, to first order for more); their own ε is not reported"
        )

    def _mechanism_tags(self) -> dict[str, str]:
        return {
            "privacy.noise_placement": "client, every local step (DP-SGD)",
            "privacy.noise_multiplier": f"{self.noise_multiplier:g}",
            "privacy.adjacency": self.adjacency.replace("_", " ") + " record",
            "privacy.client_rate": f"{self.client_rate:g}",
            "privacy.record_rate": f"{self.data_rate:g}",
            "privacy.local_steps": str(self.local_steps),
            "privacy.batch_sampling": self.batch_sampling,
        }

    def _assumption_tags(self) -> dict[str, str]:
        return {"privacy.assumption": self.assumption}

    def report(self, rounds: int, epsilon: float | None) -> dict:
        """The JSON privacy report, with ε under every method that analyses these batches."""
        report = self.report_head(rounds, epsilon)
        if not self.private:
            return report
        report.update(
            noise_multiplier=self.noise_multiplier,
            clip_norm=self.rule.clip_norm,
            clipping=f"{self.rule.clip_rule}, {self.rule.scope} L2, per example",
            adjacency=self.adjacency,
            noise_std_on_batch_sum=f"{self.rule.kappa:g}·S·σ_g",
            client_rate=self.client_rate,
            record_rate=self.data_rate,
            local_steps=self.local_steps,
            batch_sampling=self.batch_sampling,
            warmup_rounds=self.warmup_rounds,
            num_clients=self.num_clients,
            epsilon_for=self.deployment or "this run",
            simulation_noise_factor=self.rule.simulation_noise_factor,
        )
        if not self.dp_valid:
            report.update(epsilon=None, epsilon_not_available=self.unaccounted_reason)
            return report
        by_method = {}
        for method in methods_for(self.batch_sampling, self.adjacency):
            try:
                by_method[method] = {
                    "epsilon": self.epsilon(rounds, method),
                    "assumption": ASSUMPTIONS[method],
                }
            except ValueError as error:
                by_method[method] = {"epsilon": f"n/a: {error}", "assumption": ASSUMPTIONS[method]}
        report.update(accountant=self.accountant_name, epsilon_by_accountant=by_method)
        uncounted = self.uncounted_warm_start_epsilon(rounds)
        if uncounted is not None:
            report.update(
                warm_start="authors_code",
                epsilon_without_warm_start_cost=uncounted,
                warm_start_extra_epsilon=(epsilon or self.epsilon(rounds)) - uncounted,
            )
        return report


def sample_level_claim(config, algorithm, client_sizes=None) -> SampleLevelClaim:
    """The claim of a sample-level ``config`` run with ``algorithm`` on clients of these sizes
    (for the deployment that ``privacy.noise_cohort_size`` / ``population`` describe, if set)."""
    batch = config.algorithm.local.batch_size
    known = client_sizes is not None
    scale = config.population / config.data.num_clients
    delta = config.privacy.delta or (record_delta(client_sizes, scale) if known else config.delta)
    if config.accountant_name in ("pld", "aggregate") and delta < MIN_DELTA:
        raise ConfigError(
            "privacy.delta",
            config.privacy.delta,
            f"δ = {delta:.3g} (records^-1.1 where unset) is below {MIN_DELTA:g}, where the "
            f"{config.accountant_name} accountant's float64 convolution is not accurate; set "
            "privacy.accountant: rdp",
        )
    return SampleLevelClaim(
        preset=config.algorithm.name,
        rule=algorithm.sample_dp,
        unaccounted_reason=algorithm.unaccounted_reason or config.setup_unaccounted_reason,
        client_rate=config.accounting_sample_rate,
        data_rate=record_rate(batch, client_sizes) if known else math.nan,
        local_steps=config.algorithm.local.local_steps,
        num_clients=config.population,
        batch_sampling=config.batch_sampling,
        accountant_name=config.accountant_name,
        delta=delta,
        warmup_rounds=config.warmup_rounds,
        cohort_sampler=config.cohort.sampling,
        warm_start=algorithm.warm_start,
        deployment=config.deployment,
        secret_streams=config.privacy.secret_streams,
    )
