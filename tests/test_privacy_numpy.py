"""The RDP and PRV paths in NumPy/SciPy (privacy.rdp, privacy.prv_grid) give opacus's values,
and the privacy calculator computes its default rows without importing torch, dp-accounting or
scipy.stats (the PLD path: tests/test_pld_numpy.py)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp

from privacy.accountant import RdpAccountant, WorRdpAccountant
from privacy.pld import PldAccountant
from privacy.prv import PrvAccountant
from privacy.rdp import ORDERS, rdp_epsilon, subsampled_gaussian_rdp

# (q, σ, rounds, δ): the calculator's documented row (DP-FedSAM's ε 8.51), the quickstart's
# (q 0.2, σ 1, 100 rounds), small and large q, σ near and far from 1.
POINTS = [
    (0.1, 0.95, 200, 0.002),
    (0.2, 1.0, 100, 1e-5),
    (0.01, 1.0, 1000, 1e-5),
    (0.05, 0.7, 300, 1e-6),
    (0.5, 2.0, 50, 1e-5),
    (1.0, 1.5, 10, 1e-5),
]


def _opacus(accountant, sigma: float, q: float, rounds: int):
    accountant.history = [(sigma, q, rounds)]  # opacus's merged format
    return accountant


def test_orders_are_opacus_default_alphas():
    assert tuple(RDPAccountant.DEFAULT_ALPHAS) == ORDERS


@pytest.mark.parametrize("q, sigma", [(0.1, 0.95), (0.01, 1.0), (0.5, 2.0), (0.3, 0.4), (1, 1.5)])
def test_rdp_curve_equals_opacus(q, sigma):
    reference = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(ORDERS))
    np.testing.assert_allclose(subsampled_gaussian_rdp(q, sigma, ORDERS), reference, rtol=1e-10)


@pytest.mark.parametrize(
    "ours, theirs", [(RdpAccountant, RDPAccountant), (PrvAccountant, PRVAccountant)]
)
@pytest.mark.parametrize("q, sigma, rounds, delta", POINTS)
def test_epsilon_equals_opacus(ours, theirs, q, sigma, rounds, delta):
    accountant = ours()
    accountant.step(sigma, q, rounds)
    reference = _opacus(theirs(), sigma, q, rounds).get_epsilon(delta)
    assert accountant.epsilon(delta) == pytest.approx(reference, rel=1e-10)


def test_epsilon_is_never_negative():
    """At σ = 100 Thm 21's conversion dips below 0 (−0.00097 at q 0.2, δ 0.0063): clamped."""
    assert rdp_epsilon([(100.0, 0.2, 1)], 0.0063) == 0.0
    accountant = RdpAccountant()
    accountant.step(100.0, 0.2, 3)
    assert accountant.epsilon(0.0063) == 0.0


NAN, INF = float("nan"), float("inf")


@pytest.mark.timeout(30)  # a NaN σ once never ended _log_a_frac's series
@pytest.mark.parametrize(
    "accountant", [RdpAccountant, WorRdpAccountant, PldAccountant, PrvAccountant]
)
@pytest.mark.parametrize(
    ("sigma", "q", "delta"),
    [
        (NAN, 0.1, 1e-5),
        (INF, 0.1, 1e-5),
        (1.0, NAN, 1e-5),
        (-1.0, 0.1, 1e-5),
        (1.0, 0.1, NAN),
        (1.0, 0.1, 1.5),
        (1.0, 0.1, 0.0),
    ],
)
def test_accountants_refuse_what_no_mechanism_has(accountant, sigma, q, delta):
    with pytest.raises(ValueError, match="noise_multiplier|sample_rate|delta"):
        acc = accountant()
        acc.step(sigma, q, 10)
        acc.epsilon(delta)
    with pytest.raises(ValueError, match="noise_multiplier|sample_rate|delta"):
        accountant().epsilon_after(sigma, q, delta)
    with pytest.raises(ValueError, match="noise_multiplier|sample_rate|delta"):
        rdp_epsilon([(sigma, q, 10)], delta)


def test_prv_of_heterogeneous_rounds_equals_opacus():
    """Three runs: two self-compositions convolved, the third waits a level (opacus's tree)."""
    history = [(1.1, 0.05, 30), (0.8, 0.1, 20), (1.3, 0.02, 10)]
    ours = PrvAccountant()
    for sigma, q, rounds in history:
        ours.step(sigma, q, rounds)
    reference = PRVAccountant()
    reference.history = list(history)
    assert ours.epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-10)


def test_calculator_default_rows_import_neither_torch_nor_dp_accounting_nor_scipy_stats():
    """The documented command, as a user runs it: torch and opacus take seconds to import,
    dp-accounting and scipy.stats (which dp-accounting and scipy.signal import) about one
    (benchmarks/NOTES.md). ``-X importtime`` names every module the process imports."""
    command = ["privacy", "--sigma", "0.95", "--q", "0.1", "--rounds", "200", "--delta", "0.002"]
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cluster", *command],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "privacy.pld" in imported  # the listing is read right
    heavy = {"torch", "opacus", "dp_accounting", "scipy.stats", "scipy.signal"}
    assert not imported & heavy, sorted(imported & heavy)
    rows = dict(line.split()[:2] for line in done.stdout.splitlines()[2:])
    assert rows == {
        "rdp": "8.515",
        "pld": "7.301",
        "prv": "7.312",
        "rdp_classic": "9.726",
        "rdp-wor": "202.2",
    }
