"""The privacy cost of tuning (privacy.tuning): composition against hand computations and the
project's own accountants, Papernot–Steinke against the paper's closed forms, and the rules
for when a sweep has no ε."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_repeat_and_select
from scipy import optimize, stats

from cluster.runtime.experiment import run_experiment
from privacy.accountant import ADJACENCY, RdpAccountant, epsilon_from_rdp
from privacy.pld import PldAccountant
from privacy.record_level import RecordLevelAccountant
from privacy.repeat_select import (
    check_num_trials_distribution,
    draw_num_trials,
    expected_num_trials,
    repeat_and_select_rdp,
    summed_curve,
)
from privacy.tuning import (
    HELD_OUT_DIFFER,
    NOT_PRIVATISED,
    PRIVACY_VARIES,
    TrialPrivacy,
    compose_trials,
    configuration_key,
    mechanism_rdp,
    mechanism_trial,
    papernot_steinke_epsilon,
    papernot_steinke_refusal,
    trial_privacy,
    tuning_statement,
)
from tests.helpers import small_config

DELTA = 1e-5


def valid_trial(mechanism, unit, adjacency, accountant, configuration) -> TrialPrivacy:
    """A dp_valid trial of ``mechanism`` at δ = 1e-5, validated on held-out clients."""
    return mechanism_trial(
        mechanism,
        adjacency,
        accountant,
        label=configuration,
        unit=unit,
        delta=DELTA,
        threat_model=f"{unit} threat model",
        epsilon_for="this run",
        configuration=configuration,
        validation="clients",
        held_out="the same held-out clients",
    )


def client_trial(sigma, q, rounds, *, accountant="pld", configuration="a", **changes):
    """A client-level trial of ``rounds`` q-subsampled Gaussian rounds (Poisson, add/remove)."""
    mechanism = {"kind": "client", "sampling": "poisson", "runs": [[sigma, q, rounds]]}
    trial = valid_trial(mechanism, "client", ADJACENCY["poisson"], accountant, configuration)
    return dataclasses.replace(trial, **changes)


def record_trial(sigma, rate, rounds, method, configuration="a"):
    """A record-level trial: K = 5 DP-SGD steps at record rate s = 0.2 per round."""
    adjacency = "add_remove" if method == "pld" else "replace_one"
    mechanism = {
        "kind": "record",
        "method": method,
        "data_rate": 0.2,
        "local_steps": 5,
        "batch_sampling": "poisson" if method == "pld" else "fresh",
        "adjacency": adjacency,
        "num_clients": 50,
        "runs": [[sigma, rate, rounds]],
    }
    return valid_trial(mechanism, "record", f"{adjacency} record", method, configuration)


def statement(trials, search="grid", distribution=None, validation="public", delta=DELTA):
    return tuning_statement(
        trials,
        search=search,
        num_trials_distribution=distribution,
        validation=validation,
        delta=delta,
    )


def gaussian_epsilon(sigma: float, delta: float) -> float:
    """Exact ε of the Gaussian mechanism with noise multiplier σ (Balle & Wang 2018, Thm 8):
    the root of Φ(−εσ + 1/(2σ)) − e^ε·Φ(−εσ − 1/(2σ)) = δ."""

    def excess(eps):
        return (
            stats.norm.cdf(-eps * sigma + 0.5 / sigma)
            - math.exp(eps) * stats.norm.cdf(-eps * sigma - 0.5 / sigma)
            - delta
        )

    return optimize.brentq(excess, 0.0, 100.0, xtol=1e-12)


# ----------------------------------------------------------------------------- composition


def test_identical_gaussian_trials_compose_to_one_gaussian_with_sigma_over_root_k():
    """k trials of T unsampled Gaussian rounds at σ are one Gaussian at σ/√(kT): the PLD
    composition is within its pessimistic discretisation above the exact ε, and is exactly the
    project's accountant charged kT rounds."""
    sigma, rounds, k = 4.0, 3, 4
    result = statement([client_trial(sigma, 1.0, rounds) for _ in range(k)])
    exact = gaussian_epsilon(sigma / math.sqrt(k * rounds), DELTA)
    assert result.method == "composition of 4 trials, PLD"
    assert exact <= result.epsilon <= exact * 1.001
    longer = PldAccountant()
    longer.step(sigma, 1.0, k * rounds)
    assert result.epsilon == longer.epsilon(DELTA)
    assert result.delta == DELTA and result.reason is None


