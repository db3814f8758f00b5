"""Experiment configuration: typed dataclasses loaded from YAML, with ``a.b=value`` overrides.

Everything is validated before any work starts. A ``ConfigError`` names the field, the bad value
and the fix, e.g. ``algorithm.clip_norm = -1.0: the clip norm C must be > 0 (e.g. 1.0)``.

One module per section of the YAML, each holding its schema and, below it, the checks that
read that section alone:

- ``data``: ``data:`` (source, clients, partition, files);
- ``algorithm``: ``algorithm:`` (preset, local trainer, clipping, noise, preset options);
- ``accounting``: ``cohort:`` and ``privacy:``;
- ``runtime``: ``executor:``, ``checkpoint:``, ``tracking:``;
- ``experiment``: the whole, its derived quantities, the preset it builds.

Above them, the checks that read the whole experiment: ``algorithm_checks`` (with those of the
families with their own rules in ``families``: sample level, top-k, sketch) and ``checks``
(the other sections, and ``validate``, which runs them all); then ``loading``: YAML and
``--set`` into the typed, validated config.
"""

from cluster.config.accounting import CohortConfig, PrivacyConfig
from cluster.config.algorithm import (
    DP_FIELDS,
    PRESET_OPTION_FIELDS,
    AlgorithmConfig,
    LocalConfig,
)
from cluster.config.checks import validate, validate_data
from cluster.config.data import DataConfig, PartitionConfig, SyntheticConfig
from cluster.config.errors import ConfigError
from cluster.config.experiment import ExperimentConfig
from cluster.config.loading import (
    apply_override,
    config_from_dict,
    load_config,
    read_yaml_mapping,
)
from cluster.config.runtime import CheckpointConfig, ExecutorConfig, TrackingConfig

__all__ = [
    "DP_FIELDS",
    "PRESET_OPTION_FIELDS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CohortConfig",
    "ConfigError",
    "DataConfig",
    "ExecutorConfig",
    "ExperimentConfig",
    "LocalConfig",
    "PartitionConfig",
    "PrivacyConfig",
    "SyntheticConfig",
    "TrackingConfig",
    "apply_override",
    "config_from_dict",
    "load_config",
    "read_yaml_mapping",
    "validate",
    "validate_data",
]
