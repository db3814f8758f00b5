"""What a run's ε rests on: the mechanism that runs, the accountant, the report (the config
calibrated to its budget: ``cluster.claims.calibration``).

``PrivacyClaim`` is the one object every ε of a run comes from (terminal lines, MLflow metrics
and tags, the privacy report, compare tables). It reads σ, the sensitivity, the placement and
the noise support off the algorithm's ``GaussianMechanism``, and only the sampling (q = C_n/N,
the assumption, the accountant) and δ off the config. A mechanism whose noise support depends
on the clients' data is *unaccounted*: the claim has no ε, says why, and tags the run
``privacy.dp_valid=false``.

The sampling assumption follows the cohort sampler unless ``privacy.sampling`` overrides it. An
override that accounts another sampler than the one that runs (a fixed-size cohort accounted as
Poisson, as the DP-FedSAM paper does) is unaccounted too: no accountant's ε holds for it. The
papers' numbers come from running what they account: a Poisson cohort.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from algorithms.adaptive_clip import AdaptiveClip
from algorithms.algorithm import Algorithm
from algorithms.mechanism import GaussianMechanism
from cluster.claims.claim_status import ClaimStatus
from cluster.claims.sample_claim import SampleLevelClaim, sample_level_claim
from cluster.config import ExperimentConfig
from privacy.accountant import (
    ADJACENCY,
    accountant_class,
    accountants_for,
)
from privacy.adaptive_clipping import effective_noise_multiplier
from privacy.calibration import (
    as_run_accountant,
    ceil_significant,
    epsilon_for,
)
from privacy.participation import epsilon_vs_server


def accountant_factory(config: ExperimentConfig):
    """A zero-argument factory of the run's accountant."""
    return factory_for(config.accountant_name, config.sampling_assumption)


def factory_for(name: str, assumption: str):
    """A zero-argument factory of the accountant ``name`` under the sampling ``assumption``."""
    return as_run_accountant(accountant_class(name, assumption))


def format_sigma(sigma: float) -> str:
    return f"{ceil_significant(sigma):g}"


THREAT_SERVER = (
    "trusted server: the server sees the clipped updates and adds the noise; ε holds against "
    "anyone who sees the released models"
)
THREAT_CLIENT = (
    "secure aggregation with honest clients: ε holds against an observer of the noisy sum "
    "(the released models); a server that sees each upload faces each client's own noise "
    "only (epsilon_vs_server)"
)


