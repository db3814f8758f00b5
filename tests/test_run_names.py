"""``cluster.runtime.run_names``: the description's privacy part and a stopped run's line, on
real claims (the full runs' names and lines are checked against MLflow in test_tracking.py and
test_interrupt_phases.py)."""

from __future__ import annotations

import pytest

from cluster.claims.privacy_plan import privacy_claim
from cluster.config import load_config
from cluster.runtime.records import RoundRecord
from cluster.runtime.run_names import run_description, stopped_description


def _claim(path: str, *overrides: str):
    config = load_config(path, list(overrides))
    return privacy_claim(config, config.build_algorithm())


def _history(rounds: int) -> list[RoundRecord]:
    return [
        RoundRecord(round=r, seconds=0.1, cohort_size=10, epsilon=0.5 * r) for r in range(1, 6)
    ][:rounds]


def test_a_run_that_released_no_round_states_epsilon_zero_not_infinity():
    claim = _claim("configs/quickstart.yaml")
    line = run_description(claim, [], 100, "privacy budget: round 1 would exceed", float("inf"))
    assert line.startswith("0/100 rounds (privacy budget: round 1 would exceed) · no test accuracy")
    assert "ε = 0 (no round released); privacy unit: client" in line
    assert "∞" not in line


def test_client_placed_noise_states_the_epsilon_against_the_server_too():
    claim = _claim(
        "configs/examples/dp_fedsam.yaml",
        "algorithm.noise_placement=client",
        "cohort.sampling=fixed",
    )
    assert claim.client_placed
    history = _history(3)
    line = run_description(claim, history, 5, "completed 3 rounds", 1.5)
    vs_server = claim.epsilon_vs_server(3)
    assert vs_server is not None and vs_server > 1.5
    assert f"ε = 1.500 at δ = {claim.delta:g}" in line
    assert f"against a server that sees each upload ε = {vs_server:.4g}" in line


def test_server_placed_noise_states_one_epsilon():
    claim = _claim("configs/quickstart.yaml")
    line = run_description(claim, _history(2), 100, "completed 2 rounds", 1.0)
    assert "against a server" not in line and "ε = 1.000 at δ" in line


@pytest.mark.parametrize(
    ("written", "resumed", "expected"),
    [
        (None, None, "0/200 rounds kept, no checkpoint (stopped: interrupted by SIGINT)"),
        (
            None,
            50,
            "50/200 rounds kept in the checkpoint it resumed from, unchanged "
            "(stopped: interrupted by SIGINT)",
        ),
        (
            ("ck/run.pt", 60),
            50,
            "60/200 rounds kept in checkpoint ck/run.pt (stopped: interrupted by SIGINT)",
        ),
    ],
)
def test_a_stopped_run_names_the_checkpoint_that_keeps_its_rounds(written, resumed, expected):
    error = KeyboardInterrupt("interrupted by SIGINT")
    assert stopped_description(error, written, 200, resumed) == expected


def test_a_failed_run_says_it_failed_and_why():
    line = stopped_description(RuntimeError("disk full\nmore"), ("ck/run.pt", 3), 5)
    assert line == "3/5 rounds kept in checkpoint ck/run.pt (failed: RuntimeError: disk full)"