def test_rdp_trials_compose_like_the_rdp_accountant_on_a_longer_run():
    """Trials accounted by RDP: their curves summed equal RdpAccountant over all their rounds
    (subsampled: q = 0.1, σ = 1, 3 × 10 rounds), and the PLD of the same trials is tighter."""
    trials = [client_trial(1.0, 0.1, 10, accountant="rdp", configuration=str(i)) for i in range(3)]
    result = statement(trials)
    longer = RdpAccountant()
    longer.step(1.0, 0.1, 30)
    assert result.method.startswith("composition of 3 trials, RDP")
    assert result.epsilon == pytest.approx(longer.epsilon(DELTA), rel=1e-12)
    tight = statement([dataclasses.replace(t, accountant="pld") for t in trials])
    assert tight.epsilon < result.epsilon


def test_heterogeneous_trials_compose_to_the_accountant_of_their_concatenated_runs():
    trials = [client_trial(1.0, 0.1, 30), client_trial(2.0, 0.2, 50, configuration="b")]
    accountant = PldAccountant()
    accountant.step(1.0, 0.1, 30)
    accountant.step(2.0, 0.2, 50)
    assert statement(trials).epsilon == accountant.epsilon(DELTA)


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_record_level_trials_compose_like_one_longer_record_level_run(method):
    """Two record-level trials of 20 rounds against the run accountant of 40 rounds: RDP
    exactly, PLD within the discretisation (composed runs against one self-composition)."""
    trials = [record_trial(2.0, 0.2, 20, method, str(i)) for i in range(2)]
    result = statement(trials)
    mechanism = trials[0].mechanism
    accountant = RecordLevelAccountant(
        0.2, 5, mechanism["batch_sampling"], mechanism["adjacency"], method, 50
    )
    longer = accountant.epsilon_of(2.0, 0.2, 40, DELTA)
    assert result.epsilon == pytest.approx(longer, rel=1e-12 if method == "rdp" else 1e-3)
    single = accountant.epsilon_of(2.0, 0.2, 20, DELTA)
    assert result.epsilon > single


def test_a_composition_beyond_the_pld_range_is_the_rdp_bound():
    """PLD trials whose composition the RDP bound puts beyond 100 are stated by RDP (the PLD
    would be refused); still a valid upper bound."""
    trials = [client_trial(0.3, 1.0, 50, configuration=str(i)) for i in range(3)]
    result = statement(trials)
    assert "RDP" in result.method and result.epsilon > 100


# ----------------------------------------------------------------------------- Papernot–Steinke


def gaussian_curve(sigma: float, orders) -> np.ndarray:
    """RDP of the unsampled Gaussian mechanism: ε(λ) = λ/(2σ²) (Mironov 2017, Prop. 7)."""
    return np.asarray(orders) / (2 * sigma**2)


ORDERS = np.asarray(RdpAccountant.orders)


def theorem2(orders, rdp, eta, gamma):
    """Papernot & Steinke 2022, Thm 2, written out: ε + (1 + η)(1 − 1/λ̂)ε̂ + (1 + η)log(1/γ)/λ̂
    + log(E[K])/(λ − 1), minimised over λ̂ on the grid, E[K] from Def. 1."""
    mean = (
        eta * (1 - gamma) / (gamma * (1 - gamma**eta))
        if eta
        else (1 / gamma - 1) / math.log(1 / gamma)
    )
    best_hat = min(
        (1 + eta) * (1 - 1 / lam_hat) * eps_hat + (1 + eta) * math.log(1 / gamma) / lam_hat
        for lam_hat, eps_hat in zip(orders, rdp, strict=True)
    )
    return np.array(
        [eps + best_hat + math.log(mean) / (lam - 1) for lam, eps in zip(orders, rdp, strict=True)]
    )


