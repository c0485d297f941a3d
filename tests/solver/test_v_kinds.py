"""The solver and ZB-V / DualPipe-V: fixed V plans are feasible and priced by the simulator,
a free search includes them, and their memory follows the V placement."""

from __future__ import annotations

from typing import Any

import pytest

from autopart.core.errors import PlanError
from autopart.core.schedule import build_schedule, stage_ranks
from autopart.solver import SolveOptions, solve
from autopart.solver._candidate import evaluate
from autopart.solver._cost_model import CostModel
from autopart.solver._problem_grid import setup, subproblems
from autopart.solver.chain import ChainProblem
from autopart.solver.predict import predict
from autopart.solver.simulate import rank_peaks, simulate


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_a_fixed_v_plan_is_feasible_and_priced_by_the_simulator(build: Any, kind: str) -> None:
    costs = build.chain(16, param_bytes=400)
    cluster = build.cluster(2, link_bw=1e6, latency_us=5.0)
    opts = SolveOptions(batch_size=8, num_microbatches=4, schedule_kind=kind, time_limit_s=5)
    plan = solve(costs, cluster, opts)
    assert (plan.schedule_kind, plan.stages_per_rank, plan.num_stages) == (kind, 2, 4)
    assert [r.stage_indices for r in plan.ranks] == [(0, 3), (1, 2)]
    assert [st.rank for st in plan.stages] == [0, 1, 1, 0]
    # the plan's step time and peaks are the replay of its own action lists on its costs
    pred = predict(plan, costs, cluster, opts)
    replay = simulate(build_schedule(kind, 2, 4, 2), pred.stage_costs)
    assert plan.predicted_step_time_us == pytest.approx(replay.step_time_us, abs=1e-3)
    assert tuple(r.peak_memory_bytes for r in plan.ranks) == replay.peak_memory_bytes
    assert pred.trace.actions(0) == [str(a) for a in build_schedule(kind, 2, 4, 2)[0]]
    # stages 1 and 2 meet on rank 1: the value between them is handed over, not sent
    assert pred.stage_costs.send_fwd_us[1] == 0.0 and pred.stage_costs.send_bwd_us[2] == 0.0
    assert pred.stage_costs.send_fwd_us[0] > 0.0 and pred.stage_costs.send_bwd_us[3] > 0.0


def test_a_free_search_includes_the_v_kinds(build: Any) -> None:
    st = setup(build.chain(16), build.cluster(2), SolveOptions(batch_size=8))
    by_kind = {(s.kind, s.v, s.m) for s in subproblems(st)}
    assert {("zbv", 2, m) for m in (1, 2, 4, 8)} <= by_kind
    # DualPipe-V needs m >= 2p = 4
    assert {m for k, _, m in by_kind if k == "dualpipev"} == {4, 8}
    assert all(s.problem.placement == (0, 1, 1, 0) for s in subproblems(st)
               if s.kind in ("zbv", "dualpipev"))


def test_dualpipev_refuses_too_few_microbatches(build: Any) -> None:
    with pytest.raises(PlanError, match="dualpipev at least 4"):
        solve(build.chain(16), build.cluster(2),
              SolveOptions(batch_size=8, num_microbatches=2, schedule_kind="dualpipev"))
    with pytest.raises(PlanError, match="must be 2 or None"):
        SolveOptions(batch_size=8, schedule_kind="zbv", stages_per_rank=1)
    with pytest.raises(PlanError, match="pass num_stages=4"):
        SolveOptions(batch_size=8, schedule_kind="zbv", num_stages=2).configurations(2)


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_rank_peaks_follow_the_action_order_not_the_sum_of_stage_peaks(build: Any,
                                                                         kind: str) -> None:
    costs = build.chain(16, param_bytes=400, saved=1000)
    cluster = build.cluster(2)
    model = CostModel.for_options(costs, cluster, SolveOptions(batch_size=8))
    cand = evaluate(model, None, kind, 2, 2, 8, (4, 8, 12), None)
    assert cand.peaks == rank_peaks(build_schedule(kind, 2, 8, 2), cand.costs)
    # (the hand count of what that order holds is in tests/core/test_v_schedules.py)


def test_chain_problem_sums_a_ranks_v_stages() -> None:
    prob = ChainProblem(seg_time=(10, 20, 30, 40), seg_fwd=(0,) * 4, cut_out=(0,) * 3,
                        cut_in=(0,) * 3, num_ranks=2, stages_per_rank=2, w_stage=1, w_rank=4,
                        w_sum=0, seg_state=(1, 2, 4, 8), seg_saved=(0,) * 4,
                        cut_bytes=(0,) * 3, placement=stage_ranks("zbv", 2, 2))
    cuts, rc = (0, 1, 2), (False,) * 4
    assert prob.rank_memory(cuts, rc) == [1 + 8, 2 + 4]
    assert prob.time_objective(cuts, rc) == 40 + 4 * (10 + 40)
    with pytest.raises(PlanError, match="must give each of the 2 ranks 2 stage"):
        ChainProblem(seg_time=(1,) * 4, seg_fwd=(0,) * 4, cut_out=(0,) * 3, cut_in=(0,) * 3,
                     num_ranks=2, stages_per_rank=2, placement=(0, 0, 0, 1))
