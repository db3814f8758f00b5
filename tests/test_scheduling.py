"""Placing clients on hosts: pinned by data size, and each round's cohort evened out."""

import numpy as np
import pytest

from actors.scheduling import balance_round, pin_clients


def test_pinning_balances_samples_and_covers_every_client():
    sizes = np.array([50, 10, 10, 30, 20, 40, 5, 5])
    hosts = pin_clients(sizes, 3)
    assert sorted(c for h in hosts for c in h) == list(range(8))
    loads = [int(sizes[h].sum()) for h in hosts]
    assert max(loads) - min(loads) <= 10


def test_an_uneven_split_of_equal_clients_is_evened_out():
    cost = np.full(100, 5)
    groups = [[1, 4, 9, 12, 20, 33, 41], [60, 70, 99]]
    balanced = balance_round(groups, cost)
    assert [len(g) for g in balanced] == [5, 5]
    assert sorted(balanced[0] + balanced[1]) == sorted(groups[0] + groups[1])
    assert set(balanced[1]) >= {60, 70, 99}  # only the busiest host's clients move
    assert balance_round(groups, cost) == balanced  # a function of its inputs


@pytest.mark.parametrize("seed", range(20))
def test_balancing_never_lengthens_a_round_and_keeps_every_client_once(seed):
    rng = np.random.default_rng(seed)
    cost = rng.integers(1, 12, size=300)
    hosts = int(rng.integers(2, 6))
    cohort = rng.choice(300, size=40, replace=False)
    owner = rng.integers(0, hosts, size=300)
    groups = [cohort[owner[cohort] == h].tolist() for h in range(hosts)]
    balanced = balance_round(groups, cost)
    assert sorted(c for g in balanced for c in g) == sorted(cohort.tolist())
    before = max(int(cost[g].sum()) for g in groups)
    after = [int(cost[g].sum()) for g in balanced]
    assert max(after) <= before
    # No single move could lower the busiest host further.
    busiest, idlest = int(np.argmax(after)), int(np.argmin(after))
    gap = after[busiest] - after[idlest]
    assert all(cost[c] >= gap for c in balanced[busiest])


def test_a_balanced_round_is_left_alone():
    cost = np.array([3, 3, 3, 3])
    assert balance_round([[0, 1], [2, 3]], cost) == [[0, 1], [2, 3]]
    assert balance_round([[0, 1], []], np.array([3, 3])) == [[1], [0]]  # ties: lower id moves