def theorem6(orders, rdp, mu):
    """Papernot & Steinke 2022, Thm 6, written out: ε + μ·δ̂ + log(μ)/(λ − 1), ε̂ =
    log(1 + 1/(λ − 1)), δ̂ of Q at ε̂ from its RDP curve (Canonne, Kamath & Steinke 2020:
    δ ≤ min_α e^{(α−1)(ε(α)−ε̂)}·(1 − 1/α)^{α−1}/α; for α near 1 the KL bound √(1 − e^{−ε(α)}))."""

    def delta_at(eps_hat):
        bounds = []
        for alpha, eps in zip(orders, rdp, strict=True):
            bound = math.sqrt(-math.expm1(-eps))
            if alpha > 1.01:
                log_cks = (alpha - 1) * (eps - eps_hat + math.log1p(-1 / alpha)) - math.log(alpha)
                bound = min(bound, math.exp(log_cks))
            bounds.append(bound)
        return min(1.0, min(bounds))

    return np.array(
        [
            eps + mu * delta_at(math.log1p(1 / (lam - 1))) + math.log(mu) / (lam - 1)
            for lam, eps in zip(orders, rdp, strict=True)
        ]
    )


def lowered(curve: np.ndarray) -> np.ndarray:
    """RDP is monotone in λ: each order's bound is the least at any order at or above it."""
    return np.minimum.accumulate(curve[::-1])[::-1]


@pytest.mark.parametrize("eta, gamma", [(1.0, 0.25), (0.5, 0.1), (0.0, 0.2), (-0.5, 0.05)])
def test_theorem2_closed_form_for_the_gaussian(eta, gamma):
    rdp = gaussian_curve(3.0, ORDERS)
    distribution = {"kind": "truncated_negative_binomial", "eta": eta, "gamma": gamma}
    ours = repeat_and_select_rdp(ORDERS, rdp, distribution)
    np.testing.assert_allclose(ours, lowered(theorem2(ORDERS, rdp, eta, gamma)), rtol=1e-12)


def test_theorem2_at_eta_one_is_the_geometric_bound():
    """η = 1 is the geometric distribution, E[K] = 1/γ, and the minimum over λ̂ ≥ 1 of
    (λ̂ − 1)/(2σ²) + log(1/γ)/λ̂ is at λ̂ = σ√(2 log(1/γ)): √(2 log(1/γ))/σ − 1/(2σ²), so
    ε'(λ) = λ/(2σ²) + 2(√(2 log(1/γ))/σ − 1/(2σ²)) + log(1/γ)/(λ − 1) on a fine grid."""
    sigma, gamma = 3.0, 0.25
    geometric = {"kind": "truncated_negative_binomial", "eta": 1, "gamma": gamma}
    assert expected_num_trials(geometric) == pytest.approx(1 / gamma, rel=1e-12)
    orders = np.linspace(1.0, 64.0, 63001)
    ours = repeat_and_select_rdp(orders, gaussian_curve(sigma, orders), geometric)
    log_inv = math.log(1 / gamma)
    constant = 2 * (math.sqrt(2 * log_inv) / sigma - 1 / (2 * sigma**2))
    at = orders > 1.5  # away from λ = 1, where log(E[K])/(λ − 1) diverges and lowering acts
    closed = orders[at] / (2 * sigma**2) + constant + log_inv / (orders[at] - 1)
    np.testing.assert_allclose(lowered(ours)[at], lowered(closed), rtol=1e-6)


def test_theorem6_closed_form_for_the_gaussian():
    rdp = gaussian_curve(3.0, ORDERS)
    ours = repeat_and_select_rdp(ORDERS, rdp, {"kind": "poisson", "mean": 4.0})
    np.testing.assert_allclose(ours, lowered(theorem6(ORDERS, rdp, 4.0)), rtol=1e-9)


@pytest.mark.parametrize(
    "distribution, shape",
    [
        ({"kind": "poisson", "mean": 5.0}, math.inf),
        ({"kind": "truncated_negative_binomial", "eta": 1, "gamma": 0.2}, 1.0),
    ],
)
def test_repeat_and_select_matches_dp_accounting(distribution, shape):
    """dp-accounting's RepeatAndSelectDpEvent (by the paper's second author) on a subsampled
    curve (q = 0.05, σ = 1, 500 rounds), after the same lowering in λ."""
    rdp = mechanism_rdp({"kind": "client", "sampling": "poisson", "runs": [[1.0, 0.05, 500]]})[1]
    ours = repeat_and_select_rdp(ORDERS, rdp, distribution)
    reference = _compute_rdp_repeat_and_select(ORDERS, rdp, 5.0, shape)
    np.testing.assert_allclose(ours, lowered(np.asarray(reference)), rtol=1e-12)


