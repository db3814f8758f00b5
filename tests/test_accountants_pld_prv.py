"""PLD and PRV accountants: reference values, agreement with RDP, composition, checkpoints."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from opacus.accountants import PRVAccountant

from privacy.accountant import RdpAccountant
from privacy.pld import MIN_DELTA, PldAccountant, rdp_epsilon
from privacy.pld_runs import (
    MAX_DOUBLINGS,
    SUPPORT_CAP,
    _history_support,
    discretization_for,
    self_composed,
)
from privacy.prv import PrvAccountant

DELTA = 1e-5
TIGHT = (PldAccountant, PrvAccountant)


def _epsilon(cls, sigma, q, rounds, delta=DELTA):
    acc = cls()
    acc.step(sigma, q, rounds)
    return acc.epsilon(delta)


@pytest.mark.parametrize(
    ("cls", "expected"), [(RdpAccountant, 2.10), (PldAccountant, 1.83), (PrvAccountant, 1.83)]
)
def test_reference_value(cls, expected):
    # Poisson-subsampled Gaussian, q=0.01, σ=1, T=1000, δ=1e-5 (peers.md §2, measured)
    assert _epsilon(cls, 1.0, 0.01, 1000) == pytest.approx(expected, rel=0.02)


# q ∈ {0.01, 0.1} × σ ∈ {0.8, 1.5} × T ∈ {100, 1000}, less the points with ε ≥ 10
# (q=0.1: σ=0.8, T=100 → 11.0; σ=0.8, T=1000 → 39.9; σ=1.5, T=1000 → 12.6).
GRID = [
    (q, sigma, rounds)
    for q, sigma, rounds in itertools.product((0.01, 0.1), (0.8, 1.5), (100, 1000))
    if not (q == 0.1 and (sigma == 0.8 or rounds == 1000))
]


@pytest.mark.parametrize(("q", "sigma", "rounds"), GRID)
def test_pld_and_prv_agree_and_rdp_is_never_tighter(q, sigma, rounds):
    rdp = _epsilon(RdpAccountant, sigma, q, rounds)
    pld = _epsilon(PldAccountant, sigma, q, rounds)
    assert pld < 10
    prv_acc = PrvAccountant()
    prv_acc.step(sigma, q, rounds)
    prv = prv_acc.epsilon(DELTA)
    # PRV reports the upper end of its interval (estimate + eps_error), so allow eps_error on
    # top of 2%: at q=0.01, σ=1.5, T=100 PLD gives 0.292 and PRV 0.302.
    assert abs(prv - pld) <= 0.02 * pld + prv_acc.eps_error
    assert rdp >= pld and rdp >= prv


def test_heterogeneous_composition_equals_the_libraries():
    runs = [(1.1, 0.05, 30), (0.8, 0.1, 20)]
    pld, prv = PldAccountant(), PrvAccountant()
    for sigma, q, rounds in runs:
        for _ in range(rounds):  # one round at a time: the history must merge
            pld.step(sigma, q)
            prv.step(sigma, q)
        pld.epsilon(DELTA)  # an intermediate ε must not change the final one
    assert pld.history == prv.history == runs
    assert pld.rounds == prv.rounds == 50

    # the same interval (at 1e-4 and 2e-4 the history's PLD is wider than SUPPORT_CAP)
    interval = discretization_for(tuple(runs), 1e-4)
    assert interval == 4e-4
    lib_pld = PLDAccountant(value_discretization_interval=interval)
    for sigma, q, rounds in runs:
        event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
        lib_pld.compose(dp_event.SelfComposedDpEvent(event, rounds))
    lib_prv = PRVAccountant()
    for sigma, q, rounds in runs:
        for _ in range(rounds):
            lib_prv.step(noise_multiplier=sigma, sample_rate=q)
    assert pld.epsilon(DELTA) == lib_pld.get_epsilon(DELTA)
    assert prv.epsilon(DELTA) == lib_prv.get_epsilon(DELTA)
    # the parts compose to more than either part alone
    first = _epsilon(PldAccountant, 1.1, 0.05, 30)
    assert first < pld.epsilon(DELTA) < first + _epsilon(PldAccountant, 0.8, 0.1, 20)


@pytest.mark.parametrize("cls", TIGHT)
def test_state_dict_round_trip_continues_exactly(cls):
    plan = [(1.0, 0.02, 40), (1.0, 0.02, 1), (0.9, 0.05, 10), (0.9, 0.05, 1), (1.2, 0.02, 5)]
    uninterrupted = cls()
    for sigma, q, rounds in plan[:3]:
        uninterrupted.step(sigma, q, rounds)
        uninterrupted.epsilon(DELTA)
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    assert state == {"history": [[1.0, 0.02, 41], [0.9, 0.05, 10]]}

    resumed = cls()
    resumed.load_state_dict(state)
    assert resumed.rounds == uninterrupted.rounds == 51
    assert resumed.epsilon(DELTA) == uninterrupted.epsilon(DELTA)
    for sigma, q, rounds in plan[3:]:
        assert resumed.epsilon_after(sigma, q, DELTA) == uninterrupted.epsilon_after(
            sigma, q, DELTA
        )
        uninterrupted.step(sigma, q, rounds)
        resumed.step(sigma, q, rounds)
        assert resumed.epsilon(DELTA) == uninterrupted.epsilon(DELTA)
    assert resumed.state_dict() == uninterrupted.state_dict()


@pytest.mark.parametrize("cls", TIGHT)
def test_epsilon_after_does_not_compose(cls):
    acc = cls()
    assert acc.epsilon(DELTA) == 0.0
    assert acc.epsilon_after(1.0, 0.01, DELTA) > 0.0
    assert acc.rounds == 0 and acc.history == []
    acc.step(1.0, 0.01, 200)
    before = acc.epsilon(DELTA)
    same = acc.epsilon_after(1.0, 0.01, DELTA)
    other = acc.epsilon_after(0.8, 0.05, DELTA)
    assert acc.rounds == 200 and acc.history == [(1.0, 0.01, 200)]
    assert acc.epsilon(DELTA) == before < same < other
    acc.step(1.0, 0.01)
    assert acc.epsilon(DELTA) == same


@pytest.mark.parametrize("cls", TIGHT)
def test_edge_cases(cls):
    assert cls.name in ("pld", "prv")
    acc = cls()
    acc.step(1.0, 0.0, 5)  # nothing sampled: nothing released
    assert acc.epsilon(DELTA) == 0.0
    acc.step(0.0, 0.01)  # no noise: not private
    assert acc.epsilon(DELTA) == math.inf
    with pytest.raises(ValueError, match="sample_rate"):
        acc.step(1.0, 1.5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        acc.epsilon_after(-1.0, 0.1, DELTA)


@pytest.mark.parametrize("cls", TIGHT)
def test_huge_epsilon_is_refused_not_attempted(cls):
    # σ=0.01 would take minutes and gigabytes (PLD) or fail (opacus PRV); ε is meaningless there.
    acc = cls()
    acc.step(0.01, 0.1, 300)
    with pytest.raises(ValueError, match="rdp"):
        acc.epsilon(DELTA)


@pytest.mark.parametrize("cls", TIGHT)
def test_below_the_smallest_delta_the_rdp_bound_stands(cls):
    """The float64 FFT composition's round-off, against δ: at δ=1e-12 (σ=1, q=0.01, T=1000)
    the PLD gave ε 3.90941 where a review's tilted-FFT reference, checked against an exact
    mixture, gives 3.9143 (too small), and below ≈1e-14 its truncated tails gave ∞. Below
    ``MIN_DELTA`` each refuses, and a run's accountant falls back to the RDP bound."""
    acc = cls(fallback_to_rdp=True)
    acc.step(1.0, 0.01, 1000)
    for delta in (1e-12, 1e-16):
        assert acc.produced_by(delta) == "rdp"
        assert acc.epsilon(delta) == rdp_epsilon(((1.0, 0.01, 1000),), delta)
    assert acc.epsilon(1e-12) > 3.9143
    assert acc.produced_by(MIN_DELTA) == cls.name
    strict = cls(fallback_to_rdp=False)
    strict.step(1.0, 0.01, 1000)
    with pytest.raises(ValueError, match="refused at δ=1e-12"):
        strict.epsilon(1e-12)


