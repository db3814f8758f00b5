"""A sweep's spec: what ``python -m cluster sweep SPEC`` runs. YAML, like ``compare``'s::

    base: {…an experiment config…}        # or base: configs/some.yaml (relative to the spec)
    space:                                 # dotted config field → its values
      algorithm.rho: [0.01, 0.05, 0.1]     # a list: every value (grid), or a choice (random)
      algorithm.local.lr: {distribution: loguniform, low: 0.01, high: 0.3}   # random only
    search: {method: grid}                 # default; or random:
    # search: {method: random, seed: 0, num_samples: 8}
    # search: {method: random, seed: 0, num_trials: {distribution: poisson, mean: 4}}
    #   (or {distribution: truncated_negative_binomial, eta: 1, gamma: 0.25}): the number of
    #   configurations itself drawn (privacy.repeat_select.draw_num_trials), as Papernot & Steinke's
    #   tuning bound needs
    seeds: 2                               # seeds 0, 1; or a list [0, 3, 7]
    select: {metric: validation_accuracy, mode: max}

Distributions: ``uniform`` (low, high), ``loguniform`` (0 < low < high), ``choice`` (values).
Random draws come from one ``numpy`` generator seeded by ``search.seed``: first the number of
configurations (where drawn), then each configuration's fields in the space's order. Every
configuration runs once per seed; it is selected by its mean over those seeds of
``select.metric`` (its last evaluation), never by its best seed. A random search may draw the
same configuration more than once: each draw is a trial of its own (K draws, as Papernot &
Steinke count them: its runs, its name, its place in the privacy statement) and a row of its
own, ranked by its mean over seeds (``sweep_report.draw_values``), as their bound requires.
Each trial is named by its configuration's index in the draw (or the grid) and a digest of
its exact values (``SweepTrial.key``): labels, floats to 4 significant figures, are for
display. Sweeping ``data.validation.fold`` is k-fold cross-validation: a configuration's score
is then its mean over folds and seeds, and the selected one is retrained on all training rows
(``data.validation: null``), whose test accuracy is the one reported. ``metric`` is one of
``METRICS``; selecting on the test set is allowed, with a warning and the parent run tagged
``selected_on_test=true``. Keys starting with ``x-`` are ignored (YAML anchors).

``load`` checks the whole spec, and builds every trial's config with the project's loader,
before any trial runs: a ``ConfigError`` names the field, the value, and the trial's values.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import ConfigError, ExperimentConfig, read_yaml_mapping
from cluster.config.runtime import NAME_MAX_BYTES

SPEC_KEYS = ("base", "space", "search", "seeds", "select")
# The sweep sets them per trial: the seed from ``seeds``, the streams from the trial's identity.
SEED_FIELDS = ("seed", "stream_seed")
SEEDS_FIX = (
    "a sweep sets each trial's seed (list them under seeds:, e.g. seeds: 3) and its own stream_seed"
)
DISTRIBUTIONS = {"uniform": ("low", "high"), "loguniform": ("low", "high"), "choice": ("values",)}
METRICS = ("validation_accuracy", "validation_loss", "test_accuracy", "test_loss")
MODES = ("max", "min")
MAX_TRIALS = 10_000  # a grid's product, or a draw: beyond any sweep this machine runs
# k-fold cross-validation: the fold is averaged over like the seeds, never a configuration
FOLD = "data.validation.fold"


@dataclass(frozen=True)
class Selection:
    metric: str = "validation_accuracy"
    mode: str = "max"

    @property
    def on_test(self) -> bool:
        return self.metric.startswith("test_")

    def best(self, values: list[float]) -> float:
        return max(values) if self.mode == "max" else min(values)


Values = tuple[tuple[str, Any], ...]  # a configuration: (field, value) in the space's order


@dataclass(frozen=True)
class SweepTrial:
    values: Values
    seed: int
    index: int = 0  # its configuration's place in ``SweepSpec.configurations()``

    def label(self) -> str:
        """The configuration's values, readably (floats to 4 significant figures, so two
        configurations may share a label): ``lr=0.05-rho=0.02``. For display only."""
        return label(self.values)

    @property
    def key(self) -> str:
        """Unique among the sweep's configurations: the index of its draw (random) or grid
        point, and a digest of its exact values (``c3-1f0a9e``)."""
        return f"c{self.index}-{values_digest(self.values)}"

    def name(self, sweep: str) -> str:
        """Its MLflow run's name, unique in the sweep (its checkpoint folder where untracked,
        and its key in every table): ``sweep-<spec>-lr=0.05-rho=0.02-c3-1f0a9e-seed1``."""
        return trial_name(sweep, self.label(), f"{self.key}-seed{self.seed}")


def trial_name(sweep: str, label: str, unique: str) -> str:
    """``sweep-<spec>-<label>-<unique>``, or without the label where that is longer than a
    run name may be (``NAME_MAX_BYTES``): ``unique`` alone tells the trials apart."""
    name = f"sweep-{sweep}-{label}-{unique}"
    return name if len(name.encode()) <= NAME_MAX_BYTES else f"sweep-{sweep}-{unique}"


def _short_names(fields: list[str]) -> dict[str, str]:
    """Each field's last part (``algorithm.local.lr`` → ``lr``) where that is unambiguous."""
    last = [f.rsplit(".", 1)[-1] for f in fields]
    return {f: s if last.count(s) == 1 else f for f, s in zip(fields, last, strict=True)}