def test_papernot_steinke_grows_with_the_number_of_trials_and_exceeds_one_trial():
    trials = [
        client_trial(1.0, 0.05, 500, accountant="rdp", configuration=str(i)) for i in range(4)
    ]
    one = epsilon_from_rdp(*trials[0].curve(), DELTA)
    by_mean = [
        statement(trials, "random", {"kind": "poisson", "mean": mu}).epsilon for mu in (1, 2, 4)
    ]
    by_gamma = [
        statement(trials, "random", {"kind": "truncated_negative_binomial", "eta": 1, "gamma": g})
        for g in (0.5, 0.25, 0.1)
    ]
    assert one < by_mean[0] < by_mean[1] < by_mean[2]
    assert one < by_gamma[0].epsilon < by_gamma[1].epsilon < by_gamma[2].epsilon
    assert by_gamma[0].method == "Papernot–Steinke, truncated negative binomial number of trials"
    assert by_gamma[0].composition_epsilon == statement(trials).epsilon
    assumption = by_gamma[0].assumption
    assert "only the selected model and its score released, with this ε alone" in assumption
    assert "K kept secret" in assumption and "the composition ε in it grows with K" in assumption
    assert "ranked by its own score" in assumption
    # K known is K fixed: the statement that goes with the selected model does not state it
    assert "all trials on the same private data" in assumption and " 4 trials" not in assumption
    assert "all 4 trials on the same private data" in statement(trials).assumption


def test_papernot_steinke_counts_a_configurations_seeds_together():
    """Q is one configuration with all its seeds: two seeds of each of two configurations
    give Q's curve twice one seed's (the maximum over the configurations of their sums)."""
    seeds = [client_trial(1.0, 0.05, 300, accountant="rdp", configuration=c) for c in "aabb"]
    doubled = client_trial(1.0, 0.05, 600, accountant="rdp", configuration="a")
    poisson = {"kind": "poisson", "mean": 2.0}
    by_seeds = statement(seeds, "random", poisson)
    by_one = statement(
        [doubled, dataclasses.replace(doubled, configuration="b")], "random", poisson
    )
    assert by_seeds.epsilon == pytest.approx(by_one.epsilon, rel=1e-12)


def test_papernot_steinke_needs_the_same_mechanism_in_every_configuration():
    """Q draws a configuration from the space: the curves of those that ran bound it only where
    they are all the same. σ varying over the space (or one trial stopped early: fewer rounds)
    refuses Papernot–Steinke and states composition; the same σ, q, rounds everywhere apply it,
    to the value of one configuration's seeds repeated and selected."""
    poisson = {"kind": "poisson", "mean": 4.0}
    same = [client_trial(1.0, 0.05, 300, accountant="rdp", configuration=c) for c in "aabbcc"]
    applied = statement(same, "random", poisson)
    assert applied.method == "Papernot–Steinke, poisson number of trials"
    one_draw = summed_curve([same[0].curve(), same[1].curve()])
    orders, rdp = one_draw[0], repeat_and_select_rdp(*one_draw, poisson)
    assert applied.epsilon == epsilon_from_rdp(orders[orders > 1], rdp[orders > 1], DELTA)
    assert papernot_steinke_refusal(same) is None
    varied = [
        client_trial(sigma, 0.05, 300, accountant="rdp", configuration=str(sigma))
        for sigma in (1.0, 1.0, 2.0, 2.0)
    ]
    stopped = [*same[:-1], client_trial(1.0, 0.05, 120, accountant="rdp", configuration="c")]
    for trials in (varied, stopped):
        assert papernot_steinke_refusal(trials) == PRIVACY_VARIES
        assert papernot_steinke_epsilon(trials, poisson, DELTA) is None
        refused = statement(trials, "random", poisson)
        assert refused.method.startswith("composition of")
        assert refused.epsilon == statement(trials).epsilon
        assert refused.composition_epsilon is None
        assert f"Papernot–Steinke not applied: {PRIVACY_VARIES}" in refused.assumption
    # The same mechanism in every trial that ran, but the space could draw another.
    space = "rounds may change the privacy mechanism, and no finished trial ran rounds=500"
    unseen = tuning_statement(
        same, search="random", num_trials_distribution=poisson, validation="public",
        delta=DELTA, space_refusal=space,
    )  # fmt: skip
    assert unseen.method.startswith("composition of") and unseen.epsilon > applied.epsilon
    assert f"Papernot–Steinke not applied: {space}" in unseen.assumption