def test_prv_is_never_negative_where_delta_is_large():
    """ε ≥ 0: opacus's estimate is negative where δ exceeds what the mechanism needs at ε = 0
    (−0.674 at δ = 0.5, σ=1, q=0.01, T=1000, a review's check); PLD and RDP give 0 there."""
    acc = PrvAccountant()
    acc.step(1.0, 0.01, 1000)
    assert acc.epsilon(0.5) == 0.0


def test_pld_is_judged_on_its_own_merits_where_rdp_exceeds_the_cap():
    # σ=0.8, q=0.1, T=3500, δ=1e-5: RDP says 100.5 (above max_epsilon=100), PLD itself ≈ 95
    # (the coarse probe: 95.2). It used to be refused because of the RDP bound alone.
    from privacy.pld import rdp_epsilon

    acc = PldAccountant()
    acc.step(0.8, 0.1, 3500)
    assert rdp_epsilon(((0.8, 0.1, 3500),), 1e-5) > 100
    assert 80 < acc.epsilon(1e-5) < 100


def test_prv_grid_guard_suggests_pld():
    # ε≈40 but T=50000 rounds: opacus's grid needs ~1e7 points (~10 s); refuse above the cap.
    acc = PrvAccountant(max_grid_points=1_000_000)
    acc.step(0.7, 0.01, 50_000)
    with pytest.raises(ValueError, match="use the pld accountant"):
        acc.epsilon(DELTA)