def configuration(values: Values) -> Values:
    """A trial's configuration: its values without the cross-validation fold."""
    return tuple((f, v) for f, v in values if f != FOLD)


def format_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def label(values: Values, exact: bool = False) -> str:
    """``lr=0.05-rho=0.02``: floats to 4 significant figures, or (``exact``) as ``repr``."""
    short = _short_names([f for f, _ in values])
    text = [repr(v) if exact and isinstance(v, float) else format_value(v) for _, v in values]
    return "-".join(f"{short[f]}={t}" for (f, _), t in zip(values, text, strict=True)) or "base"


def labels(configurations: list[Values]) -> list[str]:
    """Each configuration's ``label``, exact (``repr`` of its floats) where two would read the
    same to 4 significant figures: distinct configurations, distinct labels."""
    short = [label(v) for v in configurations]
    return [
        label(v, exact=True) if short.count(text) > 1 else text
        for v, text in zip(configurations, short, strict=True)
    ]


def values_digest(values: Values) -> str:
    """Six hex digits of a configuration's exact values."""
    return _digest([[f, v] for f, v in values])[:6]


@dataclass(frozen=True)
class SweepSpec:
    name: str  # the spec file's stem
    base: dict
    space: dict[str, Any]
    method: str  # grid | random
    seed: int | None  # the sampler's
    num_samples: int | None
    num_trials: dict | None  # {"kind": poisson, "mean": 4}, …: a random number of configurations
    seeds: tuple[int, ...]
    select: Selection

    def configurations(self) -> list[Values]:
        if self.method == "grid":
            fields = list(self.space)
            return [
                tuple(zip(fields, combo, strict=True))
                for combo in itertools.product(*self.space.values())
            ]
        import numpy as np

        from privacy.repeat_select import draw_num_trials

        rng = np.random.default_rng(self.seed)
        count = self.num_samples
        if self.num_trials is not None:
            count = draw_num_trials(self.num_trials, rng)
        return [
            tuple((f, _draw(rng, domain)) for f, domain in self.space.items()) for _ in range(count)
        ]

    @property
    def cross_validated(self) -> bool:
        """The folds of ``data.validation`` are swept: after the selection, the chosen
        configuration is retrained on all training rows."""
        return FOLD in self.space

    @property
    def fields(self) -> list[str]:
        """The swept fields that make configurations (the fold does not)."""
        return [f for f in self.space if f != FOLD]

    def trials(self) -> list[SweepTrial]:
        """Every configuration at every seed. A random search may draw one configuration more
        than once: each draw is a trial of its own (its own index, name and runs), as
        Papernot & Steinke's bound counts K draws; the selection ranks each draw by its own
        score (``sweep_report.draw_values``)."""
        return [
            SweepTrial(v, s, index)
            for index, v in enumerate(self.configurations())
            for s in self.seeds
        ]

    def digest(self) -> str:
        """What the trials depend on (not the selection): a resumed sweep must match it."""
        keys = ("base", "space", "method", "seed", "num_samples", "num_trials", "seeds")
        return _digest({k: getattr(self, k) for k in keys})