def test_a_final_retraining_is_composed_after_the_selection():
    trials = [
        client_trial(1.0, 0.05, 300, accountant="rdp", configuration=str(i)) for i in range(6)
    ]
    tnb = {"kind": "truncated_negative_binomial", "eta": 1, "gamma": 0.25}
    final = client_trial(1.0, 0.05, 300, accountant="rdp", role="final")
    without = statement(trials, "random", tnb)
    with_final = statement([*trials, final], "random", tnb)
    assert with_final.epsilon > without.epsilon


def test_when_papernot_steinke_exceeds_composition_composition_is_stated():
    """One trial drawn with E[K] = 20: the selection bound exceeds the one trial that ran."""
    trial = client_trial(1.0, 0.05, 300)
    result = statement([trial], "random", {"kind": "poisson", "mean": 20.0})
    assert result.method == "composition of 1 trials, PLD"
    assert result.composition_epsilon is None
    assert result.assumption.endswith("; Papernot–Steinke gives no smaller bound here")
    assert "K kept secret" not in result.assumption


def test_the_statement_says_whether_the_trials_streams_can_be_regenerated():
    trials = [client_trial(1.0, 0.05, 300, configuration=c) for c in "ab"]
    public = statement(trials)
    assert "follow from its configuration, seed and draw" in public.assumption
    assert "privacy.secret_streams: true" in public.assumption
    secret = tuning_statement(
        trials,
        search="grid",
        num_trials_distribution=None,
        validation="public",
        delta=DELTA,
        secret_streams=True,
    )
    assert "follow from its configuration" not in secret.assumption
    assert secret.epsilon == public.epsilon


@pytest.mark.parametrize(
    "distribution, mean",
    [
        ({"kind": "truncated_negative_binomial", "eta": 1, "gamma": 0.25}, 4.0),
        ({"kind": "truncated_negative_binomial", "eta": 0, "gamma": 0.2}, 4 / math.log(5)),
        ({"kind": "truncated_negative_binomial", "eta": 0.5, "gamma": 0.1}, None),
        ({"kind": "poisson", "mean": 3.0}, 3.0),
    ],
)
def test_draws_of_the_number_of_trials_follow_the_distribution(distribution, mean):
    mean = expected_num_trials(distribution) if mean is None else mean
    assert expected_num_trials(distribution) == pytest.approx(mean, rel=1e-12)
    draws = [draw_num_trials(distribution, np.random.default_rng(7)) for _ in range(3)]
    assert len(set(draws)) == 1  # seeded: the same generator state, the same K
    rng = np.random.default_rng(0)
    sample = np.array([draw_num_trials(distribution, rng) for _ in range(20000)])
    assert sample.mean() == pytest.approx(mean, rel=0.05)
    if distribution.get("eta") == 1:  # geometric: P[K = 1] = γ
        assert np.mean(sample == 1) == pytest.approx(distribution["gamma"], abs=0.01)
    if distribution["kind"] != "poisson":
        assert sample.min() >= 1


