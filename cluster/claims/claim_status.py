"""What every privacy claim says the same way: valid or not, why, and how an ε reads.

A claim (``PrivacyClaim`` for client-level presets, ``SampleLevelClaim`` for sample-level ones)
supplies ``preset``, ``unaccounted_reason``, ``noise_multiplier`` (0: no noise),
``valid_threat_model`` (the threat model its ε holds under) and ``_epsilon_number`` (how a valid
ε is written); this base derives the rest, so that an unaccounted run reads identically
whatever its unit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class ClaimStatus(ABC):
    preset: str
    unaccounted_reason: str | None

    @property
    @abstractmethod
    def noise_multiplier(self) -> float:
        """σ of the mechanism that runs (0 without one)."""

    @property
    @abstractmethod
    def valid_threat_model(self) -> str:
        """Whom the ε holds against, when it holds."""

    @abstractmethod
    def _epsilon_number(self, epsilon: float, vs_server: float | None) -> str:
        """The terminal text of a valid ε."""

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
        return self.valid_threat_model

    def epsilon_text(self, epsilon: float | None, vs_server: float | None = None) -> str:
        """How an ε reads on the terminal: a number only where the mechanism has one."""
        if not self.private:
            return "ε ∞ (non-private)"
        if not self.dp_valid:
            return "ε n/a (dp_valid=false)"
        return self._epsilon_number(epsilon, vs_server)

    def unaccounted_notices(self) -> list[str]:
        """The start-of-run line of an unaccounted run (empty otherwise)."""
        if not self.private or self.dp_valid:
            return []
        return [
            f"privacy: dp_valid=false for {self.preset}: {self.unaccounted_reason}. "
            "No ε is reported for this run (ε not available)."
        ]

    def base_tags(self, unit: str) -> dict[str, str]:
        """Tags every private claim carries: unit, validity, threat model, and why no ε."""
        tags = {
            "privacy.unit": unit,
            "privacy.dp_valid": str(self.dp_valid).lower(),
            "privacy.threat_model": self.threat_model,
        }
        if not self.dp_valid:
            tags["privacy.unaccounted_reason"] = self.unaccounted_reason[:5000]
        return tags