# Swept fields that change the training but never the privacy mechanism (σ multiplies C; the
# rounds, the sampling, the local steps and batches of DP-SGD, the noise are elsewhere).
PRIVACY_NEUTRAL = (
    "algorithm.local.lr",
    "algorithm.local.momentum",
    "algorithm.local.weight_decay",
    "algorithm.local.lr_decay",
    "algorithm.server_lr",
    "algorithm.server_momentum",
    "algorithm.clip_norm",
    "algorithm.clip_lr",
    "algorithm.rho",
    "algorithm.pgn_rho",
    "algorithm.pgn_beta",
    "algorithm.blur_lambda",
    "algorithm.ls_sigma",
    "algorithm.sketch_momentum",
    "algorithm.local.max_grad_norm",  # local clipping outside DP-SGD's
    "algorithm.clip_target_quantile",  # the adaptive clip's target: its count noise is σ_b's
    "algorithm.clip_error_tolerance",
)


def mechanism_may_vary(spec: SweepSpec, finished: list[SweepTrial]) -> str | None:
    """Why the space may draw a configuration whose privacy mechanism no finished trial ran
    (Papernot–Steinke's ε(λ) must bound every configuration the search could draw), or None.

    Fields outside ``PRIVACY_NEUTRAL`` may change the mechanism: each must have a finite domain
    (a list or a choice), and every combination of their values must be among the ``finished``
    trials (whose mechanisms ``privacy.tuning`` then checks are one)."""
    varying = [f for f in spec.fields if f not in PRIVACY_NEUTRAL]
    if not varying:
        return None
    continuous = [f for f in varying if not _finite_values(spec.space[f])]
    if continuous:
        return (
            f"{', '.join(continuous)} may change the privacy mechanism and "
            f"{'is' if len(continuous) == 1 else 'are'} drawn from a continuous distribution"
        )
    drawn = {tuple(_key(dict(t.values)[f]) for f in varying) for t in finished}
    for combination in itertools.product(*(_finite_values(spec.space[f]) for f in varying)):
        if tuple(_key(v) for v in combination) not in drawn:
            shown = ", ".join(f"{f}={v!r}" for f, v in zip(varying, combination, strict=True))
            return (
                f"{', '.join(varying)} may change the privacy mechanism, and no finished trial "
                f"ran {shown}"
            )
    return None


def _finite_values(domain: Any) -> list | None:
    if isinstance(domain, list):
        return domain
    return domain["values"] if domain["distribution"] == "choice" else None


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Changed where the code computes a trial of the same config otherwise, so that a resumed sweep
# never adopts a finished trial of the earlier code beside new ones. 2026-11-28: CPU streams of
# MT19937's whole state, clips by an upper bound of the norm, synthetic data standardised by
# the generator's statistics, crops padded with black, DP-FedSAM's EMNIST at 32×32,
# DP-SCAFFOLD's warm start with the weight decay.
COMPUTED = "computed-2026-11-28/"


def trial_digest(config: ExperimentConfig, repeat: int = 0) -> str:
    """A trial's identity in MLflow (tag ``sweep_trial``): its configuration
    (``privacy.tuning.configuration_key``: without the sections that never change results),
    its seed, and ``repeat``, the number of earlier draws of that configuration in the sweep
    (a random search's repeated draw is a trial of its own)."""
    from privacy.tuning import configuration_key

    # Marked: a trial run before trials had streams of their own (they shared the seed's
    # noise), or by code that computed the same config otherwise (``COMPUTED``), has another
    # identity, and is never taken for one of these.
    marked = f"own-streams/{COMPUTED}{configuration_key(config.to_dict())}"
    key = f"{hashlib.sha256(marked.encode()).hexdigest()[:16]}-seed{config.seed}"
    return key + (f"-repeat{repeat}" if repeat else "")


def _draw(rng, domain: Any) -> Any:
    if isinstance(domain, list):
        return domain[int(rng.integers(len(domain)))]
    kind = domain["distribution"]
    if kind == "choice":
        return domain["values"][int(rng.integers(len(domain["values"])))]
    if kind == "uniform":
        return float(rng.uniform(domain["low"], domain["high"]))
    return float(math.exp(rng.uniform(math.log(domain["low"]), math.log(domain["high"]))))


# ---------------------------------------------------------------------------- reading


