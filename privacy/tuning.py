"""The privacy cost of tuning: the ε of releasing the model a sweep selects.

Every trial of a sweep is a run on the private data, and choosing among them by a score reads
each trial's output. Two bounds on what releasing the selected model costs:

**Composition** (any search). Releasing everything every trial produced is the composition of the
trials' mechanisms: each trial is a run of subsampled Gaussian rounds, so the sweep is one
longer, heterogeneous run. Where every trial's own accountant is numerically tight (``pld`` or
``prv``) the trials' PLDs are composed (client level: ``privacy.pld.PldAccountant`` over all the
trials' (σ, q, rounds) runs, exactly what the project's accountant does for one run that long;
record level: each run's mixture PLD, ``RecordLevelAccountant.run_plds``, composed); otherwise
the trials' RDP curves are summed on their common orders and converted with Balle et al. 2020,
Thm 21. This bounds the selected model, and every other trial's model and metrics too.

**Papernot & Steinke** (ICLR 2022, "Hyperparameter tuning with Rényi differential privacy";
random search only). Let Q be one draw of the search: a configuration drawn from the space, run
with every seed of the sweep, scored; let ε(λ) bound Q's RDP at order λ for *every*
configuration Q could draw. Here that is known only where every trial that ran has the same
mechanism (the privacy parameters fixed across the space): ε(λ) is then a configuration's
seeds' curves summed. Where the trials' mechanisms differ, the configurations that ran bound
nothing about those that did not, and Papernot–Steinke is not applied (composition is). Run Q a
random number K of times, independent of the data, and output only the best run. Then the output
is (λ, ε'(λ))-RDP with

- K ~ truncated negative binomial D_{η,γ} (η > −1, γ ∈ (0, 1); P[K = k] ∝
  (1 − γ)^k·Π_{ℓ<k}(ℓ + η)/(ℓ + 1) on k ≥ 1; η = 1 geometric, η = 0 logarithmic), Thm 2:

      ε'(λ) = ε(λ) + (1 + η)·(1 − 1/λ̂)·ε(λ̂) + (1 + η)·log(1/γ)/λ̂ + log(E[K])/(λ − 1),

  for any λ̂ ≥ 1 (the minimum over the curve's orders is taken), E[K] = η(1 − γ)/(γ(1 − γ^η))
  (η ≠ 0) or (1/γ − 1)/log(1/γ) (η = 0);
- K ~ Poisson(μ), Thm 6: where Q is (ε̂, δ̂)-DP with e^ε̂ ≤ 1 + 1/(λ − 1),

      ε'(λ) = ε(λ) + μ·δ̂ + log(μ)/(λ − 1),

  with ε̂ = log(1 + 1/(λ − 1)) and δ̂ read off Q's RDP curve (dp-accounting's ``compute_delta``).

RDP is non-decreasing in λ, so ε'(λ) is then lowered to the least ε' at any order ≥ λ (as
dp-accounting's ``RepeatAndSelectDpEvent`` does), trials marked ``role="final"`` (the selected
configuration retrained on all its rows) are composed on top, and the curve is converted to
(ε, δ) with Balle et al. 2020, Thm 21. It covers the selected model and its score only; the
other trials' models and metrics (a sweep's results table) fall under composition.

**When there is no ε.** Validation scores are themselves releases: computed on private rows
(``data.validation`` fraction or folds: rows of the training clients) they are not privatised,
so a selection by them has no ε; neither has a selection on the test set (its rows may be the
clients' own, e.g. FEMNIST's writers). Only validation clients held out of the training
population (``data.validation.clients``) make the scores public, and only where every trial
held out the same clients: the held-out draw (and the partition under it) depends on the seed,
so across seeds a client held out in one trial trains in another, and its scores are a release
of a training client's data. Each trial records a digest of its held-out rows (``held_out``);
a sweep whose trials' digests differ, or a trial without one, has no ε. A non-private trial, a
``dp_valid=false`` one, or trials whose privacy unit, adjacency or threat model differ have
no joint ε either; each reason is stated.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from privacy.accountant import ADJACENCY, epsilon_from_rdp, rdp_of_history
from privacy.pld import DEFAULT_MAX_EPSILON, PldAccountant
from privacy.record_level import RecordLevelAccountant, compose_plds
from privacy.repeat_select import (
    check_num_trials_distribution,
    describe,
    max_curve,
    repeat_and_select_rdp,
    summed_curve,
)

SEARCHES = ("grid", "random")
VALIDATIONS = ("private", "public", "none")
ROLES = ("trial", "final")
# The runtime sections and the seed do not make another configuration (see ``configuration_key``);
# of the executor's, only the fields that change what is computed do: bf16 changes the results,
# vectorize and channels_last their float rounding. Where the actors run never does.
NOT_CONFIGURATION = ("seed", "stream_seed", "tracking", "checkpoint", "executor")
EXECUTOR_CONFIGURATION = ("precision", "vectorize", "channels_last")
NOT_PRIVATISED = "validation scores on private data are not privatised"
PRIVACY_VARIES = (
    "privacy parameters vary across the search space; Papernot–Steinke needs a bound over every "
    "configuration the search could draw"
)
HELD_OUT_DIFFER = (
    "held-out validation clients differ across trials (they depend on the seed): a client held "
    "out in one trial trains in another"
)


@dataclass(frozen=True)
class TrialPrivacy:
    """One trial's privacy, JSON-serialisable (``to_dict``/``from_dict``).

    ``mechanism`` is what composition needs: ``{"kind": "client", "sampling", "runs"}`` or
    ``{"kind": "record", "method", "data_rate", "local_steps", "batch_sampling",
    "adjacency", "num_clients", "runs"}``, ``runs`` the (σ, rate, rounds) charged.
    ``rdp_orders``/``rdp``: the trial's RDP curve (None without an RDP analysis).
    ``configuration``: the same for every seed of one configuration. ``validation``:
    what ``data.validation`` held out ("rows", "folds", "clients"; None: nothing).
    ``held_out``: the SHA-256 of the held-out validation rows (the derived store's
    ``validation.arrow``); None: nothing held out, or unknown (a record written before it was
    kept), which gives public validation no ε.
    ``role``: "trial", or "final" for the selected configuration retrained afterwards.
    """

    label: str
    unit: str | None  # "client" | "record" | None (non-private)
    dp_valid: bool
    delta: float | None
    epsilon: float | None  # the run's own ε (None: none)
    adjacency: str | None = None
    threat_model: str | None = None
    epsilon_for: str | None = None  # "this run" or the deployment the ε is claimed for
    accountant: str | None = None
    mechanism: dict | None = None
    rdp_orders: tuple[float, ...] | None = None
    rdp: tuple[float, ...] | None = None
    configuration: str = ""
    validation: str | None = None
    held_out: str | None = None
    reason: str | None = None  # why there is no ε
    role: str = "trial"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrialPrivacy:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"TrialPrivacy: unknown keys {sorted(unknown)}")
        data = dict(data)
        for name in ("rdp_orders", "rdp"):
            if data.get(name) is not None:
                data[name] = tuple(float(v) for v in data[name])
        return cls(**data)

    def curve(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self.rdp is None:
            return None
        return np.asarray(self.rdp_orders, dtype=np.float64), np.asarray(self.rdp)


def data_locations(data: dict) -> tuple[str, ...]:
    """The fields of a config's ``data`` that only say where its files are: the store is keyed
    by what it holds, so moving it changes no result; ``root`` only where no ``pretrained``
    folder (in it: its weights and tokenizer) is read."""
    moved = ("store_root", "download")
    return moved if data.get("pretrained") is not None else (*moved, "root")


def configuration_key(config_dict: dict) -> str:
    """A hash of a config without its seed, runtime sections and data locations (but with the
    executor's ``EXECUTOR_CONFIGURATION`` fields): equal for a configuration's seeds,
    placements and store locations, different for different hyperparameters or numerics."""
    kept = {k: v for k, v in config_dict.items() if k not in NOT_CONFIGURATION}
    data = kept.get("data")
    if isinstance(data, dict):  # where the files are is no configuration
        kept["data"] = {k: v for k, v in data.items() if k not in data_locations(data)}
    executor = config_dict.get("executor") or {}
    kept["executor"] = {k: executor[k] for k in EXECUTOR_CONFIGURATION if k in executor}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def trial_privacy(outcome) -> TrialPrivacy:
    """The privacy of a finished run (``cluster.runtime.experiment.Outcome``): its claim's mechanism
    over the rounds it charged, its own ε, and its RDP curve."""
    claim, config = outcome.claim, outcome.config
    validation = config.data.validation
    common = {
        "label": config.tracking.run_name or outcome.run_id or "trial",
        "configuration": configuration_key(config.to_dict()),
        "validation": None if validation is None else validation.kind,
        "held_out": outcome.held_out,
        "delta": claim.delta,
    }
    if not claim.private:
        return TrialPrivacy(unit=None, dp_valid=False, epsilon=None, reason=claim.status, **common)
    unit = "record" if config.sample_level else "client"
    described = {
        "unit": unit,
        "dp_valid": claim.dp_valid,
        "threat_model": claim.threat_model,
        "epsilon_for": claim.deployment or "this run",
    }
    if not claim.dp_valid:
        return TrialPrivacy(epsilon=None, reason=claim.status, **described, **common)
    rounds = len(outcome.result.history)
    if unit == "client":
        mechanism = {
            "kind": "client",
            "sampling": claim.assumption,
            "runs": [[claim.noise_multiplier, claim.sample_rate, rounds]] if rounds else [],
        }
        adjacency = ADJACENCY[claim.assumption]
    else:
        mechanism = {
            "kind": "record",
            "method": claim.accountant_name,
            "data_rate": claim.data_rate,
            "local_steps": claim.local_steps,
            "batch_sampling": claim.batch_sampling,
            "adjacency": claim.adjacency,
            "num_clients": claim.num_clients,
            "runs": [list(run) for run in claim.history(rounds)],
        }
        adjacency = f"{claim.adjacency.replace('_', ' ')} record"
    epsilon = outcome.epsilon
    return mechanism_trial(
        mechanism,
        adjacency,
        claim.accountant_name,
        epsilon=epsilon if math.isfinite(epsilon) else None,
        **described,
        **common,
    )


def mechanism_trial(
    mechanism: dict, adjacency: str, accountant: str, **fields_given
) -> TrialPrivacy:
    """A dp_valid trial of ``mechanism`` (``TrialPrivacy.mechanism``'s format) with its RDP
    curve; ``fields_given`` sets the other fields (``unit`` "client" and ``epsilon`` None
    unless given). For runs see ``trial_privacy``; calculators and tests build trials here."""
    curve = mechanism_rdp(mechanism)
    defaults = {"label": "trial", "unit": "client", "dp_valid": True, "delta": None}
    return TrialPrivacy(
        **{**defaults, "epsilon": None, **fields_given},
        adjacency=adjacency,
        accountant=accountant,
        mechanism=mechanism,
        rdp_orders=None if curve is None else tuple(curve[0].tolist()),
        rdp=None if curve is None else tuple(curve[1].tolist()),
    )


def _record_accountant(mechanism: dict) -> RecordLevelAccountant:
    return RecordLevelAccountant(
        mechanism["data_rate"],
        mechanism["local_steps"],
        mechanism["batch_sampling"],
        mechanism["adjacency"],
        mechanism["method"],
        mechanism["num_clients"],
    )


def _runs(mechanism: dict) -> list[tuple[float, float, int]]:
    return [(float(s), float(q), int(n)) for s, q, n in mechanism["runs"] if n > 0]


def mechanism_rdp(mechanism: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """(orders, RDP curve) of a trial's mechanism; None without an RDP analysis of it."""
    runs = _runs(mechanism)
    if mechanism["kind"] == "client":
        return rdp_of_history(mechanism["sampling"], runs)
    accountant = _record_accountant(mechanism)
    if not runs:
        curve = accountant.rdp_curve([(1.0, 1.0, 1)])
        return None if curve is None else (curve[0], np.zeros_like(curve[1]))
    return accountant.rdp_curve(runs)


# ----------------------------------------------------------------------------- the statement


@dataclass(frozen=True)
class TuningStatement:
    """The ε of releasing the selected model, or None with the reason; ``assumption`` states
    what the number rests on. ``composition_epsilon``: where ``method`` is Papernot–Steinke's,
    the composition bound too (it covers every trial's outputs, e.g. the results table)."""

    epsilon: float | None
    delta: float | None
    method: str
    assumption: str
    reason: str | None
    composition_epsilon: float | None = None

    def line(self) -> str:
        if self.epsilon is None:
            return f"tuning privacy: ε not available ({self.reason})"
        text = (
            f"tuning privacy: ε = {self.epsilon:.3f} at δ = {self.delta:g} for releasing the "
            f"selected model ({self.method})"
        )
        if self.composition_epsilon is not None:
            text += f"; every trial's outputs: ε = {self.composition_epsilon:.3f} (composition)"
        return f"{text}; assuming {self.assumption}"


def tuning_statement(
    trials: Sequence[TrialPrivacy],
    *,
    search: str,
    num_trials_distribution: dict | None,
    validation: str,
    delta: float | None,
    space_refusal: str | None = None,
    secret_streams: bool = False,
) -> TuningStatement:
    """The privacy of releasing the model a sweep of ``trials`` selected (module docstring).

    Args:
        trials: every run of the sweep on the private data, ``role="final"`` for a retraining
            of the selected configuration.
        search: "grid" or "random".
        num_trials_distribution: for random search with a random number of configurations,
            the distribution it was drawn from (``check_num_trials_distribution``):
            Papernot–Steinke then applies; None: a fixed number, composition only.
        validation: "public" (held-out clients outside the training population), "private"
            (rows of the training clients) or "none" (selection on the test set).
        delta: δ of the statement; None: the smallest of the trials' δ.
        space_refusal: why the search space may draw a configuration whose mechanism no trial
            ran (the caller reads the space: ``cluster.analysis.sweep_spec``), or None;
            Papernot–Steinke is then not applied.
        secret_streams: whether every trial's noise and cohorts were keyed by a secret
            (``privacy.secret_streams``); else they follow from public values, said in the
            assumption.

    Raises:
        ValueError: for an unknown ``search`` or ``validation``, a malformed distribution, or
            a distribution given for a grid.
    """
    if search not in SEARCHES:
        raise ValueError(f"search = {search!r}: must be one of {', '.join(SEARCHES)}")
    if validation not in VALIDATIONS:
        raise ValueError(f"validation = {validation!r}: must be one of {', '.join(VALIDATIONS)}")
    if num_trials_distribution is not None:
        if search == "grid":
            raise ValueError(
                f"num_trials_distribution = {num_trials_distribution!r}: a grid runs every "
                "point, a fixed number of trials (Papernot–Steinke needs random search with a "
                "random number of trials); pass None"
            )
        check_num_trials_distribution(num_trials_distribution)
    if delta is None and trials:
        delta = min((t.delta for t in trials if t.delta is not None), default=None)
    if delta is not None and not 0 < delta < 1:
        raise ValueError(f"delta = {delta!r}: must be in (0, 1), e.g. 1e-5")
    streams = "" if secret_streams else STREAMS_PUBLIC
    assumption = _assumption(trials, validation) + streams
    reason = _no_epsilon_reason(trials, validation)
    if reason is not None:
        return TuningStatement(None, delta, "none", assumption, reason)
    composed, method = compose_trials(trials, delta)
    if num_trials_distribution is None:
        return TuningStatement(composed, delta, method, assumption, None)
    why = space_refusal or papernot_steinke_refusal(trials)
    if why is not None:
        assumption += f"; Papernot–Steinke not applied: {why}"
        return TuningStatement(composed, delta, method, assumption, None)
    selected = papernot_steinke_epsilon(trials, num_trials_distribution, delta)
    if selected >= composed:  # both bound the selected model: the smaller is stated
        assumption += "; Papernot–Steinke gives no smaller bound here"
        return TuningStatement(composed, delta, method, assumption, None)
    kind = num_trials_distribution["kind"].replace("_", " ")
    drawn = describe(num_trials_distribution)
    # The number of draws K is not stated: P–S's bound holds only where K stays unknown.
    assumption = (
        _assumption(trials, validation, counted=False)
        + streams
        + (
            f"; Papernot–Steinke: the number of configurations K drawn from {drawn} "
            "independently of the data, each drawn independently from the space and ranked by its "
            "own score, and only the selected model and its score released, with this ε alone (not "
            "this line: the composition ε in it grows with K), K kept secret (it follows from the "
            "spec's search.seed and shows in the sweep's tables, trial names and progress lines: "
            "whoever learns K, or sees another trial's output, is held to the composition ε); the "
            "privacy parameters the same across the space (every trial that ran the same "
            "mechanism), ε(λ) of one configuration its seeds' curves summed"
        )
    )
    return TuningStatement(
        selected, delta, f"Papernot–Steinke, {kind} number of trials", assumption, None, composed
    )


# The trials' streams (sweep_plan.with_own_streams) are a hash of each trial's configuration,
# seed and draw: anyone holding the spec can regenerate a trial's noise.
STREAMS_PUBLIC = (
    "; every trial's noise and cohorts follow from its configuration, seed and draw, which the "
    "spec gives: the ε holds against whoever cannot regenerate them (release no spec or seed "
    "with the model, or key the trials by secrets: privacy.secret_streams: true in the base)"
)


def _assumption(trials: Sequence[TrialPrivacy], validation: str, counted: bool = True) -> str:
    where = {
        "public": (
            "validation on clients held out of the training population (public data), the same "
            "clients in every trial"
        ),
        "private": "validation on rows of the training clients (private data)",
        "none": "selection on the test set",
    }[validation]
    count = f" {len(trials)}" if counted else ""
    return (
        f"all{count} trials on the same private data (one privacy unit's data in every "
        f"trial), {where}"
    )


def _no_epsilon_reason(trials: Sequence[TrialPrivacy], validation: str) -> str | None:
    """Why the sweep has no ε, or None."""
    if not trials:
        return "no trial ran"
    silent = [t.label for t in trials if t.unit is None]
    if silent:
        return f"non-private trial(s) {_names(silent)}: no ε"
    invalid = [t for t in trials if not t.dp_valid]
    if invalid:
        return f"trial {invalid[0].label}: {invalid[0].reason}"
    for field_name, what in (
        ("unit", "privacy units"),
        ("adjacency", "adjacencies"),
        ("threat_model", "threat models"),
        ("epsilon_for", "deployments"),
    ):
        values = sorted({getattr(t, field_name) for t in trials})
        if len(values) > 1:
            return f"mixed {what} ({'; '.join(values)}): no joint ε"
    if validation == "private":
        return NOT_PRIVATISED
    if validation == "none":
        return (
            "selection on the test set: its scores are not privatised and its rows may be the "
            "clients' own; hold out validation clients (data.validation.clients)"
        )
    private_rows = [t.label for t in trials if t.role == "trial" and t.validation != "clients"]
    if private_rows:
        return (
            f"{NOT_PRIVATISED}: trial(s) {_names(private_rows)} validate on rows of their "
            "training clients, not on held-out clients (data.validation.clients)"
        )
    searched = [t for t in trials if t.role == "trial"]
    unknown = [t.label for t in searched if t.held_out is None]
    if unknown:
        return (
            f"trial(s) {_names(unknown)} record no digest of their held-out validation clients "
            "(recorded before it was kept): whether every trial held out the same clients is "
            "unknown"
        )
    if len({t.held_out for t in searched}) > 1:
        return HELD_OUT_DIFFER
    return None


def _names(labels: list[str]) -> str:
    shown = ", ".join(labels[:3])
    return shown + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")


# ----------------------------------------------------------------------------- composition


def compose_trials(trials: Sequence[TrialPrivacy], delta: float) -> tuple[float, str]:
    """(ε, method) of all ``trials`` composed: PLD where every trial's accountant is PLD or
    PRV (and its ε within ``DEFAULT_MAX_EPSILON`` by the RDP bound), else RDP."""
    curves = [t.curve() for t in trials]
    rdp_epsilon = None
    if all(c is not None for c in curves):
        rdp_epsilon = epsilon_from_rdp(*summed_curve(curves), delta)
    tight = all(t.accountant in ("pld", "prv") for t in trials)
    if tight and (rdp_epsilon is None or rdp_epsilon <= DEFAULT_MAX_EPSILON):
        return composed_pld_epsilon(trials, delta), f"composition of {len(trials)} trials, PLD"
    if rdp_epsilon is None:
        raise ValueError("no RDP analysis for every trial and not all are PLD-accounted")
    return rdp_epsilon, f"composition of {len(trials)} trials, RDP (Balle et al. 2020, Thm 21)"


def composed_pld_epsilon(trials: Sequence[TrialPrivacy], delta: float) -> float:
    """ε of the trials' PLDs composed. Client level: one ``PldAccountant`` charged every
    trial's runs; record level: every run's mixture PLD (``RecordLevelAccountant.run_plds``)."""
    if trials[0].unit == "client":
        accountant = PldAccountant()
        for trial in trials:
            for sigma, q, rounds in _runs(trial.mechanism):
                accountant.step(sigma, q, rounds)
        return accountant.epsilon(delta)
    plds = [
        pld
        for trial in trials
        for pld in _record_accountant(trial.mechanism).run_plds(_runs(trial.mechanism))
    ]
    return float(compose_plds(plds).get_epsilon_for_delta(delta)) if plds else 0.0


# ----------------------------------------------------------------------------- Papernot–Steinke


def papernot_steinke_refusal(trials: Sequence[TrialPrivacy]) -> str | None:
    """Why Papernot–Steinke does not bound the selection of ``trials``, or None.

    Q is a configuration *drawn from the space*: ε(λ) must bound every configuration the search
    could draw, not only those that ran. Where every searched trial ran the same mechanism (the
    same runs, the same RDP curve) the privacy parameters are taken to be fixed across the
    space and a configuration's curve is its seeds' summed; where they differ, the curves that
    ran say nothing of those that did not, and there is no bound."""
    searched = [t for t in trials if t.role == "trial"]
    if not searched:
        return "no searched trial"
    if any(t.rdp is None for t in trials):
        return "no RDP curve for every trial"
    ran = {
        json.dumps([t.mechanism, t.rdp_orders, t.rdp], sort_keys=True, default=str)
        for t in searched
    }
    if len(ran) > 1:
        return PRIVACY_VARIES
    return None


def papernot_steinke_epsilon(
    trials: Sequence[TrialPrivacy], distribution: dict, delta: float
) -> float | None:
    """ε at ``delta`` of the selected model by Papernot–Steinke (None where
    ``papernot_steinke_refusal`` gives a reason): Q's curve the most seeds' curves summed
    (every trial the same mechanism), repeated and selected, then the ``role="final"`` trials
    composed on top."""
    if papernot_steinke_refusal(trials) is not None:
        return None
    searched = [t for t in trials if t.role == "trial"]
    final = [t for t in trials if t.role == "final"]
    groups: dict[str, list] = {}
    for trial in searched:
        groups.setdefault(trial.configuration, []).append(trial.curve())
    orders, one_draw = max_curve([summed_curve(curves) for curves in groups.values()])
    selected = (orders, repeat_and_select_rdp(orders, one_draw, distribution))
    orders, total = summed_curve([selected, *(t.curve() for t in final)])
    return epsilon_from_rdp(orders[orders > 1], total[orders > 1], delta)
