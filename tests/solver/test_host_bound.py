"""The two-figure cost model: each action costs the slower of its device and host times, and
stages issued by one host thread are bounded by the sum of their host times (hand-worked)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.schedule import build_schedule
from autopart.runtime.description import describe
from autopart.solver import SolveOptions, solve
from autopart.solver._closed_form import closed_form_host_bound_us, closed_form_step_us
from autopart.solver._cost_model import CostModel
from autopart.solver.predict import plan_at, predict
from autopart.solver.simulate import StageCosts, host_bound_us, simulate

ONE_THREAD = RuntimeDescription(name="local", issue_threads=1)
PER_RANK = RuntimeDescription(name="distributed", issue_threads=None)


def _with_host(costs: CostGraph, fwd: float, bwd_input: float, bwd_weight: float) -> CostGraph:
    """``costs`` with the same host issue times on every node, µs."""
    return dataclasses.replace(costs, nodes=tuple(
        dataclasses.replace(n, host_fwd_us=fwd, host_bwd_input_us=bwd_input,
                            host_bwd_weight_us=bwd_weight) for n in costs.nodes))


def _opts(runtime: RuntimeDescription, m: int = 2, kind: str = "1f1b") -> SolveOptions:
    return SolveOptions(batch_size=8, num_microbatches=m, schedule_kind=kind, stages_per_rank=1,
                        runtime=runtime, time_limit_s=5)


# ---- the contract: NodeCost, CostGraph, RuntimeDescription ---------------------------------
def test_node_host_times_are_all_three_or_none(build) -> None:  # type: ignore[no-untyped-def]
    node = build.node("a", ("x",))
    assert node.host_times is None
    full = dataclasses.replace(node, host_fwd_us=1.0, host_bwd_input_us=2.0,
                               host_bwd_weight_us=0.0)
    assert full.host_times == (1.0, 2.0, 0.0)
    with pytest.raises(PlanError, match="all be >= 0 µs or all"):
        dataclasses.replace(node, host_fwd_us=1.0)
    with pytest.raises(PlanError, match="all be >= 0 µs or all"):
        dataclasses.replace(full, host_bwd_weight_us=-1.0)


def test_a_graph_has_host_times_on_every_node_or_on_none(build) -> None:  # type: ignore[no-untyped-def]
    costs = build.chain(3)
    assert not costs.has_host_times and costs.total_host_us() == 0.0
    timed = _with_host(costs, 3.0, 2.0, 1.0)
    assert timed.has_host_times and timed.total_host_us() == pytest.approx(18.0)
    with pytest.raises(PlanError, match=r"host issue times on some nodes but not on \['n2'\]"):
        dataclasses.replace(costs, nodes=(*timed.nodes[:2], costs.nodes[2]))


def test_host_times_round_trip_and_files_without_them_still_load(build) -> None:  # type: ignore[no-untyped-def]
    timed = _with_host(build.chain(3), 3.0, 2.0, 1.0)
    again = CostGraph.from_dict(json.loads(json.dumps(timed.to_dict())))
    assert again == timed
    plain = build.chain(3).to_dict()
    assert not any(k.startswith("host_") for n in plain["nodes"] for k in n)
    assert CostGraph.from_dict(plain) == build.chain(3)


def test_issue_threads_of_each_runtime() -> None:
    assert describe("local").issue_threads == 1
    assert describe("distributed").issue_threads is None
    assert [ONE_THREAD.issue_thread_of(r) for r in range(3)] == [0, 0, 0]
    assert [PER_RANK.issue_thread_of(r) for r in range(3)] == [0, 1, 2]
    assert [RuntimeDescription(issue_threads=2).issue_thread_of(r) for r in range(3)] == [0, 1, 0]
    with pytest.raises(PlanError, match="issue_threads=0 must be >= 1"):
        RuntimeDescription(issue_threads=0)


# ---- the simulator and the closed form --------------------------------------------------
def _two_stages(threads: tuple[int, ...]) -> StageCosts:
    """Device: F 10, I 10, W 10 per stage; host: F 30, I 4, W 6 per stage."""
    return StageCosts([10.0] * 2, [10.0] * 2, [10.0] * 2, [0.0] * 2, [0.0] * 2, [0] * 2,
                      [0] * 2, [0] * 2, host_fwd_us=[30.0] * 2, host_bwd_input_us=[4.0] * 2,
                      host_bwd_weight_us=[6.0] * 2, issue_thread=threads)


def test_host_bound_sums_each_threads_actions_hand_worked() -> None:
    sched = build_schedule("1f1b", 2, 3)
    # one thread: 2 stages x 3 microbatches x (F 30 + B (I 4 + W 6)) = 240
    assert host_bound_us(sched, _two_stages((0, 0))) == 240.0
    # a thread per rank: 3 x 40 = 120
    assert host_bound_us(sched, _two_stages((0, 1))) == 120.0
    assert host_bound_us(sched, _two_stages(())) == 120.0  # default: each rank its own
    # zero-bubble: I and W are separate actions, the same host time in all
    assert host_bound_us(build_schedule("zero_bubble", 2, 3), _two_stages((0, 0))) == 240.0
    no_host = dataclasses.replace(_two_stages((0, 0)), host_fwd_us=(), host_bwd_input_us=(),
                                  host_bwd_weight_us=())
    assert host_bound_us(sched, no_host) == 0.0


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zero_bubble"])
def test_one_thread_bounds_the_step_in_replay_and_closed_form(kind: str) -> None:
    sched = build_schedule(kind, 2, 3)
    shared, own = _two_stages((0, 0)), _two_stages((0, 1))
    res = simulate(sched, shared)
    # the device side alone replays in well under 240 µs: the shared thread sets the step
    assert simulate(sched, own).step_time_us < 240.0
    assert res.step_time_us == 240.0 and res.host_bound_us == 240.0
    assert closed_form_host_bound_us(kind, 2, 3, 1, shared) == 240.0
    assert closed_form_step_us(kind, 2, 3, 1, shared) == 240.0
    # a thread per rank, host times under the device's (as the solver's columns always
    # are: each action already costs its slower side): the step is the device's
    quick = dataclasses.replace(own, host_fwd_us=[5.0] * 2)
    bare = dataclasses.replace(own, host_fwd_us=(), host_bwd_input_us=(), host_bwd_weight_us=(),
                               issue_thread=())
    assert closed_form_step_us(kind, 2, 3, 1, quick) == closed_form_step_us(kind, 2, 3, 1, bare)
    assert simulate(sched, quick).step_time_us == simulate(sched, bare).step_time_us


def test_stage_costs_refuse_host_columns_of_the_wrong_length() -> None:
    with pytest.raises(PlanError, match="host_fwd_us has 1 entries"):
        dataclasses.replace(_two_stages((0, 0)), host_fwd_us=[1.0])
    with pytest.raises(PlanError, match="together or none"):
        dataclasses.replace(_two_stages((0, 0)), host_bwd_weight_us=())


# ---- the cost model and the solver, on a hand-made chain -------------------------------
def test_host_times_do_not_scale_with_the_microbatch(build) -> None:  # type: ignore[no-untyped-def]
    costs = _with_host(build.chain(4), 30.0, 5.0, 5.0)
    model = CostModel(costs, build.cluster(2), batch_size=8, training=True, state_factor=2.0)
    assert model.has_host_times
    assert model.host_part_us("fwd", 0, 4) == 120.0 and model.host_time_us(1, 3) == 80.0
    # the device side halves with the microbatch; the host side does not
    assert model.part_us("fwd", 0, 4, 0.5) == pytest.approx(20.0)
    plain = CostModel(build.chain(4), build.cluster(2), batch_size=8, training=True,
                      state_factor=2.0)
    assert not plain.has_host_times and plain.host_time_us(0, 4) == 0.0


@pytest.mark.parametrize(("runtime", "m", "step"), [
    # per rank (distributed): F = max(device 20, host 60) = 60, B = max(40, 20) = 40 per
    # stage (all in I's column); 1F1B (m - 1) x 100 + 2 x 100
    (PER_RANK, 2, 300.0), (PER_RANK, 4, 500.0),
    # one thread (local): at least every action's host time, 2 stages x m x (60 + 20)
    (ONE_THREAD, 2, 320.0), (ONE_THREAD, 4, 640.0)])
def test_each_action_costs_its_slower_side_and_one_thread_bounds_the_step(
        build, runtime: RuntimeDescription, m: int, step: float) -> None:  # type: ignore[no-untyped-def]
    # 4 nodes, cut after the second; device per node F 10, I 10, W 10 as profiled at the
    # microbatch's own size (8 / m rows), so the microbatch costs exactly that
    costs = dataclasses.replace(_with_host(build.chain(4), 30.0, 5.0, 5.0), batch_size=8 // m)
    cluster = build.cluster(2, link_bw=1e18)
    opts = dataclasses.replace(_opts(runtime, m), batch_size=8 // m * m)
    plan = plan_at(costs, cluster, opts, [2], kind="1f1b", num_microbatches=m)
    pred = predict(plan, costs, cluster, opts)
    assert list(pred.stage_costs.fwd_us) == pytest.approx([60.0, 60.0])
    assert list(pred.stage_costs.bwd_input_us) == pytest.approx([40.0, 40.0])
    assert list(pred.stage_costs.bwd_weight_us) == [0.0, 0.0]
    assert list(pred.stage_costs.host_bwd_input_us) == pytest.approx([20.0, 20.0])
    assert pred.step_time_us == pytest.approx(step)
    assert plan.predicted_step_time_us == pytest.approx(step)
    assert pred.host_bound_us == pytest.approx(m * 80.0 * (2 if runtime is ONE_THREAD else 1))
    # without host times the same plan is device-bound: F 20, B 40 -> (m - 1) x 60 + 120
    plain = dataclasses.replace(build.chain(4), batch_size=8 // m)
    assert predict(plan, plain, cluster, opts).step_time_us == pytest.approx((m + 1) * 60.0)


def test_the_solvers_plan_never_predicts_below_the_shared_threads_host_time(build) -> None:  # type: ignore[no-untyped-def]
    costs = _with_host(build.chain(12, param_bytes=400), 25.0, 4.0, 4.0)
    cluster = build.cluster(2, link_bw=1e9, latency_us=5.0)
    opts = SolveOptions(batch_size=8, runtime=ONE_THREAD, time_limit_s=5)
    plan = solve(costs, cluster, opts)
    host_step = plan.num_microbatches * costs.total_host_us()
    assert plan.predicted_step_time_us >= host_step * (1 - 1e-9)
    assert predict(plan, costs, cluster, opts).step_time_us >= host_step * (1 - 1e-9)
    assert plan.lower_bounds is not None  # every issue on the one thread: a bound too
    assert plan.lower_bounds.step_time_us == pytest.approx(host_step, abs=1e-3)
    for base in plan.baselines:
        assert base.predicted_step_time_us >= host_step * (1 - 1e-9) or not base.fits
    # host-bound, fewer microbatches issue fewer actions: the solver takes the smallest m
    assert plan.num_microbatches == 1


def test_a_split_backward_prices_i_and_w_each_at_its_slower_side(build) -> None:  # type: ignore[no-untyped-def]
    costs = _with_host(build.chain(4), 30.0, 1.0, 25.0)
    cluster = build.cluster(2, link_bw=1e18)
    opts = _opts(PER_RANK, 1, "zero_bubble")
    plan = plan_at(costs, cluster, opts, [2], kind="zero_bubble", num_microbatches=1)
    c = predict(plan, costs, cluster, opts).stage_costs
    # stage 0 (first): no I, W is its whole backward: max(device 40, host 52); stage 1: I
    # max(20, 2), W max(20, 50)
    assert list(c.bwd_input_us) == pytest.approx([0.0, 20.0])
    assert list(c.bwd_weight_us) == pytest.approx([52.0, 50.0])
    assert list(c.host_bwd_weight_us) == pytest.approx([52.0, 50.0])


@pytest.mark.parametrize("m", [2, 4])
def test_graphed_stages_are_priced_on_device_time_and_split_ones_keep_their_host_time(
        build, m: int) -> None:  # type: ignore[no-untyped-def]
    # the hand-worked case above, its stages replayed as CUDA graphs: no host column, so
    # F 20 and B 40 on the device alone and no one-thread bound: (m + 1) x 60
    costs = dataclasses.replace(_with_host(build.chain(4), 30.0, 5.0, 5.0), batch_size=8 // m)
    cluster = build.cluster(2, link_bw=1e18)
    graphs = dataclasses.replace(ONE_THREAD, cuda_graphs=True)
    opts = dataclasses.replace(_opts(graphs, m), batch_size=8 // m * m)
    plan = plan_at(costs, cluster, opts, [2], kind="1f1b", num_microbatches=m)
    pred = predict(plan, costs, cluster, opts)
    assert pred.host_bound_us == 0.0 and not pred.stage_costs.has_host
    assert pred.step_time_us == pytest.approx((m + 1) * 60.0)
    eager = predict(plan, costs, cluster, dataclasses.replace(opts, runtime=ONE_THREAD))
    assert eager.step_time_us == pytest.approx(m * 160.0)  # the one thread's host time
    # zero-bubble splits the backward, which the runtime does not graph: host times stay
    zb_opts = dataclasses.replace(opts, schedule_kind="zero_bubble")
    zb = plan_at(costs, cluster, zb_opts, [2], kind="zero_bubble", num_microbatches=m)
    assert predict(zb, costs, cluster, zb_opts).host_bound_us > 0.0
