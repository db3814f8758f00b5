"""A run's config as ``compare`` and ``sweep`` build it: a base, ``--set`` overrides and the
run's own changes. A non-private preset's run (the no-noise reference) drops the privacy
settings; a paper's unaccounted variant runs at the σ its accounted twin is calibrated to."""

from __future__ import annotations

import copy

import yaml

from algorithms.presets import PRIVATE_PRESETS
from cluster.config import DP_FIELDS, AlgorithmConfig, apply_override, config_from_dict


def assignments(changes: dict | None) -> list[str]:
    """``{key: value}`` as ``--set`` overrides (values written as YAML)."""
    return [
        f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"
        for key, value in (changes or {}).items()
    ]


def merged(base: dict, overrides: list[str]) -> dict:
    """``base`` with ``overrides`` applied (a copy)."""
    raw = copy.deepcopy(base)
    for assignment in overrides:
        apply_override(raw, assignment)
    return raw


def build_config(base: dict, overrides: list[str], changes: dict | None, extra: list[str]):
    """A run's config as ``compare`` and ``sweep`` build it: ``run_setup`` (a
    non-private preset drops the privacy settings, an unaccounted one runs at its twin's σ),
    then ``changes`` and ``extra`` overrides. Not calibrated yet (``trials.calibrate``)."""
    run_base, run_overrides = run_setup(base, overrides, changes)
    return config_from_dict(run_base, [*run_overrides, *assignments(changes), *extra])


def run_setup(base: dict, overrides: list[str], changes: dict | None) -> tuple[dict, list[str]]:
    """The base and ``--set`` overrides a run starts from. A non-private preset's run (the
    no-noise reference) drops the privacy section and the DP fields of both; its own ``changes``
    are still validated as written."""
    merged = copy.deepcopy(base)
    for assignment in [*overrides, *assignments(changes)]:
        apply_override(merged, assignment)
    if (merged.get("algorithm") or {}).get("name", AlgorithmConfig.name) in PRIVATE_PRESETS:
        if _unaccounted(merged):
            return _at_claimed_sigma(base, overrides, merged)
        return base, list(overrides)
    dp_fields = set(DP_FIELDS)
    algorithm = {k: v for k, v in (base.get("algorithm") or {}).items() if k not in dp_fields}
    reference = {**{k: v for k, v in base.items() if k != "privacy"}, "algorithm": algorithm}
    dp_keys = {f"algorithm.{f}" for f in dp_fields}

    def private_setting(assignment: str) -> bool:
        key = assignment.partition("=")[0].strip()
        return key == "privacy" or key.startswith("privacy.") or key in dp_keys

    return reference, [o for o in overrides if not private_setting(o)]


BUDGET_KEYS = ("privacy.calibrate", "privacy.target_epsilon")


# The papers' unaccounted variants: the top-k ones, and BLUR+LUS's realised denominator (the
# authors' median clips, clip_rule: median, run at the σ of the base's fixed clip norm)
LITERAL_OPTIONS = ("noise_support", "mask_source", "mean_denominator")


def _without_budget(raw: dict) -> dict:
    """``raw`` with no privacy budget or calibration (an unaccounted run has no ε to meet)."""
    raw = copy.deepcopy(raw)
    privacy = raw.setdefault("privacy", {})
    privacy.pop("target_epsilon", None)
    privacy["calibrate"] = "none"
    return raw


def _paper_sketch_noise(merged: dict) -> bool:
    return (merged.get("algorithm") or {}).get("sketch_noise") == "paper"


def _unaccounted(merged: dict) -> bool:
    probe = _without_budget(merged)
    if not _paper_sketch_noise(merged):
        probe.setdefault("algorithm", {})["noise_multiplier"] = 1.0
    return config_from_dict(probe).unaccounted_reason is not None


def _at_claimed_sigma(base: dict, overrides: list[str], merged: dict) -> tuple[dict, list[str]]:
    """An unaccounted run (a paper's literal top-k) at the σ its accounted twin runs with: the
    σ the paper would claim the budget for. It keeps no budget (it has no ε). DPSFL's own
    noise is sized by the paper's formula from the budget's ε (``paper_epsilon``) instead."""
    from cluster.claims.calibration import calibrated

    kept = [o for o in overrides if o.partition("=")[0].strip() not in BUDGET_KEYS]
    if _paper_sketch_noise(merged):
        target = (merged.get("privacy") or {}).get("target_epsilon")
        nominal = [] if target is None else [f"algorithm.paper_epsilon={target!r}"]
        return _without_budget(base), [*kept, *nominal]
    twin = copy.deepcopy(merged)
    for option in LITERAL_OPTIONS:
        twin["algorithm"].pop(option, None)
    if twin["algorithm"].pop("clip_rule", None) == "median":  # the base's fixed C, accounted
        twin["algorithm"]["clip_norm"] = (base.get("algorithm") or {}).get("clip_norm")
    sigma = calibrated(config_from_dict(twin)).algorithm.noise_multiplier
    return _without_budget(base), [*kept, f"algorithm.noise_multiplier={sigma!r}"]