@pytest.mark.parametrize(
    "distribution, field",
    [
        ({"kind": "binomial", "mean": 3}, "num_trials_distribution.kind"),
        ({"kind": "poisson", "mean": 0}, "num_trials_distribution.mean"),
        ({"kind": "poisson", "mean": 0.2}, "num_trials_distribution.mean"),  # dp-accounting: ≥ 1
        ({"kind": "poisson", "mean": True}, "num_trials_distribution.mean"),
        ({"kind": "truncated_negative_binomial", "eta": -1, "gamma": 0.2}, ".eta = -1"),
        ({"kind": "truncated_negative_binomial", "eta": 1, "gamma": 1.0}, ".gamma = 1.0"),
        ({"kind": "truncated_negative_binomial", "eta": 1}, "takes exactly the keys"),
    ],
)
def test_bad_distributions_are_refused_naming_the_field(distribution, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        check_num_trials_distribution(distribution)


# ----------------------------------------------------------------------------- no ε


def test_private_validation_scores_have_no_tuning_epsilon():
    trials = [client_trial(1.0, 0.1, 10)]
    private = statement(trials, validation="private")
    assert private.epsilon is None and private.reason == NOT_PRIVATISED
    assert "validation on rows of the training clients" in private.assumption
    on_test = statement(trials, validation="none")
    assert on_test.epsilon is None and "selection on the test set" in on_test.reason
    rows = statement([dataclasses.replace(trials[0], validation="rows")], validation="public")
    assert rows.epsilon is None and rows.reason.startswith(NOT_PRIVATISED)
    assert "ε not available" in rows.line()


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"unit": None, "dp_valid": False}, "non-private trial(s)"),
        ({"dp_valid": False, "reason": "dp_valid=false: kept noise"}, "dp_valid=false: kept"),
        ({"unit": "record"}, "mixed privacy units"),
        ({"adjacency": ADJACENCY["without_replacement"]}, "mixed adjacencies"),
        ({"threat_model": "secure aggregation"}, "mixed threat models"),
    ],
)
def test_trials_without_a_joint_epsilon(change, reason):
    trials = [client_trial(1.0, 0.1, 10), client_trial(1.0, 0.1, 10, **change)]
    result = statement(trials, "random", {"kind": "poisson", "mean": 2})
    assert result.epsilon is None and reason in result.reason and result.method == "none"


def test_a_grid_gets_composition_only():
    with pytest.raises(ValueError, match="a grid runs every point"):
        statement([client_trial(1.0, 0.1, 10)], "grid", {"kind": "poisson", "mean": 2})
    with pytest.raises(ValueError, match="search = 'bayes'"):
        statement([client_trial(1.0, 0.1, 10)], "bayes")
    with pytest.raises(ValueError, match="validation = 'test'"):
        statement([client_trial(1.0, 0.1, 10)], validation="test")


def test_the_statements_delta_defaults_to_the_trials_smallest():
    trials = [client_trial(1.0, 0.1, 10), client_trial(1.0, 0.1, 10, delta=1e-6)]
    result = statement(trials, delta=None)
    assert result.delta == 1e-6
    assert f"δ = {1e-6:g}" in result.line()


def test_trial_privacy_round_trips_through_json():
    trial = record_trial(2.0, 0.2, 20, "rdp")
    again = TrialPrivacy.from_dict(json.loads(json.dumps(trial.to_dict())))
    assert again == trial
    with pytest.raises(ValueError, match="unknown keys"):
        TrialPrivacy.from_dict({**trial.to_dict(), "sigma": 1})


def test_the_configuration_key_counts_the_numerics_not_the_placement():
    """bf16, vectorize and channels_last change what is computed: another configuration. The
    seed, the actors' number, resources and placement, tracking, checkpoints and where the data
    files are do not."""
    base = small_config("/tmp/unused").to_dict()
    key = configuration_key(base)

    def changed(section, **values):
        return configuration_key({**base, section: {**base[section], **values}})

    assert configuration_key({**base, "seed": 7}) == key
    for values in (
        {"kind": "local"},
        {"num_actors": 7},
        {"cpus_per_actor": 3.0},
        {"gpus_per_actor": 0.5},
        {"address": "auto"},
        {"placement": "spread"},
    ):
        assert changed("executor", **values) == key, values
    assert changed("tracking", enabled=True) == key
    assert changed("checkpoint", every=3) == key
    for values in ({"store_root": "/elsewhere/shards"}, {"root": "raw"}, {"download": True}):
        assert changed("data", **values) == key, values  # where the files are (review J)
    assert changed("data", num_clients=7) != key
    pretrained = {**base, "data": {**base["data"], "pretrained": "roberta-base"}}
    moved = {**pretrained, "data": {**pretrained["data"], "root": "elsewhere"}}
    assert configuration_key(moved) != configuration_key(pretrained)  # its weights move too
    for values in ({"precision": "bf16"}, {"vectorize": False}, {"channels_last": True}):
        assert changed("executor", **values) != key, values
    assert changed("algorithm", clip_norm=0.5) != key


