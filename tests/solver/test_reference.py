"""CP-SAT on the chain problem matches the brute-force reference exactly on random instances."""

from __future__ import annotations

import random

import pytest

from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.solver._closed_form import in_flight, objective_weights
from autopart.solver.chain import ChainProblem
from autopart.solver.chain_cpsat import solve_chain_cpsat
from autopart.solver.chain_dp import chain_dp_hint
from tests.solver.oracles.brute_force import solve_brute_force

KINDS = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2)]


def random_problem(rng: random.Random, kind: str, v: int, optimize: str) -> ChainProblem:
    p = rng.randint(1, 3 if v == 1 else 2)
    s = p * v
    m = p * rng.randint(1, 3) if kind == "interleaved_1f1b" else rng.randint(1, 5)
    k = rng.randint(s, min(s + 4, 8))
    w_stage, w_rank, w_sum = objective_weights(kind, p, m, v)
    has_cap = optimize == "memory" or rng.random() < 0.7
    seg_time = tuple(rng.randint(0, 60) for _ in range(k))
    # ZB-H1: each segment's W, part of its time, hidden behind later stages' work
    seg_w = tuple(rng.randint(0, t // 2) for t in seg_time) if kind == "zero_bubble" else None
    # and what splitting adds, paid by the stages after the first that split
    seg_x = tuple(rng.randint(0, 10) for _ in seg_time) if kind == "zero_bubble" else None
    return ChainProblem(
        seg_time=seg_time, seg_bwd_weight=seg_w, seg_split=seg_x,
        seg_fwd=tuple(rng.randint(0, 20) for _ in range(k)),
        cut_out=tuple(rng.randint(0, 8) for _ in range(k - 1)),
        cut_in=tuple(rng.randint(0, 8) for _ in range(k - 1)),
        num_ranks=p, stages_per_rank=v,
        speed=tuple(rng.choice((1.0, 1.5, 2.0)) for _ in range(p)) if rng.random() < 0.3 else None,
        w_stage=w_stage, w_rank=w_rank, w_sum=w_sum,
        seg_state=tuple(rng.randint(0, 100) for _ in range(k)),
        seg_saved=tuple(rng.randint(0, 40) for _ in range(k)),
        cut_bytes=tuple(rng.randint(0, 30) for _ in range(k - 1)),
        first_in_bytes=rng.randint(0, 30), last_out_bytes=rng.randint(0, 30),
        in_flight=in_flight(kind, p, m, v),
        rank_caps=tuple(rng.randint(150, 700) * v for _ in range(p)) if has_cap else None,
        recompute=rng.choice(("none", "all", "auto")), optimize=optimize,
        outputs_held=rng.random() < 0.5)


@pytest.mark.parametrize("optimize", ["speed", "memory"])
@pytest.mark.parametrize(("kind", "v"), KINDS)
def test_cpsat_matches_brute_force(kind: str, v: int, optimize: str) -> None:
    rng = random.Random(f"{kind}-{v}-{optimize}")
    agreed = infeasible = 0
    while agreed < 64:
        prob = random_problem(rng, kind, v, optimize)
        try:
            ref = solve_brute_force(prob)
        except InfeasiblePlanError:
            with pytest.raises(InfeasiblePlanError):
                solve_chain_cpsat(prob, chain_dp_hint(prob))
            infeasible += 1
            continue
        res = solve_chain_cpsat(prob, chain_dp_hint(prob))
        assert (res.status, res.objective, res.bound) == ("OPTIMAL", ref.objective, ref.objective)
        assert prob.fits(res.answer.cuts, res.answer.recompute)
        agreed += 1
    assert infeasible < agreed  # the generator mostly makes feasible instances


def test_dp_seed_is_exact_for_min_max() -> None:
    rng = random.Random(7)
    for _ in range(60):
        prob = random_problem(rng, "1f1b", 1, "speed")
        prob = ChainProblem(**{**{f: getattr(prob, f) for f in prob.__slots__},
                               "w_stage": 1, "w_rank": 0, "w_sum": 0})
        seed = chain_dp_hint(prob)
        try:
            ref = solve_brute_force(prob)
        except InfeasiblePlanError:
            assert seed is None
            continue
        assert seed is not None and seed.objective == ref.objective


def test_hand_worked_recompute_choice() -> None:
    # Two segments, one stage per rank, 2 ranks; stage 0 holds 3 microbatches of 100 saved
    # bytes: 300 > cap 200 unless it recomputes (keeps 3 x 10 input bytes + 100 once).
    prob = ChainProblem(seg_time=(50, 50), seg_fwd=(20, 20), cut_out=(0,), cut_in=(0,),
                        num_ranks=2, seg_state=(0, 0), seg_saved=(100, 10), cut_bytes=(10,),
                        first_in_bytes=10, in_flight=(3, 1), rank_caps=(200, 200),
                        recompute="auto")
    res = solve_chain_cpsat(prob)
    # stage 0: 10 in + 10 out + 3 x 10 + 100 = 150 <= 200, time 50 + 20 = 70.
    assert (res.answer.recompute, res.objective) == ((True, False), 70)
    assert solve_brute_force(prob) == res.answer


def test_bad_chain_problems_raise() -> None:
    with pytest.raises(InfeasiblePlanError, match="num_stages=3 but the chain has only 2"):
        ChainProblem(seg_time=(1, 2), seg_fwd=(0, 0), cut_out=(0,), cut_in=(0,), num_ranks=3)
    with pytest.raises(PlanError, match="cut_in has 2 entries; expected 1"):
        ChainProblem(seg_time=(1, 2), seg_fwd=(0, 0), cut_out=(0,), cut_in=(0, 0), num_ranks=1)
    with pytest.raises(PlanError, match="recompute='some'"):
        ChainProblem(seg_time=(1,), seg_fwd=(0,), cut_out=(), cut_in=(), num_ranks=1,
                     recompute="some")


def test_what_splitting_adds_is_paid_by_the_stages_that_split() -> None:
    # ZB-H1, 2 ranks, 4 segments of 10: stage 0 runs its backward whole (no split cost),
    # stage 1 pays 8 a segment; a recomputing stage 1 does not split either
    prob = ChainProblem(seg_time=(10,) * 4, seg_fwd=(0,) * 4, cut_out=(0,) * 3, cut_in=(0,) * 3,
                        num_ranks=2, seg_bwd_weight=(0,) * 4, seg_split=(8,) * 4)
    assert prob.stage_times((1,), (False, False)) == [20, 36]
    assert prob.stage_times((1,), (False, True)) == [20, 20]
    # so the least largest stage gives stage 0 three segments: [30 | 18], not [20 | 36]
    res = solve_chain_cpsat(prob, chain_dp_hint(prob))
    assert res.answer.cuts == solve_brute_force(prob).cuts == (2,)
    assert res.objective == 30
    with pytest.raises(PlanError, match="seg_split has 3 entries"):
        ChainProblem(seg_time=(10,) * 4, seg_fwd=(0,) * 4, cut_out=(0,) * 3, cut_in=(0,) * 3,
                     num_ranks=2, seg_split=(3,) * 3)