@dataclass(frozen=True)
class PrivacyClaim(ClaimStatus):
    """The privacy a run may claim: read off its mechanism, with the config's sampling and δ."""

    unit = "client"

    preset: str
    mechanism: GaussianMechanism | None
    unaccounted_reason: str | None
    sample_rate: float  # q = C_n / N, what the accountant is charged
    noise_cohort_size: int  # C_n: the cohort the noise is sized for
    assumption: str
    accountant_name: str
    delta: float
    cohort_sampler: str = "fixed"
    # DPSFL-AC: std of the noise on the adaptive clip's count Σ(b_i − ½) (None: no such count)
    count_noise_on_sum: float | None = None
    deployment: str | None = None  # the deployment a noise cohort claims ε for
    fallback_accountant: str | None = None  # set by ``reported_by`` after a run
    secret_streams: bool = False  # privacy.secret_streams

    @property
    def update_noise_multiplier(self) -> float:
        """σ of the mechanism's noise on the updates."""
        return 0.0 if self.mechanism is None else self.mechanism.noise_multiplier

    @property
    def noise_multiplier(self) -> float:
        """σ the accountant is charged per round: the mechanism's, or with an adaptive clip the
        joint σ_eff = (σ⁻² + (2σ_b√m)⁻²)^(-1/2) of the update and count releases."""
        sigma = self.update_noise_multiplier
        if self.count_noise_on_sum is None or sigma == 0:
            return sigma
        return effective_noise_multiplier(sigma, self.count_noise_on_sum)

    @property
    def client_placed(self) -> bool:
        return self.private and self.mechanism.placement == "client"

    @property
    def client_noise_multiplier(self) -> float:
        """σ/√C_n: one client's own noise, relative to the sensitivity (client placement)."""
        return self.noise_multiplier / math.sqrt(self.noise_cohort_size)

    def new_accountant(self):
        """A fresh accountant for this claim (None when there is no ε to account)."""
        return factory_for(self.accountant_name, self.assumption)() if self.dp_valid else None

    def charge(self, accountant, round_index: int) -> None:
        """Charge round ``round_index`` to the run's accountant: one q-subsampled Gaussian."""
        accountant.step(self.noise_multiplier, self.sample_rate)

    def epsilon_after(self, accountant, round_index: int) -> float:
        """ε if round ``round_index`` were charged too (the budget check)."""
        return accountant.epsilon_after(self.noise_multiplier, self.sample_rate, self.delta)

    def epsilon(self, rounds: int) -> float:
        """ε after ``rounds`` rounds (for calculators and tests; runs step their accountant)."""
        if not self.dp_valid:
            raise ValueError(f"{self.preset} has no ε: {self.status}")
        accountant = self.new_accountant()
        if rounds:
            accountant.step(self.noise_multiplier, self.sample_rate, rounds)
        return accountant.epsilon(self.delta)

    def epsilon_vs_server(self, rounds: int) -> float | None:
        """ε against a server that sees each upload (client placement only; else None)."""
        if not (self.dp_valid and self.client_placed):
            return None
        factor = 2.0 if self.assumption == "without_replacement" else 1.0
        return epsilon_vs_server(
            self.client_noise_multiplier, self.sample_rate, rounds, self.delta, factor
        )

    @property
    def valid_threat_model(self) -> str:
        return THREAT_CLIENT if self.client_placed else THREAT_SERVER

    def _epsilon_qualifier(self, vs_server: float | None) -> str:
        return "" if vs_server is None else f" (vs server {vs_server:.3g})"

    @property
    def _assumption_text(self) -> str:
        return f", {self.assumption} sampling"

    def _deployment_notice(self) -> str:
        return (
            f"privacy: ε is that of a deployment of {self.deployment} "
            "(privacy.noise_cohort_size, privacy.population) with noise σS on each round's "
            "sum; this simulation adds that noise scaled to its own cohort, whose own ε "
            "(far larger) is not reported"
        )

    def _mechanism_notices(self) -> list[str]:
        if not self.client_placed:
            return []
        return [
            "privacy: client-placed noise; ε holds against an observer of the noisy sum "
            "(secure aggregation). Against a server that sees each upload, each client's "
            f"noise multiplier is σ/√C_n = {self.client_noise_multiplier:.4g}: "
            "epsilon_vs_server"
        ]

    def _mechanism_tags(self) -> dict[str, str]:
        m = self.mechanism
        return {
            "privacy.clipping": "adaptive" if self.count_noise_on_sum is not None else m.clip.rule,
            "privacy.noise_placement": m.placement,
            "privacy.noise_support": m.support.description,
            "privacy.sensitivity": f"{m.sensitivity:g}" if math.isfinite(m.sensitivity) else "none",
            "privacy.noise_multiplier": f"{self.noise_multiplier:g}",
            "privacy.update_noise_multiplier": f"{self.update_noise_multiplier:g}",
            "privacy.sample_rate": f"{self.sample_rate:g}",
        }

    def _assumption_tags(self) -> dict[str, str]:
        return {
            "privacy.assumption": f"{self.assumption}-subsampled gaussian",
            "privacy.adjacency": ADJACENCY[self.assumption],
        }


def privacy_claim(
    config: ExperimentConfig, algorithm: Algorithm, client_sizes=None
) -> PrivacyClaim | SampleLevelClaim:
    """The claim of ``config`` run with ``algorithm`` (already built, e.g. bound to a model).

    Sample-level presets get a ``SampleLevelClaim``; its accountant needs the clients' sizes
    (the record rate s), which only the text and tags can do without."""
    if config.sample_level:
        return sample_level_claim(config, algorithm, client_sizes)
    return PrivacyClaim(
        preset=config.algorithm.name,
        mechanism=algorithm.mechanism,
        unaccounted_reason=algorithm.unaccounted_reason or config.setup_unaccounted_reason,
        sample_rate=config.accounting_sample_rate,
        noise_cohort_size=config.noise_cohort_size,
        assumption=config.sampling_assumption,
        accountant_name=config.accountant_name,
        delta=config.delta,
        cohort_sampler=config.cohort.sampling,
        count_noise_on_sum=count_noise_on_sum(algorithm, config),
        deployment=config.deployment,
        secret_streams=config.privacy.secret_streams,
    )


def count_noise_on_sum(algorithm: Algorithm, config: ExperimentConfig) -> float | None:
    """σ_b√C_n of an adaptive clip's count release (C_n: the noise cohort), None without one."""
    if algorithm.adaptive_clip is None:
        return None
    return AdaptiveClip.accounted_noise(
        algorithm.adaptive_clip.count_noise, config.noise_cohort_size
    )