def load(path: Path) -> SweepSpec:
    """The spec at ``path``, checked (see the module doc); its trials not yet built."""
    raw = read_yaml_mapping(path)
    keys = {k for k in raw if not str(k).startswith("x-")}
    unknown = sorted(map(str, keys - set(SPEC_KEYS)))
    if unknown or "base" not in keys or "space" not in keys:
        raise ConfigError(
            "SPEC",
            str(path),
            f"keys base and space are required; search, seeds and select are optional"
            f"{'; unknown: ' + ', '.join(unknown) if unknown else ''} (x-… keys hold anchors)",
        )
    base = raw["base"]
    if isinstance(base, str):
        base = read_base(path, base)
    if not isinstance(base, dict):
        raise ConfigError("base", base, "a config mapping, or a config file's path")
    method, seed, samples, num_trials = _search(raw.get("search") or {})
    space = _space(raw["space"], method)
    if method == "grid" and math.prod(len(v) for v in space.values()) > MAX_TRIALS:
        raise ConfigError("space", list(space), f"the grid has more than {MAX_TRIALS} points")
    return SweepSpec(
        path.stem,
        base,
        space,
        method,
        seed,
        samples,
        num_trials,
        _seeds(raw.get("seeds", 1)),
        _selection(raw.get("select") or {}),
    )


def read_base(spec: Path, base: str) -> dict:
    """The config mapping of a spec's ``base:`` file (sweep and compare specs): a path relative
    to the spec's directory that stays inside it once ``..`` and symlinks are resolved (a spec
    from elsewhere cannot make the command read, say, ``/etc/passwd``)."""
    directory = spec.parent.resolve()
    target = (directory / base).resolve()
    if Path(base).is_absolute() or not target.is_relative_to(directory):
        raise ConfigError(
            "base",
            base,
            f"must name a config file inside the directory of the spec {spec}, relative to "
            "it (e.g. base.yaml), symlinks included; copy the file there, or write the config "
            "into the spec as base: {…}",
        )
    return read_yaml_mapping(target)


def _search(search: Any) -> tuple[str, int | None, int | None, dict | None]:
    if not isinstance(search, dict):
        raise ConfigError("search", search, "a mapping, e.g. {method: grid}")
    _known_keys("search", search, ("method", "seed", "num_samples", "num_trials"))
    method = search.get("method", "grid")
    if method not in ("grid", "random"):
        raise ConfigError("search.method", method, "must be grid or random")
    if method == "grid":
        extra = [k for k in ("seed", "num_samples", "num_trials") if k in search]
        if extra:
            raise ConfigError(f"search.{extra[0]}", search[extra[0]], "only for method: random")
        return method, None, None, None
    seed = search.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError("search.seed", seed, "random search needs a seed, an integer >= 0")
    if ("num_samples" in search) == ("num_trials" in search):
        raise ConfigError(
            "search",
            search,
            "random search needs one of num_samples (a fixed number of "
            "configurations) or num_trials (a distribution of their number)",
        )
    if "num_samples" in search:
        samples = search["num_samples"]
        if isinstance(samples, bool) or not isinstance(samples, int):
            raise ConfigError("search.num_samples", samples, "an integer >= 1, e.g. 8")
        if not 1 <= samples <= MAX_TRIALS:
            raise ConfigError("search.num_samples", samples, f"must be in [1, {MAX_TRIALS}]")
        return method, seed, samples, None
    return method, seed, None, _num_trials(search["num_trials"])


def _num_trials(spec: Any) -> dict:
    """``{distribution: poisson, mean: 4}`` as ``privacy.tuning``'s distribution, checked there."""
    from privacy.repeat_select import check_num_trials_distribution

    example = "{distribution: truncated_negative_binomial, eta: 1, gamma: 0.25}"
    if not isinstance(spec, dict) or "distribution" not in spec:
        raise ConfigError(
            "search.num_trials", spec, f"e.g. {{distribution: poisson, mean: 4}} or {example}"
        )
    distribution = {"kind": spec["distribution"]} | {
        k: v for k, v in spec.items() if k != "distribution"
    }
    try:
        check_num_trials_distribution(distribution)
    except ValueError as error:
        raise ConfigError("search.num_trials", spec, str(error)) from None
    return distribution


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(where, value, "must be a finite number")
    return float(value)