def test_public_validation_needs_the_same_held_out_clients_in_every_trial():
    """Held-out clients that differ between trials (another seed's draw) leave a client held
    out in one trial a training client in another: no ε. A record from before the digest was
    kept (no ``held_out`` key) is read, and its held-out set is unknown: no ε either."""
    trials = [client_trial(1.0, 0.1, 10), client_trial(1.0, 0.1, 10, configuration="b")]
    assert statement(trials).epsilon is not None
    differ = [trials[0], dataclasses.replace(trials[1], held_out="another seed's clients")]
    result = statement(differ)
    assert result.epsilon is None and result.reason == HELD_OUT_DIFFER
    assert "ε not available (held-out validation clients differ" in result.line()
    old = {k: v for k, v in trials[1].to_dict().items() if k != "held_out"}
    read = TrialPrivacy.from_dict(json.loads(json.dumps(old)))
    assert read.held_out is None
    unknown = statement([trials[0], read])
    assert unknown.epsilon is None and "record no digest of their held-out" in unknown.reason
    # a final retraining (all rows, nothing held out) needs no digest
    final = client_trial(1.0, 0.1, 10, role="final", held_out=None)
    assert statement([*trials, final]).epsilon is not None


# ----------------------------------------------------------------------------- real runs


def run(store_root, *overrides):
    return run_experiment(small_config(store_root, *overrides))


DP_FEDAVG = [
    "algorithm.name=dp_fedavg",
    "algorithm.noise_multiplier=1.0",
    "algorithm.clip_norm=1.0",
    "cohort.sampling=poisson",
    "data.validation={clients: 0.1}",
]


def test_the_tuning_epsilon_of_two_client_level_runs_validated_on_held_out_clients(store_root):
    """Each trial recomposed alone is its run's ε, bit for bit; two trials of the same (σ, q)
    are the project's accountant charged their 10 rounds."""
    outcomes = [run(store_root, *DP_FEDAVG, f"algorithm.local.lr={lr}") for lr in (0.05, 0.1)]
    trials = [trial_privacy(o) for o in outcomes]
    for outcome, trial in zip(outcomes, trials, strict=True):
        assert trial.unit == "client" and trial.validation == "clients"
        assert trial.adjacency == "add/remove one client" and trial.accountant == "pld"
        assert trial.mechanism["runs"] == [[1.0, 5 / 20, 5]]
        assert compose_trials([trial], trial.delta) == (
            outcome.epsilon,
            "composition of 1 trials, PLD",
        )
        assert trial.epsilon == outcome.epsilon
    assert trials[0].configuration != trials[1].configuration
    assert trials[0].held_out is not None and trials[0].held_out == trials[1].held_out
    result = statement(trials, delta=None)
    longer = PldAccountant()
    longer.step(1.0, 5 / 20, 10)
    assert result.epsilon == longer.epsilon(trials[0].delta)
    assert result.delta == outcomes[0].claim.delta


def test_another_seed_holds_out_other_clients_and_the_sweep_has_no_epsilon(store_root):
    """Seed 1 draws other held-out clients than seed 0 (``datasets.validation``): their
    digests differ, and the statement refuses public validation across the two."""
    trials = [trial_privacy(run(store_root, *DP_FEDAVG, f"seed={seed}")) for seed in (0, 1)]
    assert None not in {t.held_out for t in trials}
    assert trials[0].held_out != trials[1].held_out
    result = statement(trials, delta=None)
    assert result.epsilon is None and result.reason == HELD_OUT_DIFFER


def test_a_sample_level_trial_recomposes_to_its_runs_epsilon(store_root):
    outcome = run(
        store_root,
        "algorithm.name=dp_scaffold",
        "algorithm.noise_multiplier=2.0",
        "algorithm.clip_norm=1.0",
        "data.validation={fraction: 0.2}",
    )
    trial = trial_privacy(outcome)
    assert trial.unit == "record" and trial.adjacency == "replace one record"
    assert trial.mechanism["data_rate"] == 16 / 64  # the 64 rows left of 80
    assert compose_trials([trial], trial.delta)[0] == pytest.approx(outcome.epsilon, rel=1e-12)
    private = statement([trial], validation="private", delta=None)
    assert private.epsilon is None and private.reason == NOT_PRIVATISED
    silent = trial_privacy(run(store_root, "data.validation={clients: 0.1}"))
    assert silent.unit is None and statement([silent]).reason.startswith("non-private")