def test_privacy_package_does_not_import_ray_or_mlflow():
    code = (
        "import sys, privacy.pld, privacy.prv; "
        "sys.exit(any(m in sys.modules for m in ('ray', 'mlflow')))"
    )
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


@pytest.mark.parametrize("rounds", [1, 7, 100])
def test_self_composition_with_cached_moments_is_the_librarys(rounds):
    ours = self_composed(1.0, 0.2, 1e-4, rounds)
    theirs = pld_lib.from_gaussian_mechanism(
        1.0, value_discretization_interval=1e-4, sampling_prob=0.2
    ).self_compose(rounds)
    for a, b in zip(ours.pmfs, (theirs._pmf_remove, theirs._pmf_add), strict=True):
        assert a.lower == b._lower_loss and a.infinity == b._infinity_mass
        assert (a.probs == b._probs).all()


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.2), (1.0, 0.01)])
def test_long_runs_coarsen_the_grid_within_a_bounded_support(sigma, q):
    """The composed PLD never exceeds SUPPORT_CAP points, whatever T (so neither does the cost
    of a round's ε), and the coarser grid's ε stays a tight upper bound of the fine one."""
    for rounds in (10, 100, 1000, 10000):
        interval = discretization_for(((sigma, q, rounds),), 1e-4)
        pld = self_composed(sigma, q, interval, rounds)
        assert max(len(pmf.probs) for pmf in pld.pmfs) <= SUPPORT_CAP
        if rounds == 1000 and interval > 1e-4:  # compare with the uncapped grid
            fine = self_composed(sigma, q, 1e-4, rounds)
            coarse, exact = pld.epsilon(DELTA), fine.epsilon(DELTA)
            assert exact <= coarse <= exact * (1 + 2e-5)
    assert discretization_for(((sigma, q, 10000),), 1e-4) > 1e-4  # it did coarsen


def _smallest_fitting_interval(history, finest):
    """The rule ``discretization_for`` implements, by exhaustive search from ``finest`` up."""
    runs = [run for run in history if run[0] > 0 and run[1] > 0 and run[2] > 0]
    for k in range(MAX_DOUBLINGS):
        if _history_support(runs, finest * 2**k) <= SUPPORT_CAP:
            return finest * 2**k
    return finest * 2**MAX_DOUBLINGS


@pytest.mark.parametrize(
    "history",
    [
        ((1.0, 0.2, 10),),  # 2e-4
        ((1.0, 0.2, 1000),),  # 1.6e-3
        ((1.0, 0.01, 10),),  # 1e-4
        ((1.0, 0.01, 1000),),  # 2e-4
        ((1.0, 0.01, 10000),),  # 4e-4: 73k points, so 2e-4 is checked (152k: too wide)
        ((1.0, 0.01, 100), (1.0, 0.2, 10), (0.0, 0.2, 3)),  # 4e-4
        ((1.0, 0.2, 0),),  # nothing released: 1e-4
        # 15,000 one-round runs of 3 points at every interval: a support that shrinks by far
        # less than 2 per doubling near the cap (the review's counter-example to a slack rule)
        ((1.0, 0.2, 1000),) + ((50.0, 1e-4, 1), (49.0, 1e-4, 1)) * 7500,
    ],
)
def test_the_interval_search_finds_the_smallest_fitting_interval(history):
    assert discretization_for(history, 1e-4) == _smallest_fitting_interval(history, 1e-4)