def _known_keys(where: str, mapping: dict, known: tuple[str, ...]) -> None:
    for key in mapping:
        if key not in known:
            raise ConfigError(f"{where}.{key}", mapping[key], f"unknown key; known: {known}")


def _space(space: Any, method: str) -> dict[str, Any]:
    if not isinstance(space, dict) or not space:
        raise ConfigError("space", space, "a mapping field → values, e.g. {algorithm.rho: [0.1]}")
    for key, domain in space.items():
        where = f"space.{key}"
        if key in SEED_FIELDS:
            raise ConfigError(where, domain, SEEDS_FIX)
        if key == FOLD and method != "grid":
            raise ConfigError(
                where,
                domain,
                "cross-validation scores every configuration on every fold: sweep the folds "
                "in a grid (search: {method: grid}), or fix the fold in the base",
            )
        if isinstance(domain, list):
            if not domain:
                raise ConfigError(where, domain, "an empty list: give at least one value")
            _scalar_values(where, domain)
            continue
        if method == "grid":
            raise ConfigError(
                where,
                domain,
                "a grid needs a list of values (distributions need search: {method: random, ...})",
            )
        _distribution(where, domain)
    return dict(space)


def _scalar_values(where: str, values: list) -> None:
    """Each value once, and a number, string, boolean or null (a configuration is its values:
    a mapping names no field a table or a plot can show, and a value twice is the same runs
    twice, charged twice to the tuning ε)."""
    for value in values:
        if isinstance(value, dict | list):
            raise ConfigError(
                where,
                value,
                "a value of a swept field is a number, a string, a boolean or null: sweep the "
                "mapping's own fields (e.g. data.partition.alpha: [0.1, 0.3], its method in "
                "the base)",
            )
    seen = [_key(v) for v in values]
    repeated = next((v for v, k in zip(values, seen, strict=True) if seen.count(k) > 1), None)
    if repeated is not None or len(set(seen)) < len(seen):
        raise ConfigError(
            where, repeated, "listed twice: give each value once (seeds: repeats a configuration)"
        )


def _distribution(where: str, domain: Any) -> None:
    if not isinstance(domain, dict) or domain.get("distribution") not in DISTRIBUTIONS:
        raise ConfigError(
            where, domain, f"a list, or {{distribution: one of {', '.join(DISTRIBUTIONS)}, ...}}"
        )
    kind = domain["distribution"]
    _known_keys(where, domain, ("distribution", *DISTRIBUTIONS[kind]))
    if kind == "choice":
        if not isinstance(domain.get("values"), list) or not domain["values"]:
            raise ConfigError(f"{where}.values", domain.get("values"), "a non-empty list")
        _scalar_values(f"{where}.values", domain["values"])
        return
    low, high = (_number(f"{where}.{k}", domain.get(k)) for k in ("low", "high"))
    if not low < high or (kind == "loguniform" and low <= 0):
        raise ConfigError(
            where, domain, f"{kind} needs {'0 < ' * (kind == 'loguniform')}low < high"
        )


def _seeds(seeds: Any) -> tuple[int, ...]:
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if not 1 <= seeds <= MAX_TRIALS:
            raise ConfigError("seeds", seeds, "a count >= 1 (seeds 0..N-1) or a list of seeds")
        return tuple(range(seeds))
    ok = isinstance(seeds, list) and seeds and len(set(map(str, seeds))) == len(seeds)
    if not ok or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError("seeds", seeds, "a count >= 1 or a list of distinct integers")
    return tuple(seeds)


def _selection(select: Any) -> Selection:
    if not isinstance(select, dict):
        raise ConfigError("select", select, "e.g. {metric: validation_accuracy, mode: max}")
    _known_keys("select", select, ("metric", "mode"))
    metric = select.get("metric", Selection.metric)
    if metric not in METRICS:
        raise ConfigError("select.metric", metric, f"one of {', '.join(METRICS)}")
    # A loss is minimised, an accuracy maximised, unless the spec says otherwise.
    mode = select.get("mode", "min" if str(metric).endswith("_loss") else "max")
    if mode not in MODES:
        raise ConfigError("select.mode", mode, "max or min")
    if (mode == "max") == metric.endswith("_loss"):
        better = "min" if mode == "max" else "max"
        raise ConfigError(
            "select.mode", mode, f"selects the worst {metric}: give {better} (or leave it out)"
        )
    return Selection(metric, mode)
