"""DPSFL-AC's adaptive clip norm (Zhang et al., Alg. 3–4): a noisy bit per client moves C.

Each client of round t reports whether clipping its gradient g_i to C_t keeps the top-k part
within a tolerance θ, b_i = 1{‖Top(clip(g_i, C_t)) − Top(g_i)‖ ≤ θ‖Top(g_i)‖}, plus Gaussian
noise N(0, σ_b²); the server averages b̄ = (1/m) Σ b̃_i over the nominal cohort m and sets

    C_{t+1} = max(C_min, C_t · exp(−η_C (b̄ − γ))),  C_min = ``MIN_CLIP_NORM`` (10⁻⁶).

Identity. The clip is flat, clip(g, C) = s·g with s = min(1, C/‖g‖), so on *any* index set
‖Top(clip(g)) − Top(g)‖ = (1 − s)‖Top(g)‖ and b_i = 1{1 − s ≤ θ} = 1{‖g_i‖ ≤ C/(1 − θ)}: the
top-k restriction does nothing (``bit`` computes this form; a test checks it against the
literal one). DPSFL-AC is therefore Andrew et al.'s (2021) geometric quantile update with the
fixed point C* = (1 − θ)·q_γ(‖g‖) (= 0.5·q₀.₉ at the paper's θ = 0.5, γ = 0.9).

Release and privacy. Clients upload the centred bit b_i − ½ (the server adds ½ back), so adding
or removing a client moves the count by ½ (replacing one by 1) while its clipped gradient
moves the sum by C (2C): the same ratio under either adjacency. With noise σ_b per client (or
σ_b√m added by the server) the count carries N(0, m·σ_b²) and the round is one Gaussian
mechanism on [Σ clip(g_i)/(σC), Σ(b_i − ½)/(σ_b√m)], accounted with
``privacy.adaptive_clipping.effective_noise_multiplier(σ, σ_b√m)`` (m → C_n with a noise
cohort). The paper's σ_b = 0.1
against a server that sees each bit is ρ_b = 1/(2σ_b²) = 50 per round: not negligible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from algorithms.norms import MIN_CLIP_NORM


@dataclass(frozen=True)
class AdaptiveClip:
    target_quantile: float = 0.9  # γ
    error_tolerance: float = 0.5  # θ
    count_noise: float = 0.1  # σ_b of each client's bit
    clip_lr: float = 0.01  # η_C

    def __post_init__(self) -> None:
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target quantile γ must be in (0, 1), got {self.target_quantile}")
        if not 0 <= self.error_tolerance < 1:
            raise ValueError(f"error tolerance θ must be in [0, 1), got {self.error_tolerance}")
        if not self.count_noise > 0:
            raise ValueError(f"count noise σ_b must be > 0, got {self.count_noise}")
        if not self.clip_lr > 0:
            raise ValueError(f"clip learning rate η_C must be > 0, got {self.clip_lr}")

    def bit(self, pre_clip_norm: float, clip_norm: float) -> float:
        """b = 1{1 − min(1, C/‖g‖) ≤ θ} = 1{‖g‖ ≤ C/(1 − θ)}."""
        scale = 1.0 if pre_clip_norm <= clip_norm else clip_norm / pre_clip_norm
        return float(1.0 - scale <= self.error_tolerance)

    def client_upload(
        self, pre_clip_norm: float, clip_norm: float, generator: torch.Generator, noise_std: float
    ) -> torch.Tensor:
        """b − ½, plus N(0, ``noise_std²``) (``client_noise_std``; 0 when the server adds it)."""
        value = torch.tensor([self.bit(pre_clip_norm, clip_norm) - 0.5], dtype=torch.float64)
        if noise_std:
            value += self.noise_share(generator, noise_std)
        return value

    @staticmethod
    def noise_share(generator: torch.Generator, noise_std: float) -> torch.Tensor:
        """One client's N(0, ``noise_std²``) on the count (alone: a dropped client's upload)."""
        return noise_std * torch.randn(1, generator=generator, dtype=torch.float64)

    # With a noise cohort (k = m/C_n, ``GaussianMechanism.noise_scale``) the count's noise is
    # scaled as the updates' is: the mean over the m simulated clients carries the noise of a
    # cohort of C_n, σ_b√C_n on that cohort's count.
    def client_noise_std(self, noise_scale: float = 1.0) -> float:
        """Each client's share: σ_b√k (σ_b without a noise cohort)."""
        return self.count_noise * math.sqrt(noise_scale)

    def server_noise_std(self, cohort_size: float, noise_scale: float = 1.0) -> float:
        """The server's noise on the count of m clients: σ_b√(m·k)."""
        return self.count_noise * math.sqrt(cohort_size * noise_scale)

    @staticmethod
    def accounted_noise(count_noise: float, noise_cohort_size: float) -> float:
        """σ_b√C_n: the count noise the accountant sees, relative to the count of C_n clients."""
        return count_noise * math.sqrt(noise_cohort_size)

    def next_clip_norm(
        self, clip_norm: float, centred_sum: float, nominal_cohort_size: float
    ) -> float:
        """C·exp(−η_C(b̄ − γ)) with b̄ = Σ(b̃_i − ½)/m + ½, never below ``MIN_CLIP_NORM`` (where
        float32 norms would underflow: ``algorithms.norms``; a function of the noisy count, so
        post-processing)."""
        mean_bit = centred_sum / nominal_cohort_size + 0.5
        updated = clip_norm * math.exp(-self.clip_lr * (mean_bit - self.target_quantile))
        return max(MIN_CLIP_NORM, updated)

    def fixed_point(self, quantile_of_norms: float) -> float:
        """C* = (1 − θ)·q_γ(‖g‖), given the γ-quantile of the gradient norms."""
        return (1.0 - self.error_tolerance) * quantile_of_norms
