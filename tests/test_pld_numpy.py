"""privacy.pld_numpy gives dp-accounting's PLD values bit for bit: the one-round PLD, compositions,
ε for δ, and the PLD accountant's ε at the calculator's documented points and on a seeded grid.

Bit-equal (``==``), not only close: the port performs the library's floating-point operations in
the same order, so ε is neither above nor below dp-accounting's (it stays the same pessimistic
upper bound), and the printed values are the documented ones.
"""

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant, pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from privacy import pld_numpy
from privacy.pld import PldAccountant
from privacy.pld_runs import discretization_for
from privacy.rdp import rdp_epsilon

# The calculator's documented rows (docs/privacy.md): `pld 7.301` for the default command, 1.828
# at q = 0.01, σ = 1, T = 1000, δ = 1e-5. (σ, q, T, δ, printed ε)
DOCUMENTED = [(0.95, 0.1, 200, 0.002, "7.301"), (1.0, 0.01, 1000, 1e-5, "1.828")]


def _seeded_grid(count: int = 8, seed: int = 34) -> list[tuple[float, float, int, float]]:
    """(σ, q, T, δ) drawn log-uniformly (σ in [0.6, 3], q in [10⁻³, 1], T in [1, 3000], δ in
    [10⁻⁸, 10⁻²]), kept where the RDP bound is at most 50 (the PLD accountant refuses ε > 100,
    and dp-accounting's reference takes seconds per point there); q = 1 appended."""
    rng = np.random.default_rng(seed)
    points = []
    while len(points) < count:
        sigma = float(np.exp(rng.uniform(np.log(0.6), np.log(3.0))))
        q = float(10 ** rng.uniform(-3, 0))
        rounds = int(10 ** rng.uniform(0, np.log10(3000)))
        delta = float(10 ** rng.uniform(-8, -2))
        if rdp_epsilon(((sigma, q, rounds),), delta) <= 50:
            points.append((sigma, q, rounds, delta))
    return [*points, (2.0, 1.0, 50, 1e-5)]


def _library_epsilon(sigma: float, q: float, rounds: int, delta: float) -> float:
    """dp-accounting's PLDAccountant at the interval the PLD accountant picks."""
    interval = discretization_for(((sigma, q, rounds),), 1e-4)
    accountant = PLDAccountant(value_discretization_interval=interval)
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    accountant.compose(dp_event.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


def _ours(sigma: float, q: float, rounds: int, delta: float) -> float:
    accountant = PldAccountant()
    accountant.step(sigma, q, rounds)
    return accountant.epsilon(delta)


@pytest.mark.parametrize(("sigma", "q", "rounds", "delta", "printed"), DOCUMENTED)
def test_documented_points_equal_dp_accounting(sigma, q, rounds, delta, printed):
    ours = _ours(sigma, q, rounds, delta)
    assert ours == _library_epsilon(sigma, q, rounds, delta)
    assert f"{ours:.4g}" == printed


@pytest.mark.parametrize(("sigma", "q", "rounds", "delta"), _seeded_grid())
def test_seeded_grid_equals_dp_accounting(sigma, q, rounds, delta):
    assert _ours(sigma, q, rounds, delta) == _library_epsilon(sigma, q, rounds, delta)


def _as_library(pmf: pld_numpy.LossPmf) -> pld_pmf.DensePLDPmf:
    return pld_pmf.DensePLDPmf(pmf.interval, pmf.lower, pmf.probs.copy(), pmf.infinity, True)


def _assert_same(ours: pld_numpy.LossPmf, theirs: pld_pmf.PLDPmf) -> None:
    theirs = theirs.to_dense_pmf()
    assert ours.lower == theirs._lower_loss and ours.infinity == theirs._infinity_mass
    assert np.array_equal(ours.probs, theirs._probs)


@pytest.mark.parametrize(
    ("sigma", "q", "interval"),
    [(0.95, 0.1, 4e-4), (1.0, 0.01, 2e-4), (1.0, 0.2, 1e-4), (2.0, 1.0, 1e-4), (0.5, 1e-3, 1e-3)],
)
def test_one_round_pld_equals_from_gaussian_mechanism(sigma, q, interval):
    ours = pld_numpy.subsampled_gaussian_pld(sigma, q, interval)
    theirs = pld_lib.from_gaussian_mechanism(
        sigma, value_discretization_interval=interval, sampling_prob=q
    )
    directions = (theirs._pmf_remove,) if q == 1.0 else (theirs._pmf_remove, theirs._pmf_add)
    assert len(ours.pmfs) == len(directions)
    for pmf, reference in zip(ours.pmfs, directions, strict=True):
        _assert_same(pmf, reference)


def _random_pmf(rng, size: int, lower: int, infinity: float) -> pld_numpy.LossPmf:
    probs = rng.exponential(size=size) ** 8  # heavy tails: some truncation happens
    return pld_numpy.LossPmf(1e-3, lower, probs / probs.sum() * (1 - infinity), infinity)


@pytest.mark.parametrize(("sizes", "infinities"), [((300, 500), (0.0, 1e-9)), ((1, 700), (0, 0))])
def test_composition_equals_dp_accountings(sizes, infinities):
    rng = np.random.default_rng(6)
    first, second = (
        _random_pmf(rng, size, -size // 3, infinity)
        for size, infinity in zip(sizes, infinities, strict=True)
    )
    theirs = _as_library(first).compose(_as_library(second), tail_mass_truncation=1e-15)
    _assert_same(pld_numpy.composed(first, second), theirs)


@pytest.mark.parametrize(
    ("lower", "infinity", "delta"),
    [
        (-200, 0.0, 1e-5),  # the interpolated ε
        (-200, 1e-3, 1e-5),  # more mass at +∞ than δ: ∞
        (-200, 0.0, 0.9),  # δ(0) ≤ δ: 0
        (800_000, 0.0, 1e-5),  # e^(−loss) underflows: ε is a loss of the grid
    ],
)
def test_epsilon_for_delta_equals_dp_accountings(lower, infinity, delta):
    pmf = _random_pmf(np.random.default_rng(7), 2000, lower, infinity)
    theirs = _as_library(pmf).get_epsilon_for_delta(delta)
    assert pld_numpy.epsilon_for_delta(pmf, delta) == theirs
