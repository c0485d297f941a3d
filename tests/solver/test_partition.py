"""Chain partition: the DP reference, brute force and CP-SAT agree on hand and random chains."""

from __future__ import annotations

import random

import pytest

from autopart.core.errors import InfeasiblePlanError, PlanError
from tests.solver.oracles.partition_cpsat import greedy_cuts, partition_cpsat
from tests.solver.oracles.partition_dp import partition_brute_force, partition_dp, stage_costs

# (seg_cost, cut_cost, cut_in_cost, S) -> (objective, cuts); worked by hand.
HAND = [
    # [1,2,3 | 4,5] = 6 | 9; every other split is worse ([1,2,3,4 | 5] = 10).
    (([1, 2, 3, 4, 5], [0, 0, 0, 0], None, 2), (9, (2,))),
    # each cut charged to both sides: [1,2,3]+3 | 3+[4,5] = 9 | 12; after 3: 13 | 8.
    (([1, 2, 3, 4, 5], [3, 3, 3, 3], None, 2), (12, (2,))),
    # [1,2,3 | 4 | 5] = 6 | 4 | 5.
    (([1, 2, 3, 4, 5], [0, 0, 0, 0], None, 3), (6, (2, 3))),
    # a costly cut in the middle pushes the split off balance: after 0: 1+1 | 1+3 = 2 | 4 ...
    (([2, 2, 2, 2], [1, 9, 1], None, 2), (7, (0,))),
    # only the sender pays (inference): [5] + 4 | [5] = 9 | 5.
    (([5, 5], [4], [0], 2), (9, (0,))),
    # one stage: everything, no cut charges.
    (([7, 1, 2], [5, 5], None, 1), (10, ())),
    # one segment per stage: 1+2 | 2+3+3 | 3+4 ... = 3 | 8 | 7.
    (([1, 3, 4], [2, 3], None, 3), (8, (0, 1))),
]


@pytest.mark.parametrize(("args", "expected"), HAND)
def test_hand_worked_chains(args: tuple, expected: tuple[int, tuple[int, ...]]) -> None:
    seg, cut, cut_in, s = args
    assert partition_dp(seg, cut, s, cut_in) == expected
    assert partition_brute_force(seg, cut, s, cut_in)[0] == expected[0]
    res = partition_cpsat(seg, cut, s, cut_in)
    assert (res.objective, res.bound, res.status) == (expected[0], expected[0], "OPTIMAL")
    assert max(stage_costs(seg, cut, res.cuts, cut_in)) == expected[0]


def test_stage_costs_table() -> None:
    # [1 | 2,3 | 4]: 1+10 | 20+5+10 | 20+4 with out-charges 10 and in-charges 20.
    assert stage_costs([1, 2, 3, 4], [10, 10, 10], [0, 2], [20, 20, 20]) == [11, 35, 24]


def test_cpsat_matches_dp_on_random_chains() -> None:
    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 40)
        s = rng.randint(1, min(6, k))
        seg = [rng.randint(0, 100) for _ in range(k)]
        cut = [rng.randint(0, 40) for _ in range(k - 1)]
        cut_in = [rng.randint(0, 40) for _ in range(k - 1)] if rng.random() < 0.3 else None
        dp_obj, dp_cuts = partition_dp(seg, cut, s, cut_in)
        res = partition_cpsat(seg, cut, s, cut_in)
        assert res.status == "OPTIMAL", (seg, cut, s)
        assert res.objective == dp_obj, (seg, cut, cut_in, s, dp_cuts, res.cuts)
        assert len(res.cuts) == s - 1
        assert max(stage_costs(seg, cut, res.cuts, cut_in)) == res.objective
        assert max(stage_costs(seg, cut, dp_cuts, cut_in)) == dp_obj


def test_dp_matches_brute_force_on_tiny_chains() -> None:
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 8)
        s = rng.randint(1, k)
        seg = [rng.randint(0, 20) for _ in range(k)]
        cut = [rng.randint(0, 10) for _ in range(k - 1)]
        cut_in = [rng.randint(0, 10) for _ in range(k - 1)] if rng.random() < 0.3 else None
        assert partition_dp(seg, cut, s, cut_in)[0] == partition_brute_force(seg, cut, s, cut_in)[0]


def test_weight_cap_forces_a_worse_split() -> None:
    # Unconstrained: [1,1,1 | 10] -> 10. With weights [5,5,5,1] and cap 10 the first stage
    # holds at most two segments, so [1,1 | 1,10] -> 11.
    seg, cut = [1, 1, 1, 10], [0, 0, 0]
    assert partition_cpsat(seg, cut, 2).objective == 10
    res = partition_cpsat(seg, cut, 2, seg_weight=[5, 5, 5, 1], weight_cap=10)
    assert (res.objective, res.cuts) == (11, (1,))
    # Cut weights count on both sides. Stage weights per split: after 0: 5+3 | 3+11 = 8 | 14;
    # after 1: 10+3 | 3+6 = 13 | 9; after 2: 15+3 | 3+1 = 18 | 4. Cap 12: none fits; 13: after 1.
    weights = {"seg_weight": [5, 5, 5, 1], "cut_weight": [3, 3, 3]}
    with pytest.raises(InfeasiblePlanError, match=r"weight within its cap \[12, 12\]"):
        partition_cpsat(seg, cut, 2, weight_cap=12, **weights)  # type: ignore[arg-type]
    res = partition_cpsat(seg, cut, 2, weight_cap=13, **weights)  # type: ignore[arg-type]
    assert res.cuts == (1,)


def test_greedy_hint_table() -> None:
    assert greedy_cuts([1, 1, 1, 1], 2) == (1,)
    assert greedy_cuts([1, 2, 3, 4, 5], 2) == (2,)
    assert greedy_cuts([9, 1, 1, 1], 3) == (0, 2)  # ties take the segment: 9 | 1,1 | 1
    assert greedy_cuts([1, 1, 1], 3) == (0, 1)


@pytest.mark.parametrize("solver", [partition_dp, partition_brute_force, partition_cpsat])
def test_more_stages_than_segments_is_infeasible(solver: object) -> None:
    with pytest.raises(InfeasiblePlanError,
                       match=r"num_stages=4 but the chain has only 3 segments.*num_stages <= 3"):
        solver([1, 2, 3], [0, 0], 4)  # type: ignore[operator]


def test_malformed_chains_raise() -> None:
    with pytest.raises(PlanError, match="num_stages=0"):
        partition_dp([1, 2], [0], 0)
    with pytest.raises(PlanError, match="cut_cost has 2 entries"):
        partition_dp([1, 2], [0, 0], 1)
    with pytest.raises(PlanError, match=">= 0"):
        partition_cpsat([1, -2], [0], 1)