def privacy_warnings(config: ExperimentConfig, client_sizes) -> list[str]:
    """Config-level warnings for a private run: a configured δ ≥ 1/n, which permits
    publishing one unit's data in the clear, n the clients (client level) or the training
    records of all clients (sample level, ``client_sizes`` summed; for a deployment
    ``privacy.population`` N of them, N/M times as many: ``sample_claim.record_delta``'s count)."""
    delta = config.privacy.delta
    if config.sample_level:
        scale = config.population / config.data.num_clients
        count, symbol, unit = round(sum(client_sizes) * scale), "R", "training record"
    else:
        count, symbol, unit = config.population, "N", "client"
    if delta is None or delta < 1 / count:
        return []
    return [
        f"privacy: δ = {delta:g} ≥ 1/{symbol} = {1 / count:g} ({symbol} = {count} {unit}s): a "
        f"mechanism that publishes one random {unit}'s data in the clear meets such a δ; "
        f"prefer δ ≤ {symbol}^-1.1 = {count**-1.1:.3g} (the default when privacy.delta is unset)"
    ]


def _epsilon_under(claim: PrivacyClaim, name: str, rounds: int) -> float | str | None:
    """ε under accountant ``name`` (no RDP fallback), "n/a: why" where it refuses; None for ∞."""
    try:
        cls = accountant_class(name, claim.assumption)
        epsilon = epsilon_for(claim.noise_multiplier, claim.sample_rate, rounds, claim.delta, cls)
    except ValueError as error:
        return f"n/a: {error}"
    return epsilon if math.isfinite(epsilon) else None


def _noise_std_on_sum(mechanism: GaussianMechanism, cohort_size: int) -> float:
    """The noise std the sum carries: Z's σSk, or under ``local`` placement (every upload
    carries the whole Z) √m times it."""
    if mechanism.placement == "local":
        return mechanism.sum_noise_std * math.sqrt(cohort_size)
    return mechanism.sum_noise_std


def privacy_report(
    config: ExperimentConfig, claim: PrivacyClaim, rounds: int, epsilon: float | None
) -> dict:
    """The JSON privacy report a run attaches to MLflow."""
    if isinstance(claim, SampleLevelClaim):
        return claim.report(rounds, epsilon)
    report = claim.report_head(rounds, epsilon)
    if not claim.private:
        return report
    m = claim.mechanism
    adaptive = claim.count_noise_on_sum is not None
    report.update(
        noise_multiplier=claim.noise_multiplier,
        update_noise_multiplier=claim.update_noise_multiplier,
        count_noise_on_sum=claim.count_noise_on_sum,
        clip_norm=m.clip.clip_norm,
        clipping=f"{'adaptive (C₀ given)' if adaptive else 'fixed'}, {m.clip.scope} L2",
        sensitivity=m.sensitivity,
        noise_placement=m.placement,
        noise_support=m.support.description,
        noise_std_on_sum=_noise_std_on_sum(m, config.cohort.size),
        noise_std_on_mean=(
            _noise_std_on_sum(m, config.cohort.size) / config.cohort.size
            if config.algorithm.mean_denominator == "nominal"
            else "σS/|P_t|: divided by each round's realised count of uploads"
        ),
        sample_rate=claim.sample_rate,
        cohort_size=config.cohort.size,
        cohort_sampler=config.cohort.sampling,
        noise_cohort_size=claim.noise_cohort_size,
        population=config.population,
    )
    if m.clip.rule == "median":  # no C, no S: each client's own median sizes its noise
        report.update(
            clip_norm=None,
            clipping=f"per-client median, {m.clip.scope} L2",
            sensitivity=None,
            noise_std_on_sum="σ·C_i"
            + (f"·{m.noise_scale:g}" if m.noise_scale != 1 else "")
            + ("/√m" if m.placement == "client" else "")
            + " from each client i (C_i its median)",
            noise_std_on_mean="the sum's, divided by "
            + (
                "the cohort size"
                if config.algorithm.mean_denominator == "nominal"
                else "each round's realised count of uploads"
            ),
        )
    if not claim.dp_valid:
        report.update(epsilon=None, epsilon_not_available=claim.unaccounted_reason)
        return report
    report.update(
        accountant=claim.reporting_accountant,
        accountant_refused=claim.fallback_accountant and claim.accountant_name,
        sampling_assumption=claim.assumption,
        adjacency=ADJACENCY[claim.assumption],
        calibrate=config.privacy.calibrate,
        target_epsilon=config.privacy.target_epsilon,
        epsilon_by_accountant={
            name: _epsilon_under(claim, name, rounds) for name in accountants_for(claim.assumption)
        },
    )
    if claim.client_placed:
        report.update(
            client_noise_multiplier=claim.client_noise_multiplier,
            epsilon_vs_server=claim.epsilon_vs_server(rounds),
        )
    return report
