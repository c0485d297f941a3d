"""A plan's predicted trace and plans at given cuts (baselines) on hand-made costs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from autopart.core.errors import PlanError
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.schedule import build_schedule
from autopart.solver import SolveOptions, solve
from autopart.solver.predict import baseline_plan, plan_at, predict
from autopart.solver.simulate import simulate


def test_gpipe_timeline_recorded_by_the_simulator_is_hand_worked() -> None:
    from tests.solver.test_simulate import uniform

    res = simulate(build_schedule("gpipe", 2, 2), uniform(2), record=True)
    # rank 0: F0 0..10, F1 10..20, B1 50..70, B0 70..90; rank 1: F0 10..20, F1 20..30,
    # B1 30..50, B0 50..70 (see test_gpipe_two_stages_hand_worked)
    got = {(r, f"{s}{k}{i}"): (a, b) for r, s, k, i, a, b in res.timeline}
    assert got[(0, "0F0")] == (0.0, 10.0) and got[(0, "0B0")] == (70.0, 90.0)
    assert got[(1, "1F1")] == (20.0, 30.0) and got[(1, "1B1")] == (30.0, 50.0)
    assert len(res.timeline) == 8
    assert simulate(build_schedule("gpipe", 2, 2), uniform(2)).timeline == ()


@pytest.mark.parametrize(("kind", "v"), [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1),
                                         ("zbv", 2), ("dualpipev", 2)])
def test_predicted_trace_replays_the_plan(build, kind: str, v: int) -> None:  # type: ignore[no-untyped-def]
    costs = build.chain(12, param_bytes=400)
    cluster = build.cluster(2, link_bw=1e6, latency_us=5.0)
    opts = SolveOptions(batch_size=8, num_microbatches=4, schedule_kind=kind,
                        stages_per_rank=v, time_limit_s=5)
    plan = solve(costs, cluster, opts)
    pred = predict(plan, costs, cluster, opts)
    assert pred.peak_memory_bytes == tuple(r.peak_memory_bytes for r in plan.ranks)
    assert pred.step_time_us == pytest.approx(plan.predicted_step_time_us, rel=0.02)
    expected = build_schedule(kind, 2, 4, v)
    for r in range(2):
        assert pred.trace.actions(r) == [str(a) for a in expected[r]]
    sends = [e for e in pred.trace.events if e.name.startswith("send ")]
    assert sends and all(e.duration_us > 0 for e in sends)
    assert pred.trace.step_time_us == pytest.approx(pred.step_time_us)


def test_plan_at_the_solvers_cuts_costs_like_the_solver(build) -> None:  # type: ignore[no-untyped-def]
    costs = build.chain(12, param_bytes=400)
    cluster = build.cluster(2)
    opts = SolveOptions(batch_size=8, num_microbatches=4, schedule_kind="1f1b",
                        stages_per_rank=1, time_limit_s=5)
    plan = solve(costs, cluster, opts)
    again = plan_at(costs, cluster, opts, [c.position for c in plan.cuts], kind="1f1b",
                    num_microbatches=4)
    assert [c.position for c in again.cuts] == [c.position for c in plan.cuts]
    assert again.predicted_step_time_us == pytest.approx(plan.predicted_step_time_us, rel=0.02)
    assert again.solver.status == "FIXED"
    equal = baseline_plan(costs, cluster, opts, "uniform_layers", kind="1f1b",
                          num_microbatches=4)
    assert [c.position for c in equal.cuts] == [6]
    with pytest.raises(PlanError, match="give 1 ascending, distinct positions"):
        plan_at(costs, cluster, opts, [3, 6], kind="1f1b", num_microbatches=4)
    with pytest.raises(PlanError, match="choose one of"):
        baseline_plan(costs, cluster, opts, "nope", kind="1f1b", num_microbatches=4)


def test_predict_refuses_a_plan_for_other_ranks(build) -> None:  # type: ignore[no-untyped-def]
    costs = build.chain(8)
    opts = SolveOptions(batch_size=8, num_microbatches=2, time_limit_s=5)
    plan = solve(costs, build.cluster(2), opts)
    with pytest.raises(PlanError, match="the plan has 2 ranks but the cluster 4"):
        predict(plan, costs, build.cluster(4), opts)


def test_zero_bubble_charges_the_split_per_node_to_w_and_the_first_stage_runs_b_whole(
        build) -> None:  # type: ignore[no-untyped-def]
    # 8 nodes of fwd 10, I 10, W 10 µs at b0 = 8, two stages of 4 at microbatch 8 (m = 1 of
    # batch 8 is not a pipeline: batch 32, m = 4)
    costs = build.chain(8, param_bytes=400)
    cluster = build.cluster(2, link_bw=1e12)

    def stage_costs(per_node: float, kind: str = "zero_bubble") -> tuple[list[float], ...]:
        opts = SolveOptions(batch_size=32, num_microbatches=4,
                            runtime=RuntimeDescription(split_backward_us_per_node=per_node))
        plan = plan_at(costs, cluster, opts, (4,), kind=kind, num_microbatches=4)
        c = predict(plan, costs, cluster, opts).stage_costs
        return list(c.bwd_input_us), list(c.bwd_weight_us)

    # the first stage's inputs need no gradient: its I computes nothing, its W is all of B
    assert stage_costs(0.0) == ([0.0, 40.0], [80.0, 40.0])
    # 2.5 µs per node with a backward, 4 per stage, on W; the first stage's W is one whole,
    # unsplit backward and pays nothing
    assert stage_costs(2.5) == ([0.0, 40.0], [80.0, 50.0])
    # a schedule that does not split pays nothing
    assert stage_costs(2.5, "1f1b") == stage_costs(0.0, "1f1b")


def test_a_parameter_tied_across_ranks_adds_its_gradient_all_reduce_to_the_step(
        build) -> None:  # type: ignore[no-untyped-def]
    # 8 nodes; node 0 and node 7 read "tied.w" (4 MB), as GPT-2's wte and lm_head
    nodes = [build.node(f"n{i}", (f"n{i - 1}" if i else "x",),
                        params=("tied.w",) if i in (0, 7) else (),
                        param_bytes=4_000_000 if i == 0 else 0) for i in range(8)]
    costs = build.graph(nodes, inputs={"x": 100}, params={"tied.w": (4_000_000, 1_000_000)})
    cluster = build.cluster(2, link_bw=1e9, latency_us=10.0)  # 1 GB/s: 4 MB in 4000 µs

    def predicted(positions: tuple[int, ...], training: bool = True) -> tuple[float, Any]:
        opts = SolveOptions(batch_size=8, num_microbatches=4, training=training)
        plan = plan_at(costs, cluster, opts, positions, kind="1f1b" if training else "gpipe",
                       num_microbatches=4)
        pred = predict(plan, costs, cluster, opts)
        assert pred.step_time_us == pytest.approx(plan.predicted_step_time_us, rel=0.02)
        return pred.step_time_us, pred.trace

    apart, trace = predicted((4,))
    # ring all-reduce of 2 ranks: 2 (k - 1) / k x 4 MB = 4 MB, sent then received: 2 x 4010 µs
    plain = [e for e in trace.events if e.name == "reduce"]
    assert [e.rank for e in plain] == [0, 1]
    assert all(e.end_us - e.start_us == pytest.approx(8020.0) for e in plain)
    assert apart > 8020.0
    # the same graph whose last node reads nothing: no all-reduce, everything else equal
    one_rank = build.graph(nodes[:7] + [build.node("n7", ("n6",))], inputs={"x": 100},
                           params={"tied.w": (4_000_000, 1_000_000)})
    opts = SolveOptions(batch_size=8, num_microbatches=4)
    alone = plan_at(one_rank, cluster, opts, (4,), kind="1f1b", num_microbatches=4)
    assert apart - alone.predicted_step_time_us == pytest.approx(8020.0, rel=0.01)
    assert predicted((4,), training=False)[1].events[-1].name != "reduce"  # inference: none


def test_zero_bubbles_w_holds_one_nodes_working_set_but_autoparts_first_stage_more(
        build) -> None:  # type: ignore[no-untyped-def]
    # 8 nodes, each reading its own 400-byte weight; two stages of 4, m = 4 of batch 32
    costs = build.chain(8, param_bytes=400)
    cluster = build.cluster(2, link_bw=1e12)

    def stage_costs(torch_stages: bool) -> Any:
        opts = SolveOptions(batch_size=32, num_microbatches=4,
                            runtime=RuntimeDescription(receive_buffers_per_microbatch=torch_stages))
        plan = plan_at(costs, cluster, opts, (4,), kind="zero_bubble", num_microbatches=4)
        return predict(plan, costs, cluster, opts).stage_costs

    # a node's backward working set at 4 x 8 rows: its 100-byte output scaled x 4, or its
    # weight's new 400-byte gradient (these nodes' gradients are 0 bytes); the first stage's
    # I computes nothing and has none
    local, dist = stage_costs(False), stage_costs(True)
    assert list(local.backward_extra_bytes) == list(dist.backward_extra_bytes) == [0, 400]
    # a W adds each weight's gradient before the next one's: one node's working set; but
    # autopart's W on the first stage is its whole backward in one call, which returns the
    # 4 gradients together while each node's backward frees its 50 saved bytes: at node 0,
    # its 400 beside the 3 later gradients less the 3 x 50 bytes freed
    assert list(local.weight_grad_bytes) == [400 + 3 * 400 - 3 * 50, 400]
    assert list(dist.weight_grad_bytes) == [400, 400]


def test_the_runtimes_cost_per_transfer_is_added_to_the_f_b_and_i_that_post_it(
        build) -> None:  # type: ignore[no-untyped-def]
    # as test_zero_bubble_charges_the_split_per_node...: two stages of 4 nodes, fwd 10, I 10,
    # W 10 µs per node at microbatch 8
    costs = build.chain(8, param_bytes=400)
    cluster = build.cluster(2, link_bw=1e12)

    def predicted(kind: str, overhead: float) -> Any:
        opts = SolveOptions(batch_size=32, num_microbatches=4,
                            runtime=RuntimeDescription(transfer_overhead_us=overhead))
        return predict(plan_at(costs, cluster, opts, (4,), kind=kind, num_microbatches=4),
                       costs, cluster, opts)

    c = predicted("1f1b", 3.0).stage_costs
    # two stages: each F and B has one transfer (F0 sends, F1 receives; B1 sends, B0
    # receives), the whole B (its I + W columns) pays in the I column
    assert (list(c.fwd_us), list(c.bwd_input_us), list(c.bwd_weight_us)) == (
        [43.0, 43.0], [43.0, 43.0], [40.0, 40.0])
    c = predicted("zero_bubble", 3.0).stage_costs
    # split: I pays it (the first stage's empty I too: torch runs it as an action), W does
    # not (it neither sends nor receives)
    assert (list(c.bwd_input_us), list(c.bwd_weight_us)) == ([3.0, 43.0], [80.0, 40.0])
    # 1F1B, 2 ranks, m = 4: every rank's timeline has 8 actions and the critical path runs
    # through 10 of them (the warm-up F and the cool-down B of the other stage)
    slower = predicted("1f1b", 3.0).step_time_us - predicted("1f1b", 0.0).step_time_us
    assert 8 * 3.0 <= slower <= 10 * 3.0 + 1e-6
    # three stages on three ranks: the middle one's F receives and sends, and so does its B
    opts = SolveOptions(batch_size=32, num_microbatches=4,
                        runtime=RuntimeDescription(transfer_overhead_us=3.0))
    three = predict(plan_at(costs, build.cluster(3, link_bw=1e12), opts, (3, 6), kind="1f1b",
                            num_microbatches=4), costs, build.cluster(3, link_bw=1e12),
                    opts).stage_costs
    assert list(three.fwd_us) == [33.0, 36.0, 23.0]
    assert list(three.bwd_input_us) == [33.0, 36.0, 23.0]


def test_a_stage_holds_its_unsaved_outputs_and_not_the_inputs_it_saves_from_torchs_buffers(
        build) -> None:  # type: ignore[no-untyped-def]
    # x -> a -> b -> c -> d, cut at 2. a saves the graph input x (distance 1: before node 0);
    # b saves a (distance 1); c is the first to save b, which stage 0 returned (distance
    # 1); d saves its own output (distance 0) and c's. b crosses the cut and nothing in
    # stage 0 saves it; b's output is also strided (sent as a dense copy, copied back).
    def node(name: str, inp: str, saved_from: tuple[tuple[int, int], ...], extra: int = 0,
             strided: int = 0) -> Any:
        base = build.node(name, (inp,), out=100, saved=sum(b for _, b in saved_from) + extra)
        return dataclasses.replace(base, saved_from=saved_from, strided_output_bytes=strided)

    nodes = [node("a", "x", ((1, 100),)), node("b", "a", ((1, 100),), strided=60),
             node("c", "b", ((1, 100),), extra=30), node("d", "c", ((0, 100), (1, 100)))]
    costs = build.graph(nodes, inputs={"x": 100})
    cluster = build.cluster(2, link_bw=1e12)

    def saved(torch_stages: bool, graph: Any = costs) -> list[int]:
        opts = SolveOptions(batch_size=8, num_microbatches=1,
                            runtime=RuntimeDescription(receive_buffers_per_microbatch=torch_stages))
        plan = plan_at(graph, cluster, opts, (2,), kind="1f1b", num_microbatches=1)
        return list(predict(plan, graph, cluster, opts).stage_costs.saved_bytes)

    # torch's stages: stage 0 holds a's save (100; x, which a saved, is the caller's
    # microbatch) and b (100: kept to send and to start its backward from), its strided part
    # (60) as the dense copy it sent in place of the view; stage 1 saved b in its receive
    # buffer (static, not here): c's own 30, c's and d's outputs (200), and the copy of b's
    # strided part laid out as captured (60). The last stage's output d is saved already
    assert saved(True) == [200, 290]
    # the local runtime hands b on as it is: stage 1's save of it stays counted there, and
    # so does stage 0's of x
    assert saved(False) == [300, 330]
    # a profile without saved_from (from before it): saved bytes, plus the last stage's
    # outputs from its forward to its backward
    old = build.graph([dataclasses.replace(nd, saved_from=None, strided_output_bytes=0)
                       for nd in nodes], inputs={"x": 100})
    assert saved(True, old) == [200, 330 + 100]
    with pytest.raises(PlanError, match="saved_from"):
        dataclasses.replace(nodes[0], saved_from=((1, 500),))


def test_torchs_stages_hold_gradients_only_for_outputs_that_carry_one_and_free_as_they_go(
        build) -> None:  # type: ignore[no-untyped-def]
    # mask (from nothing: no gradient) and a (reads the trainable w0) feed b; the cut at 3
    # sends b and the mask. b keeps 200 bytes of its own; a's backward needs 400 + its
    # weight's gradient 10. Stage 1: c reads b, the mask and w1; d reads c
    def node(name: str, inputs: tuple[str, ...], *, saved: int = 0, transient: int = 0,
             params: tuple[str, ...] = (), out: int = 100) -> Any:
        base = build.node(name, inputs, out=out, saved=saved, params=params)
        return dataclasses.replace(base, saved_from=(), transient_bytes=transient)

    nodes = [node("mask", (), out=50), node("a", ("x",), transient=400, params=("w0",)),
             node("b", ("a", "mask"), saved=200, transient=100),
             node("c", ("b", "mask"), saved=100, transient=100, params=("w1",)),
             node("d", ("c",), saved=100, transient=100)]
    costs = build.graph(nodes, params={"w0": (10, 2), "w1": (10, 2)})
    cluster = build.cluster(2, link_bw=1e12)
    opts = SolveOptions(batch_size=8, num_microbatches=1,
                        runtime=RuntimeDescription(receive_buffers_per_microbatch=True))
    plan = plan_at(costs, cluster, opts, (3,), kind="1f1b", num_microbatches=1)
    pred = predict(plan, costs, cluster, opts)
    c = pred.stage_costs
    # stage 0 holds b's own 200, b and the mask (sent, 150) from F to B
    assert c.saved_bytes[0] == 350
    # static: w0's state (10 x 4, AdamW), the microbatch x (100) and one output-gradient
    # buffer, for b only (100): the mask sends no gradient back
    assert c.static_bytes[0] == 40 + 100 + 100
    # its backward: b's 100 first; a's 410 comes once b's 200 are freed (210)
    assert c.backward_extra_bytes[0] == 210
    # what it sent stays until the step ends, held already when its B starts
    assert (c.kept_bytes[0], c.kept_held_bytes[0]) == (150, 150)
    assert pred.peak_memory_bytes[0] == 240 + 350 + 210
    # stage 1 keeps the input gradient it sent: b's (100), none for the mask
    assert (c.kept_bytes[1], c.kept_held_bytes[1]) == (100, 0)
    # a split backward's stage sends copies of its outputs: none of it was held before
    split = predict(plan_at(costs, cluster, opts, (3,), kind="zero_bubble", num_microbatches=1),
                    costs, cluster, opts).stage_costs
    assert (split.kept_bytes[0], split.kept_held_bytes[0]) == (150, 0)


def test_torchs_last_stage_recomputes_after_the_loss_has_freed_what_it_saved(
        build) -> None:  # type: ignore[no-untyped-def]
    # a -> b -> c, cut at 1 and at 2 (3 ranks); c is the last node, its saved 500 bytes
    # include the loss's 200 (folded in by the profiler) and its working set is 900 (the
    # loss's); b saves 300 and needs 100. Parameters w0..w2 of 10 bytes each
    def node(name: str, inputs: tuple[str, ...], saved: int, transient: int, w: str) -> Any:
        base = build.node(name, inputs, out=100, saved=saved, params=(w,))
        return dataclasses.replace(base, saved_from=(), transient_bytes=transient)

    nodes = [node("a", ("x",), 300, 100, "w0"), node("b", ("a",), 300, 100, "w1"),
             node("c", ("b",), 500, 900, "w2")]
    costs = dataclasses.replace(
        build.graph(nodes, params={f"w{i}": (10, 2) for i in range(3)}), loss_saved_bytes=200)
    cluster = build.cluster(3, link_bw=1e12)
    opts = SolveOptions(batch_size=8, num_microbatches=1,
                        runtime=RuntimeDescription(receive_buffers_per_microbatch=True))

    def extra(recompute: list[bool]) -> list[int]:
        plan = plan_at(costs, cluster, opts, (1, 2), kind="1f1b", num_microbatches=1,
                       recompute=recompute)
        return list(predict(plan, costs, cluster, opts).stage_costs.backward_extra_bytes)

    plain, again = extra([False] * 3), extra([True] * 3)
    # recomputing, a middle stage holds its recomputed saved set (300) beside the larger of
    # its backward's working set (100 + its weight's new gradient, 10) and the recomputation's
    # (b's output gradient, 100, live from the backward that unpacks first; no node before b
    # runs again)
    assert again[1] == 300 + max(110, 100 + 0)
    # the last stage recomputes what it saved less the loss's set (500 - 200) only after the
    # loss's backward freed that set: 910 + 300 - 200, not 910 + 300
    assert again[2] == 910 + 300 - 200
    # the loss's set larger than the rest: the recomputation adds nothing over the working set
    big_loss = dataclasses.replace(costs, loss_saved_bytes=450)
    plan = plan_at(big_loss, cluster, opts, (1, 2), kind="1f1b", num_microbatches=1,
                   recompute=[True] * 3)
    assert predict(plan, big_loss, cluster, opts).stage_costs.backward_extra_bytes[2] == 910
    # without recompute nothing moved: the working set, nothing freed before it
    assert plain[2] == 910


def test_a_recomputing_stage_is_credited_what_its_backward_freed_before_its_largest_need(
        build) -> None:  # type: ignore[no-untyped-def]
    # a -> b | c (cut at 2, 2 ranks). a is an embedding: it saves nothing, and its backward
    # makes the table's dense gradient (working set 900 + its weight's new gradient, 10) last
    # of all; b saves 300 of its own and needs 100 (+ 10). Recomputing, the first stage
    # rebuilds b's 300, and b's backward frees them before a's runs
    def node(name: str, inputs: tuple[str, ...], saved: int, transient: int, w: str,
             out: int = 100) -> Any:
        base = build.node(name, inputs, out=out, saved=saved, params=(w,))
        return dataclasses.replace(base, saved_from=(), transient_bytes=transient)

    def first_stage_extra(a_need: int, b_out: int) -> int:
        nodes = [node("a", ("x",), 0, a_need, "w0"), node("b", ("a",), 300, 100, "w1", b_out),
                 node("c", ("b",), 100, 100, "w2")]
        costs = build.graph(nodes, params={f"w{i}": (10, 2) for i in range(3)})
        cluster = build.cluster(2, link_bw=1e12)
        opts = SolveOptions(batch_size=8, num_microbatches=1,
                            runtime=RuntimeDescription(receive_buffers_per_microbatch=True))
        plan = plan_at(costs, cluster, opts, (2,), kind="1f1b", num_microbatches=1,
                       recompute=[True, False])
        return predict(plan, costs, cluster, opts).stage_costs.backward_extra_bytes[0]

    # the backward's walk: b's 110 with the 300 held, then a's 910 with b's 300 freed:
    # 300 + max(110, 910 - 300), where the whole working set beside the whole recomputed set
    # (300 + 910) would count a's gradient over the saved set b has already let go
    assert first_stage_extra(900, 100) == 300 + 610
    # the recomputation's own: b's output gradient (500, live from b's backward, which
    # unpacks first) beside a's output being run again (100) outweighs the walk
    # (500 at b; 210 - 300 at a)
    assert first_stage_extra(200, 500) == 300 + 500 + 100


def test_a_checkpointed_forward_holds_what_the_runtime_says_until_its_backward(
        build) -> None:  # type: ignore[no-untyped-def]
    # on CPU ranks torch.utils.checkpoint keeps the generator's state (5056 bytes) from each
    # recomputing stage's forward to its backward; the profiler sets it, 0 elsewhere
    costs = build.chain(4, saved=100, out=100, param_bytes=40)
    cluster = build.cluster(2, link_bw=1e12)

    def saved(held: int, recompute: list[bool]) -> list[int]:
        opts = SolveOptions(batch_size=8, num_microbatches=2, runtime=RuntimeDescription(
            receive_buffers_per_microbatch=True, checkpoint_held_bytes=held))
        plan = plan_at(costs, cluster, opts, (2,), kind="1f1b", num_microbatches=2,
                       recompute=recompute)
        return list(predict(plan, costs, cluster, opts).stage_costs.saved_bytes)

    rc = [True, False]
    assert [a - b for a, b in zip(saved(5056, rc), saved(0, rc), strict=True)] == [5056, 0]
    assert saved(5056, [False, False]) == saved(0, [False, False])
    with pytest.raises(PlanError, match="checkpoint_held_bytes"):
        RuntimeDescription(checkpoint_held_bytes=-1)


def test_a_recomputation_stops_at_the_stages_last_saved_tensor(
        build) -> None:  # type: ignore[no-untyped-def]
    # a -> b -> c -> d, one stage: b saves its input, c saves nothing, d (an LM head) saves
    # only its input. torch's checkpoint stops once the last saved tensor is packed, before
    # d's kernel: a, b and c run again (10 + 20 + 30 µs; c makes d's input), d not
    from autopart.solver._cost_model import CostModel

    def node(name: str, inputs: tuple[str, ...], fwd: float, saved: int,
             saved_from: tuple[tuple[int, int], ...] | None) -> Any:
        return dataclasses.replace(build.node(name, inputs, fwd=fwd, out=100, saved=saved),
                                   saved_from=saved_from)

    def again(d_saves: tuple[tuple[int, int], ...] | None) -> tuple[int, float]:
        nodes = [node("a", ("x",), 10.0, 0, ()), node("b", ("a",), 20.0, 100, ((1, 100),)),
                 node("c", ("b",), 30.0, 0, ()), node("d", ("c",), 40.0, 100, d_saves)]
        model = CostModel(build.graph(nodes), build.cluster(1), batch_size=8, training=True,
                          state_factor=2.0)
        stop = model.recompute_stop(0, 4)
        return stop, model.part_us("recompute", 0, stop, 1.0)

    assert again(((1, 100),)) == (3, 60.0)  # up to d, without d's kernel
    # d saving its own output (a tanh's) or a profile that does not say: d runs again
    assert again(((0, 100),)) == (4, 100.0)
    assert again(None) == (4, 100.0)


def test_the_split_cost_per_node_is_read_off_the_points_measured_at_several_microbatches(
        build) -> None:  # type: ignore[no-untyped-def]
    # the test_zero_bubble chain: 8 nodes of fwd 10, I 10, W 10 µs at b0 = 8 (batch 32)
    costs = build.chain(8, param_bytes=400)
    cluster = build.cluster(2, link_bw=1e12)
    points = ((2, 1.0), (8, 4.0))  # µs per node at 2 and at 8 rows: 0.5 more per row

    def second_w(m: int, **split: object) -> float:
        opts = SolveOptions(batch_size=32, num_microbatches=m,
                            runtime=RuntimeDescription(**split))  # type: ignore[arg-type]
        plan = plan_at(costs, cluster, opts, (4,), kind="zero_bubble", num_microbatches=m)
        return predict(plan, costs, cluster, opts).stage_costs.bwd_weight_us[1]

    plain = {m: second_w(m) for m in (2, 4, 8, 16)}
    # 4 nodes with a backward on the second stage; rows 32 / m: 16 (beyond the last point,
    # its piece extended), 8, 4 (between), 2
    for m, per_node in ((2, 8.0), (4, 4.0), (8, 2.0), (16, 1.0)):
        assert second_w(m, split_backward_points=points) == pytest.approx(
            plain[m] + 4 * per_node)
    # the points replace the single figure
    assert second_w(4, split_backward_points=points, split_backward_us_per_node=100.0) == \
        pytest.approx(plain[4] + 16.0)
    # one point: its cost at every size; never below 0 (a falling line extended)
    assert second_w(16, split_backward_points=((4, 3.0),)) == pytest.approx(plain[16] + 12.0)
    assert second_w(16, split_backward_points=((4, 3.0), (8, 1.0))) == pytest.approx(
        plain[16] + 4 * 4.0)
    assert second_w(2, split_backward_points=((4, 3.0), (8, 1.0))) == pytest.approx(plain[2])


def test_a_transfer_on_shared_cores_pays_the_wait_measured_after_its_actions_work(
        build) -> None:  # type: ignore[no-untyped-def]
    # the same 2-stage plan as above: F and B of each stage compute 40 µs (the B's I column
    # 40 µs as one whole backward) and have one transfer each
    costs = build.chain(8, param_bytes=400)
    cluster = build.cluster(2, link_bw=1e12)

    def stage_costs(runtime: RuntimeDescription) -> Any:
        opts = SolveOptions(batch_size=32, num_microbatches=4, runtime=runtime)
        return predict(plan_at(costs, cluster, opts, (4,), kind="1f1b", num_microbatches=4),
                       costs, cluster, opts).stage_costs

    # the wait read at 40 µs of work on the line (0, 2) - (80, 10): 6 µs, above the 3 µs
    c = stage_costs(RuntimeDescription(transfer_overhead_us=3.0,
                                       transfer_wait_points=((0.0, 2.0), (80.0, 10.0))))
    assert list(c.fwd_us) == [46.0, 46.0] and list(c.bwd_input_us) == [46.0, 46.0]
    # below the per-transfer cost, the per-transfer cost stands
    c = stage_costs(RuntimeDescription(transfer_overhead_us=3.0,
                                       transfer_wait_points=((0.0, 1.0),)))
    assert list(c.fwd_us) == [43.0, 43.0]


def test_the_tied_all_reduce_is_exposed_communication_of_the_ranks_holding_it(
        build) -> None:  # type: ignore[no-untyped-def]
    # node 0 and node 7 read "tied.w" (4 MB); three ranks: ranks 0 and 2 hold it and sum its
    # gradient (2 x 4010 µs at 1 GB/s), rank 1 holds none: its step ends with theirs
    # ("reduce") but it waits on no collective
    from autopart.core.trace import Trace
    from autopart.solver.predict import tied_ranks

    nodes = [build.node(f"n{i}", (f"n{i - 1}" if i else "x",),
                        params=("tied.w",) if i in (0, 7) else (),
                        param_bytes=4_000_000 if i == 0 else 0) for i in range(8)]
    costs = build.graph(nodes, inputs={"x": 100}, params={"tied.w": (4_000_000, 1_000_000)})
    cluster = build.cluster(3, link_bw=1e9, latency_us=10.0)
    opts = SolveOptions(batch_size=8, num_microbatches=4)
    plan = plan_at(costs, cluster, opts, (3, 5), kind="1f1b", num_microbatches=4)
    assert tied_ranks(plan, costs) == {0, 2}
    trace = predict(plan, costs, cluster, opts).trace
    assert sorted(e.rank for e in trace.events if e.name == "reduce") == [0, 1, 2]
    exposed = {r: trace.exposed_comm_us(r) for r in range(3)}
    # each waits in it from its own last action (and send): the last to finish for the sum
    # alone, the other also for that one to arrive (as a measured trace times it)
    last = {r: max(e.end_us for e in trace.events if e.rank == r
                   and (e.action or e.kind == "send")) for r in range(3)}
    skew = max(last.values()) - last[2]
    assert last[0] >= last[2] and skew > 0
    assert exposed == pytest.approx({0: 8020.0, 1: 0.0, 2: 8020.0 + skew})
    assert {r: trace.comm_us(r) for r in range(3)} == pytest.approx(exposed)
    back = Trace.from_chrome(trace.to_chrome())  # the comm lane survives the JSON
    assert {r: back.exposed_comm_us(r) for r in range(3)} == pytest.approx(exposed)
    assert {r: back.comm_us(r) for r in range(3)} == pytest.approx(exposed)
