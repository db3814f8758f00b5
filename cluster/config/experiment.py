"""The whole experiment: its sections, the quantities derived from them and the preset it
builds (``cluster.config.checks.validate`` checks it)."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from algorithms.local import LocalTrainer
from algorithms.presets import (
    DEFAULT_PLACEMENT,
    PRESETS,
    PRIVATE_PRESETS,
    SAMPLE_LEVEL_PRESETS,
    Algorithm,
    ClientDP,
    SampleDP,
)
from cluster.config.accounting import CohortConfig, PrivacyConfig
from cluster.config.algorithm import AlgorithmConfig
from cluster.config.data import DataConfig
from cluster.config.errors import ConfigError
from cluster.config.runtime import (
    CheckpointConfig,
    ExecutorConfig,
    TrackingConfig,
)
from privacy.accountant import assumption_for_sampler, default_accountant
from privacy.record_level import methods_for


@dataclass
class ExperimentConfig:
    task: str = "synthetic_logreg"
    seed: int = 0
    # The seed of the run's random streams (cohorts, local batches, noise, dropout,
    # augmentation) where they must differ from another run's at the same `seed`: a sweep gives
    # each trial its own, so that no two trials share noise or cohorts (their ε compose only
    # then). The data's randomness (the store, the validation split, the matched test sets) and
    # the model's initialisation stay `seed`'s. null: `seed`.
    stream_seed: int | None = None
    rounds: int = 100
    eval_every: int = 1
    # At each evaluation also DP-SCAFFOLD's diagnostics over every client's training data: the
    # objective F(x) and the gradient dissimilarity (a full pass over all clients' data)
    eval_train: bool = False
    # Communication budget (DPSFL, spec 002 §4): the run ends after the round whose cumulative
    # communication_bytes, every byte the sampled clients uploaded and downloaded summed over
    # all clients and rounds, reaches it (null: no budget; the run ends after `rounds`)
    stop_at_bytes: float | None = None
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    cohort: CohortConfig = field(default_factory=CohortConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    # Derived quantities used by the driver and the actors.
    @property
    def streams_seed(self) -> int:
        """The seed every stream but the data's and the model initialisation's is keyed by:
        ``stream_seed``, else ``seed``. With ``privacy.secret_streams`` the key is the run's
        secret, which the config does not hold (``cluster.runtime.stream_key``): asking for a
        seed then raises rather than key the streams by the logged one."""
        if self.privacy.secret_streams:
            raise ValueError(
                "privacy.secret_streams: the streams' key is the run's secret "
                "(cluster.runtime.stream_key.streams_key), not a seed of the config"
            )
        return self.seed if self.stream_seed is None else self.stream_seed

    @property
    def sample_rate(self) -> float:
        return self.cohort.size / self.data.num_clients

    @property
    def population(self) -> int:
        return self.privacy.population or self.data.num_clients

    @property
    def noise_cohort_size(self) -> int:
        """C_n: the cohort the noise and the accounting are for (default: the cohort itself)."""
        return self.privacy.noise_cohort_size or self.cohort.size

    @property
    def accounting_sample_rate(self) -> float:
        """q the accountant is charged: noise cohort (or cohort) size over the population."""
        return self.noise_cohort_size / self.population

    @property
    def noise_scale(self) -> float:
        """m / noise_cohort_size: the sum's noise std is σC·m/C_n, as if C_n clients took part."""
        return self.cohort.size / self.noise_cohort_size

    @property
    def deployment(self) -> str | None:
        """ "C_n of N clients per round": the deployment a noise cohort (or a population) claims
        ε for, or None when that is this simulation's own cohort and clients."""
        if (self.noise_cohort_size, self.population) == (self.cohort.size, self.data.num_clients):
            return None
        return f"{self.noise_cohort_size:,} of {self.population:,} clients per round"

    @property
    def sampling_assumption(self) -> str:
        if self.privacy.sampling == "match":
            return assumption_for_sampler(self.cohort.sampling)
        return self.privacy.sampling

    @property
    def sampling_mismatch(self) -> str | None:
        """Why no ε holds when ``privacy.sampling`` accounts another sampler than the cohort's
        (DP-FedSAM's fixed cohort accounted as Poisson), else None. Where the ε is claimed for
        a deployment (``deployment``: a noise cohort or population other than the simulation's),
        that deployment's sampler is the assumption, not the simulated cohort's: no mismatch. A
        noise cohort equal to the cohort describes no deployment: the mismatch stands."""
        if self.sample_level or self.deployment is not None:
            return None
        ran = assumption_for_sampler(self.cohort.sampling)
        if self.sampling_assumption == ran:
            return None
        return (
            f"the cohort is sampled {self.cohort.sampling} but privacy.sampling accounts "
            f"{self.sampling_assumption.replace('_', ' ')} sampling: no accountant's ε holds "
            "for the sampler that runs"
        )

    @property
    def record_copies(self) -> str | None:
        """Why no record-level ε holds where the partition may copy rows (``dirichlet`` with
        ``samples_per_client`` refills exhausted class pools), else None: a row held by k
        clients, or k times by one, moves up to k noisy updates where the accountant assumes
        one, and the default δ = R^-1.1 counts the copies as records."""
        p = self.data.partition
        if not self.sample_level or p.method != "dirichlet" or p.samples_per_client is None:
            return None
        return (
            "data.partition dirichlet with samples_per_client refills exhausted class pools, so "
            "a record may sit in several clients and several times in one: its influence is up "
            "to its number of copies times what the record-level accountant assumes (and δ "
            "counts copies as records)"
        )

    @property
    def sample_level(self) -> bool:
        """Record-level DP (DP-SGD in the clients) rather than client-level."""
        return self.algorithm.name in SAMPLE_LEVEL_PRESETS

    @property
    def warm_start_variant(self) -> str | None:
        if not self.algorithm.warm_start:
            return None
        return self.algorithm.warm_start_variant or "paper"

    @property
    def warmup_rounds(self) -> int:
        """DP-SCAFFOLD-warm's warm-up rounds: ⌈4/l⌉ (paper), round(4/l) (authors' code)."""
        variant = self.warm_start_variant
        if variant is None:
            return 0
        if variant == "authors_code":
            return max(1, round(4 / self.sample_rate))
        return math.ceil(4 / self.sample_rate - 1e-9)

    @property
    def total_rounds(self) -> int:
        """Rounds the driver runs: the paper's warm-up, then ``rounds`` training rounds (the
        authors' code counts its warm-up inside ``rounds``)."""
        if self.warm_start_variant == "authors_code":
            return self.rounds
        return self.warmup_rounds + self.rounds

    @property
    def batch_sampling(self) -> str:
        """How local batches are drawn: the config's choice, else fresh for sample level."""
        if self.algorithm.local.batch_sampling is not None:
            return self.algorithm.local.batch_sampling
        return "fresh" if self.sample_level else "epoch"

    @property
    def accountant_name(self) -> str:
        if self.privacy.accountant != "auto":
            return self.privacy.accountant
        if self.sample_level:
            return methods_for(self.batch_sampling, self.algorithm.adjacency or "replace_one")[0]
        return default_accountant(self.sampling_assumption)

    @property
    def delta(self) -> float:
        """δ: the configured one, else N^-1.1 for a population of N (below 1/N, which would
        allow a mechanism that publishes one client's data outright)."""
        if self.privacy.delta is not None:
            return self.privacy.delta
        return self.population**-1.1

    @property
    def store_parameters(self) -> tuple:
        """What keys the shard store (``datasets.sources.store_path``'s arguments after the
        root): source, its options, partition, clients (held-out validation clients
        included: ``DataConfig.partitioned_clients``), seed."""
        d = self.data
        return d.source, d.source_options(), asdict(d.partition), d.partitioned_clients, self.seed

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints go (``checkpoint.dir``; in a Ray job, under the store root)."""
        return self.checkpoint.resolved_dir(self.data.resolved_store_root())

    @property
    def noise_placement(self) -> str:
        """Where the noise is added: the config's choice, else the preset's paper default."""
        if self.algorithm.noise_placement is not None:
            return self.algorithm.noise_placement
        if self.algorithm.clip_rule == "median" and not self.sample_level:
            return "client"  # each client scales its noise to its own median
        return DEFAULT_PLACEMENT.get(self.algorithm.name, "server")

    @property
    def paper_sketch_noise(self) -> bool:
        """DPSFL's own noise: sized from algorithm.paper_epsilon, not a noise multiplier."""
        return self.algorithm.sketch_noise == "paper"

    def build_algorithm(self) -> Algorithm:
        a = self.algorithm
        if a.name in PRIVATE_PRESETS and a.noise_multiplier is None and not self.paper_sketch_noise:
            # privacy.calibrate: sigma leaves σ unset; building before calibrating would
            # silently train without noise.
            raise ConfigError(
                "algorithm.noise_multiplier",
                None,
                "not calibrated yet: pass the config through "
                "cluster.claims.calibration.calibrated() first (run_experiment does)",
            )
        return self._build_algorithm(a.noise_multiplier)

    @property
    def unaccounted_reason(self) -> str | None:
        """Why the configured preset's mechanism has no ε (read off its pipeline, a sampling
        assumption that is not the cohort's, records copied for a record-level ε, or data
        preparation fitted to the clients' rows), else None."""
        if self.algorithm.name not in PRIVATE_PRESETS:
            return None
        # structural: any σ > 0
        return self._build_algorithm(1.0).unaccounted_reason or self.setup_unaccounted_reason

    @property
    def setup_unaccounted_reason(self) -> str | None:
        """Why no ε holds whatever the mechanism: a sampling assumption that is not the
        cohort's (client level), records copied (record level), or data preparation fitted to
        the clients' rows; else None."""
        return self.sampling_mismatch or self.record_copies or self.data.statistics_outside_dp

    def _build_algorithm(self, noise_multiplier: float | None) -> Algorithm:
        a, local = self.algorithm, self.algorithm.local
        trainer = LocalTrainer(
            lr=local.lr,
            batch_size=local.batch_size,
            local_steps=local.local_steps,
            local_epochs=local.local_epochs,
            momentum=local.momentum,
            weight_decay=local.weight_decay,
            max_grad_norm=local.max_grad_norm,
            lr_decay=local.lr_decay,
            batch_sampling=self.batch_sampling,
            lr_scaling=local.lr_scaling,
        )
        preset = PRESETS[a.name]
        accepted = inspect.signature(preset).parameters
        kwargs: dict[str, Any] = {"server_lr": a.server_lr, **a.preset_options()}
        if "weighting" in accepted:
            kwargs["weighting"] = a.weighting
        if "dp" in accepted:
            median = a.clip_rule == "median"
            kwargs["dp"] = ClientDP(
                math.nan if median else a.clip_norm,  # median: each client's own
                noise_multiplier,
                self.noise_placement,
                self.noise_scale,
                a.clip_scope or ("layer" if median else "flat"),
                a.clip_rule or "fixed",
            )
        if "sample_dp" in accepted:
            kwargs["sample_dp"] = SampleDP(
                math.nan if a.clip_norm is None else a.clip_norm,  # median: chosen per step
                noise_multiplier,
                a.clip_scope or "flat",
                a.adjacency or "replace_one",
                a.clip_rule or "fixed",
                self.noise_scale,
            )
        algorithm = preset(trainer, **kwargs)
        if self.warmup_rounds:  # the lr decay counts training rounds (Algorithm.at_round)
            algorithm = replace(algorithm, warmup_rounds=self.warmup_rounds)
        if a.server_momentum:
            algorithm = replace(
                algorithm, server=replace(algorithm.server, momentum=a.server_momentum)
            )
        if a.mean_denominator != "nominal":
            algorithm = replace(
                algorithm, server=replace(algorithm.server, denominator=a.mean_denominator)
            )
        return algorithm

    def to_dict(self) -> dict:
        return asdict(self)
