"""ZB-V and DualPipe-V: valid action lists, the same as torch's own generator, the V placement,
in-flight activations against a hand count, and plans that carry them."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.schedule import (
    Action,
    build_schedule,
    forward_schedule,
    in_flight_counts,
    stage_ranks,
    validate_schedule,
)
from autopart.solver.simulate import StageCosts, rank_peaks

SIZES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 7, 8, 12)]


def _runs(kind: str, p: int, m: int) -> bool:
    return kind == "zbv" or m >= 2 * p


def _torch_schedule(kind: str, p: int, m: int) -> ScheduleZBVZeroBubble | ScheduleDualPipeV:
    """torch 2.13's schedule object for p ranks and m microbatches, without stages: its
    generator reads only these four fields."""
    cls = ScheduleZBVZeroBubble if kind == "zbv" else ScheduleDualPipeV
    sched = cls.__new__(cls)
    sched.pp_group_size, sched._n_microbatches = p, m
    sched.num_stages = sched._num_stages = 2 * p
    return sched


def _torch_rows(kind: str, p: int, m: int) -> list[list[str]]:
    """torch 2.13's own action lists for p ranks and m microbatches (its generator, called
    without building stages: it reads only these four fields), each overlapped F+B pair
    written as its two sub-actions."""
    sched = _torch_schedule(kind, p, m)
    rows = []
    for r in range(p):
        row: list[str] = []
        for a in sched._calculate_single_rank_operations(r):
            if a is None:
                continue
            row += [str(x) for x in a.sub_actions] if a.sub_actions else [str(a)]
        rows.append(row)
    return rows


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_every_action_once_dependencies_met_and_torchs_order(kind: str, p: int, m: int) -> None:
    if not _runs(kind, p, m):
        with pytest.raises(PlanError, match=f"choose m >= {2 * p}"):
            build_schedule(kind, p, m, 2)
        return
    sched = build_schedule(kind, p, m, 2)
    validate_schedule(sched, 2 * p, m)  # each F once, each backward as B or I + W, no deadlock
    rank_of = stage_ranks(kind, p, 2)
    for r, acts in enumerate(sched):
        assert {a.stage_index for a in acts} == {r, 2 * p - 1 - r}
        assert all(rank_of[a.stage_index] == r for a in acts)
    assert [[str(a) for a in row] for row in sched] == _torch_rows(kind, p, m)


def test_the_kinds_split_as_their_papers_say() -> None:
    zbv = build_schedule("zbv", 2, 4, 2)
    assert not any(a.kind == "B" for row in zbv for a in row)  # ZB-V: every backward I + W
    dual = [a.kind for row in build_schedule("dualpipev", 2, 4, 2) for a in row]
    assert "B" in dual and "I" in dual and dual.count("I") == dual.count("W")
    # rank 0 of ZB-V at p = 2: 3 forwards of stage 0, then (3F, 3I, 3W) x 2 ...
    assert [str(a) for a in zbv[0][:6]] == ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0"]


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_v_placement_is_torchs_style_v(p: int) -> None:
    want = generate_stage_to_rank_mapping(p, 2 * p, style="v")
    assert stage_ranks("zbv", p, 2) == tuple(want[s] for s in range(2 * p))
    assert stage_ranks("dualpipev", p, 2) == stage_ranks("zbv", p, 2)
    assert stage_ranks("interleaved_1f1b", p, 2) == tuple(s % p for s in range(2 * p))
    with pytest.raises(PlanError, match="exactly 2 stages per rank"):
        stage_ranks("zbv", p, 1)


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_in_flight_activations_per_rank_against_a_hand_count(kind: str, p: int) -> None:
    """Equal stages, one byte saved per microbatch and stage: the rank's peak is the most
    stage-microbatches it holds at once.

    ZB-V, rank r: ``2 (p - r) - 1`` chunk-0 forwards, ``r`` (F1, F0) pairs, then each
    (F1, I1, W1) takes one and gives one back: ``2p`` on every rank, what one 1F1B stage of
    twice the size holds on rank 0 (p microbatches; Qi et al. 2024, ZB-V's memory is
    1F1B's). DualPipe-V, rank r: ``2 (p - r - 1)`` chunk-0 forwards and ``r + 1`` (F0, F1)
    pairs make ``2p``; the main step's forward comes before its paired backward (the pair
    runs F then B here): ``2p + 1``. Per stage s: ``2p - s`` (``min`` with m).
    """
    m = 4 * p
    sched = build_schedule(kind, p, m, 2)
    s = 2 * p
    unit = StageCosts([1.0] * s, [1.0] * s, [1.0] * s, [0.0] * s, [0.0] * s, [0] * s, [1] * s,
                      [0] * s)
    want = 2 * p if kind == "zbv" else 2 * p + 1
    assert rank_peaks(sched, unit) == (want,) * p
    assert in_flight_counts(sched, s) == [2 * p - st for st in range(s)]
    short = build_schedule("zbv", p, 2, 2)  # m = 2: no stage holds more than m
    assert max(in_flight_counts(short, s)) == min(2, 2 * p)


def test_inference_runs_each_ranks_stages_in_v_placement() -> None:
    sched = forward_schedule(2, 2, 2, kind="dualpipev")
    assert [[str(a) for a in row] for row in sched] == [["0F0", "0F1", "3F0", "3F1"],
                                                        ["1F0", "1F1", "2F0", "2F1"]]
    validate_schedule(sched, 4, 2, training=False)


def test_recomputed_stages_run_a_whole_backward() -> None:
    sched = build_schedule("zbv", 2, 4, 2, recompute=[3])
    acts = [a for row in sched for a in row]
    assert Action(3, "B", 0) in acts and not any(a.stage_index == 3 and a.kind in "IW"
                                                 for a in acts)
    validate_schedule(sched, 4, 4)


def _plan(kind: str, v: int, m: int = 4) -> Plan:
    from autopart.core.plan import Cut, RankPlan, SolverReport, StagePlan

    p, s_total = 2, 4
    rank_of = stage_ranks(kind, p, v) if v == 2 else tuple(s % p for s in range(s_total))
    return Plan(graph_fingerprint="g", cluster_fingerprint="2xcpu", cost_source="manual",
                library_versions={}, optimize="speed", batch_size=8, num_microbatches=m,
                schedule_kind=kind, stages_per_rank=v,
                cuts=tuple(Cut(k, f"n{k - 1}", f"n{k}", 0) for k in (1, 2, 3)),
                stages=tuple(StagePlan(s, rank_of[s], "cpu", "", "", 0, ("", ""), 0, 0, 0.0,
                                       0.0, 0.0, 0) for s in range(s_total)),
                ranks=tuple(RankPlan(r, "cpu", tuple(s for s in range(s_total)
                                                     if rank_of[s] == r), 0) for r in range(p)),
                predicted_step_time_us=0.0, bubble_fraction=0.0,
                solver=SolverReport("MANUAL", 0.0, 0.0, 0.0, 0.0, name="manual"))


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_plans_place_v_stages_and_round_trip(kind: str) -> None:
    plan = _plan(kind, 2)
    assert [r.stage_indices for r in plan.ranks] == [(0, 3), (1, 2)]
    assert Plan.from_dict(plan.to_dict()) == plan
    # a looped placement is refused for a V kind, and the V one for interleaving
    looped = dict(_plan("interleaved_1f1b", 2).to_dict(), schedule_kind=kind)
    with pytest.raises(PlanError, match="in a V: rank r runs stages r and 2p - 1 - r"):
        Plan.from_dict(looped)
    v_shaped = dict(plan.to_dict(), schedule_kind="interleaved_1f1b")
    with pytest.raises(PlanError, match=r"stage s on rank s % 2"):
        Plan.from_dict(v_shaped)


def test_plans_check_the_v_kinds_counts() -> None:
    with pytest.raises(PlanError, match="exactly 2 stages per rank"):
        Plan.from_dict(dict(_plan("zbv", 2).to_dict(), stages_per_rank=1))
    with pytest.raises(PlanError, match="dualpipev needs at least as many microbatches"):
        Plan.from_dict(dict(_plan("dualpipev", 2).to_dict(), num_microbatches=2))


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 4), (2, 7), (3, 6), (4, 9)])
def test_dualpipev_pairs_are_torchs_overlapped_actions(p: int, m: int) -> None:
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    from autopart.core.v_schedules import dualpipev_pairs, dualpipev_rank_actions

    sched = _torch_schedule("dualpipev", p, m)
    for r in range(p):
        want = {tuple((a.stage_index, str(a)[len(str(a.stage_index))], a.microbatch_index)
                      for a in act.sub_actions)
                for act in sched._calculate_single_rank_operations(r)
                if act is not None and act.computation_type == OVERLAP_F_B}
        pairs = dualpipev_pairs(p, m, r)
        assert pairs == want
        acts = dualpipev_rank_actions(p, m, r)
        for f, b in pairs:  # each pair's backward follows its forward
            assert acts[acts.index(f) + 1] == b
