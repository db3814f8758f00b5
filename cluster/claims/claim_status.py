"""What every privacy claim says the same way: valid or not, why, and how an ε reads.

A claim (``PrivacyClaim`` for client-level presets, ``SampleLevelClaim`` for sample-level ones)
supplies its fields (``preset``, ``unaccounted_reason``, ``accountant_name``, ``delta``,
``cohort_sampler``, ``deployment``, ``fallback_accountant``), its ``unit`` (what the ε
protects), ``noise_multiplier`` (0: no noise), ``valid_threat_model`` (the threat model its ε
holds under) and what differs by unit: how its ε is qualified, its accountant's assumption,
its start-of-run notices and its mechanism's tags. This base derives the rest (status, threat
model, the terminal text of an ε, the accounting text, the notices, the tags, the report's
head), so that a run reads identically whatever its unit where the two units mean the same
thing.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod

# What a private run's ε does not cover, in every run, whatever its mechanism (the privacy
# report's ``not_covered_by_epsilon``; docs/privacy.md): the key of its streams, logged or
# secret (privacy.secret_streams), and its diagnostics.
LOGGED_SEED_NOT_COVERED = (
    "the noise's seed: every noise draw comes from a stream of the run's seed (config.yaml, "
    "logged with the run), so that the run reproduces; whoever holds the seed regenerates the "
    "noise and can subtract it. The ε holds against an observer who does not: release models "
    "without their run's seed, or run with privacy.secret_streams"
)
SECRET_KEY_NOT_COVERED = (
    "the streams' secret key (privacy.secret_streams): the noise, cohorts and local batches "
    "come from streams of a 127-bit key from the operating system's entropy, logged nowhere "
    "and kept in the run's checkpoint, whose holder regenerates the noise (keep it as private "
    "as the data, or delete it once the run is done), and in Ray's control store as an "
    "argument of the actors' creation. Each stream is derived with BLAKE2b keyed by it; its "
    "generator (MT19937 on the CPU, its whole state set; Philox on a GPU, seeded with 64 "
    "bits; NumPy's PCG64 for cohorts) is not cryptographically secure, and the Gaussian "
    "draws are floating-point numbers, not hardened against attacks on their low-order bits"
)
DIAGNOSTICS_NOT_COVERED = (
    "the run's diagnostics, computed from the clients' data without noise and logged with it "
    "for the researcher who holds the data: clients and dropped_updates per round (the "
    "realised cohort), train_loss and train_accuracy, the clients' pre-clip norms "
    "(mean_pre_clip_norm, pre_clip_norm_p10/p50/p90, update_norms.npz), clip_fraction and the "
    "clients' other statistics (mean_alpha, ...); with data.eval_train the training objective "
    "and gradient dissimilarity, with data.test_per_client client_test_accuracy; the test "
    "metrics where data.client_test_fraction makes the clients' own rows the test set, and "
    "the validation metrics of rows or folds held out of the training clients"
)


def not_covered_by_epsilon(secret_streams: bool) -> list[str]:
    """The privacy report's ``not_covered_by_epsilon`` for a run whose streams' key is secret
    (``privacy.secret_streams``) or its logged seed."""
    key = SECRET_KEY_NOT_COVERED if secret_streams else LOGGED_SEED_NOT_COVERED
    return [key, DIAGNOSTICS_NOT_COVERED]


THREAT_SUFFIX = "; the noise unknown to them (see the privacy report's not_covered_by_epsilon)"


class ClaimStatus(ABC):
    unit: str  # what the ε protects: "client" or "record"
    preset: str
    unaccounted_reason: str | None
    accountant_name: str
    delta: float
    cohort_sampler: str
    # "C_n of N clients per round": the deployment the ε is claimed for (None: this run)
    deployment: str | None
    # The accountant whose bound the run's ε is where ``accountant_name`` refused it (beyond
    # its range: the RDP bound a run falls back to); None while ``accountant_name`` gives it.
    fallback_accountant: str | None
    # The streams' key is a secret (privacy.secret_streams), not the logged seed.
    secret_streams: bool

    @property
    @abstractmethod
    def noise_multiplier(self) -> float:
        """σ of the mechanism that runs (0 without one)."""

    @property
    @abstractmethod
    def valid_threat_model(self) -> str:
        """Whom the ε holds against, when it holds."""

    @abstractmethod
    def _epsilon_qualifier(self, vs_server: float | None) -> str:
        """What follows a valid ε on the terminal ("" for nothing)."""

    @property
    @abstractmethod
    def _assumption_text(self) -> str:
        """The accountant's assumption, as the accounting text continues after its name."""

    @abstractmethod
    def _deployment_notice(self) -> str:
        """The start-of-run line of a claim for a deployment: what its ε is that of."""

    @abstractmethod
    def _mechanism_notices(self) -> list[str]:
        """The start-of-run lines of a valid claim about its mechanism."""

    @abstractmethod
    def _mechanism_tags(self) -> dict[str, str]:
        """The tags of a private claim's mechanism and sampling (unit-specific)."""

    @abstractmethod
    def _assumption_tags(self) -> dict[str, str]:
        """The tags of a valid claim's accountant assumption (unit-specific)."""

    @property
    def private(self) -> bool:
        """Noise is added (σ > 0)."""
        return self.noise_multiplier > 0

    @property
    def dp_valid(self) -> bool:
        """An accountant's ε holds for what is released."""
        return self.private and self.unaccounted_reason is None

    @property
    def status(self) -> str:
        if not self.private:
            return "non-private (no noise)"
        if self.unaccounted_reason is not None:
            return f"dp_valid=false: {self.unaccounted_reason}"
        return "dp_valid=true"

    @property
    def threat_model(self) -> str:
        if not self.private:
            return "none: no noise is added"
        if self.unaccounted_reason is not None:
            return f"none: the mechanism is not DP as accounted ({self.unaccounted_reason})"
        return self.valid_threat_model + THREAT_SUFFIX

    def epsilon_text(self, epsilon: float | None, vs_server: float | None = None) -> str:
        """How an ε reads on the terminal: a number only where the mechanism has one."""
        if not self.private:
            return "ε ∞ (non-private)"
        if not self.dp_valid:
            return "ε n/a (dp_valid=false)"
        return f"ε {epsilon:.3f}{self._epsilon_qualifier(vs_server)}"

    @property
    def reporting_accountant(self) -> str:
        """The accountant whose value the reported ε is."""
        return self.fallback_accountant or self.accountant_name

    def reported_by(self, accountant) -> ClaimStatus:
        """This claim, naming the accountant that produced ``accountant``'s ε (its
        ``produced_by``): a fallback to the RDP bound is said, never labelled as the tight
        accountant."""
        used = accountant.produced_by(self.delta)
        if used == self.accountant_name:
            return self
        return dataclasses.replace(self, fallback_accountant=used)

    @property
    def accounting_text(self) -> str:
        """What the ε is accounted as: unit, accountant (the fallback's, where the configured
        one refused), assumption, and for which deployment."""
        name = self.accountant_name
        if self.fallback_accountant is not None:
            name = f"{self.fallback_accountant} ({name} refused: ε beyond its range)"
        text = f"{self.unit}-level, {name}{self._assumption_text}"
        if self.deployment is not None:
            text += f"; for a deployment of {self.deployment}, not this simulation's cohort"
        return text

    def notices(self) -> list[str]:
        """Lines for the start of a run: what the ε means, or why there is none."""
        if not self.private:
            return []
        if not self.dp_valid:
            return [
                f"privacy: dp_valid=false for {self.preset}: {self.unaccounted_reason}. "
                "No ε is reported for this run (ε not available)."
            ]
        deployment = [] if self.deployment is None else [self._deployment_notice()]
        return deployment + self._mechanism_notices()

    def tags(self) -> dict[str, str]:
        """MLflow tags: what the ε rests on, or why there is none."""
        if not self.private:
            return {"privacy.unit": "none", "privacy.threat_model": self.threat_model}
        tags = {
            "privacy.unit": self.unit,
            "privacy.dp_valid": str(self.dp_valid).lower(),
            "privacy.threat_model": self.threat_model,
        }
        if not self.dp_valid:
            tags["privacy.unaccounted_reason"] = self.unaccounted_reason[:5000]
        tags.update(self._mechanism_tags())
        tags.update(
            {"privacy.delta": f"{self.delta:g}", "privacy.cohort_sampler": self.cohort_sampler}
        )
        if self.dp_valid:
            tags["privacy.accountant"] = self.reporting_accountant
            if self.fallback_accountant is not None:
                tags["privacy.accountant_refused"] = self.accountant_name
            tags.update(self._assumption_tags())
            tags["privacy.epsilon_for"] = self.deployment or "this run"
        return tags

    def report_head(self, rounds: int, epsilon: float | None) -> dict:
        """The privacy report's fields every claim has: unit, validity, threat model, rounds, δ
        and the run's ε (None where it is infinite or there is none); for a valid claim, what
        the ε does not cover."""
        head = {
            "unit": self.unit if self.private else "none",
            "dp_valid": self.dp_valid,
            "threat_model": self.threat_model,
            "rounds": rounds,
            "delta": self.delta,
            "epsilon": epsilon if epsilon is not None and math.isfinite(epsilon) else None,
        }
        if self.dp_valid:
            head["not_covered_by_epsilon"] = not_covered_by_epsilon(self.secret_streams)
        return head
