"""The ``"op"`` recompute policy: which node outputs each recomputing stage keeps, chosen per
rank under its cap (:mod:`autopart.solver.recompute_choice`), priced and replayed."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

import pytest

from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.solver import SolveOptions, solve
from autopart.solver._candidate import evaluate
from autopart.solver._cost_model import CostModel
from autopart.solver.predict import predict
from autopart.solver.recompute_choice import choose_kept, keep_bounds, keep_items


def _chain(build: Any, n: int = 8, saved: int = 2000) -> CostGraph:
    """Alternating matmuls (40 µs) and pointwise ops (10 µs) of different output sizes, each
    saving ``saved`` bytes of its input; one view, one in-place op and one dropout that "op"
    never keeps."""
    g = build.chain(n, saved=saved, out=2000, param_bytes=40)
    ops = {3: "aten.view.default", 5: "aten.add_.Tensor", 6: "aten.dropout.default"}
    return replace(g, nodes=tuple(
        replace(nd, op=ops.get(i, "aten.linear.default" if i % 2 == 0 else "aten.gelu.default"),
                fwd_us=40.0 if i % 2 == 0 else 10.0 + i, output_bytes=1000 + 300 * i,
                saved_from=((1, saved),) if i else ())
        for i, nd in enumerate(g.nodes)))


BASE: dict[str, Any] = dict(batch_size=8, num_microbatches=8, schedule_kind="gpipe")


def _peak(plan: Plan) -> int:
    return max(r.peak_memory_bytes for r in plan.ranks)


def _caps(build: Any, g: CostGraph) -> tuple[int, int]:
    """The largest peak of the plan recomputing every stage whole, and of the one that
    recomputes nothing."""
    cluster = build.cluster(2)
    full = solve(g, cluster, SolveOptions(**BASE, recompute=True, recompute_policy="full"))
    free = solve(g, cluster, SolveOptions(**BASE, recompute=False))
    return _peak(full), _peak(free)


def test_views_in_place_ops_and_dropout_are_never_kept(build: Any) -> None:
    g = _chain(build)
    model = CostModel(g, build.cluster(1), batch_size=8, training=True, state_factor=2.0,
                      recompute_policy="op")
    cand = evaluate(model, None, "gpipe", 1, 1, 8, (), None, recompute=True)
    ops = {g.nodes[it.node].op for it in keep_items(model, cand)}
    assert ops == {"aten.linear.default", "aten.gelu.default"}


@pytest.mark.parametrize(("share", "saved"), [(0.25, 2000), (0.5, 2000), (0.75, 2000),
                                             (0.5, 700), (1.0, 700)])
def test_the_kept_set_is_the_best_that_fits(build: Any, share: float, saved: int) -> None:
    """Against every subset of the keepable nodes, evaluated exactly: the chosen set fits
    the cap, keeps no more bytes than the stage saves without recompute (binding where each
    node saves 700 bytes), and keeps the most forward time among the subsets that do both."""
    g = _chain(build, saved=saved)
    model = CostModel(g, build.cluster(1), batch_size=8, training=True, state_factor=2.0,
                      recompute_policy="op")
    cand = evaluate(model, None, "gpipe", 1, 1, 8, (), None, recompute=True).simulated()
    items = keep_items(model, cand)
    # the last linear saves only its input: torch's recomputation stops before its kernel
    # (CostModel.recompute_stop), so keeping its output would save nothing
    assert len(items) == 4 and all(it.node < 7 for it in items)
    names = [nd.name for nd in g.nodes]
    every = evaluate(model.with_kept(frozenset(names[it.node] for it in items)), None,
                     "gpipe", 1, 1, 8, (), None, recompute=True).simulated()
    caps = (int(cand.peaks[0] + share * (every.peaks[0] - cand.peaks[0])),)
    cand = replace(cand, caps=caps)
    (bound,) = keep_bounds(model, cand).values()
    plain = evaluate(model, None, "gpipe", 1, 1, 8, (), None, recompute=False)
    assert bound == plain.costs.saved_bytes[0] - cand.costs.saved_bytes[0] > 0
    binding = sum(it.nbytes for it in items) > bound
    assert binding == (saved == 700)
    best_time = 0.0
    for k in range(len(items) + 1):
        for subset in itertools.combinations(items, k):
            if sum(it.nbytes for it in subset) > bound:
                continue
            m = model.with_kept(frozenset(names[it.node] for it in subset))
            c = evaluate(m, None, "gpipe", 1, 1, 8, (), caps, recompute=True).simulated()
            if c.fits:
                best_time = max(best_time, sum(it.time_us for it in subset))
    chosen_model, chosen = choose_kept(model, cand, caps, "speed")
    assert chosen.fits
    kept = [it for it in items if names[it.node] in chosen_model.kept_nodes]
    assert sum(it.nbytes for it in kept) <= bound
    assert sum(it.time_us for it in kept) == pytest.approx(best_time)
    assert 0 < len(kept) < len(items)


def test_a_forced_recompute_never_holds_more_than_no_recompute(build: Any) -> None:
    """Every stage forced to recompute, no cap, outputs larger than what the nodes save:
    keeping every output would skip the recomputation but hold more than the stage without
    recompute. The op plan keeps some (not all) of each stage's outputs, and each stage
    holds per microbatch no more than the same cuts without recompute. (Its backward still
    holds the recomputed saved set, so the ranks' peaks are not ordered.)"""
    g = _chain(build, n=12, saved=900)
    cluster = build.cluster(2)
    op = solve(g, cluster, SolveOptions(**BASE, recompute=True, recompute_policy="op"))
    assert all(st.recompute for st in op.stages)
    cuts = tuple(c.position for c in op.cuts)
    model = CostModel(g, cluster, batch_size=8, training=True, state_factor=2.0,
                      recompute_policy="op")
    keepable = evaluate(model, None, "gpipe", 2, 1, 8, cuts, None, recompute=True)
    items = keep_items(model, keepable)
    bounds = keep_bounds(model, keepable)
    kept = frozenset(n for st in op.stages for n in st.recompute_kept)
    chosen = evaluate(model.with_kept(kept), None, "gpipe", 2, 1, 8, cuts, None,
                      recompute=True)
    plain = evaluate(model, None, "gpipe", 2, 1, 8, cuts, None, recompute=False)
    for s in range(2):
        assert sum(it.nbytes for it in items if it.stage == s) > bounds[s]
        assert chosen.costs.saved_bytes[s] <= plain.costs.saved_bytes[s]
    # the first stage's bound leaves room for some of its outputs
    mine = [it for it in items if it.stage == 0]
    assert 0 < len(op.stages[0].recompute_kept) < len(mine)
    assert keepable.costs.saved_bytes[0] < chosen.costs.saved_bytes[0]


def test_op_plans_fit_beat_whole_stage_recompute_and_replay(build: Any) -> None:
    """Under a cap that makes the full-policy plan recompute: the "op" plan fits, is no
    slower than the "full" and "selective" plans, lists what each recomputing stage keeps,
    and replays (predict, a JSON round trip) to the same figures; under "memory" it never
    raises the plan's largest peak."""
    g = _chain(build)
    full_peak, free_peak = _caps(build, g)
    cap = (full_peak + free_peak) // 2
    cluster = build.cluster(2)
    plans = {pol: solve(g, cluster, SolveOptions(**BASE, memory_cap_bytes=cap,
                                                 recompute_policy=pol))
             for pol in ("full", "selective", "op")}
    assert any(st.recompute for st in plans["full"].stages)
    op = plans["op"]
    assert op.recompute_policy == "op" and _peak(op) <= cap
    assert any(st.recompute_kept for st in op.stages)
    assert all(not st.recompute_kept for st in op.stages if not st.recompute)
    assert op.predicted_step_time_us < plans["full"].predicted_step_time_us
    assert op.predicted_step_time_us <= plans["selective"].predicted_step_time_us
    again = Plan.from_dict(json.loads(json.dumps(op.to_dict())))
    assert again == op
    replay = predict(again, g, cluster, SolveOptions(**BASE, memory_cap_bytes=cap))
    assert replay.step_time_us == pytest.approx(op.predicted_step_time_us, rel=1e-6)
    assert list(replay.peak_memory_bytes) == [r.peak_memory_bytes for r in op.ranks]
    for pol in ("full", "op"):
        plans[pol] = solve(g, cluster, SolveOptions(**BASE, memory_cap_bytes=cap,
                                                    recompute=True, optimize="memory",
                                                    recompute_policy=pol))
    assert _peak(plans["op"]) <= _peak(plans["full"])
    assert plans["op"].predicted_step_time_us <= plans["full"].predicted_step_time_us


def test_op_is_never_slower_than_full_under_the_same_cap(build: Any) -> None:
    """A chain on which the search with recomputing stages priced as "selective" keeps finds
    cuts that no kept set makes as fast as the "full" plan (314.6 against 304.3 µs): "op" also
    searches keeping nothing (the cuts "full" finds) and keeps the better plan."""
    rows = [("linear", 10.0, 1797, 2006), ("linear", 10.0, 2286, 3117),
            ("gelu", 10.0, 2608, 803), ("linear", 10.0, 3672, 3049),
            ("gelu", 10.0, 3408, 4405), ("gelu", 40.0, 745, 3969), ("gelu", 40.0, 4831, 204),
            ("gelu", 10.0, 1740, 4140), ("gelu", 80.0, 2766, 2515)]
    g = build.chain(len(rows), saved=2000, out=2000, param_bytes=40)
    # each node saves its input (the node before returned it), nothing of its own
    g = replace(g, nodes=tuple(
        replace(nd, op=f"aten.{op}.default", fwd_us=fwd, output_bytes=out, saved_bytes=saved,
                saved_from=((1, saved),) if i else ())
        for i, (nd, (op, fwd, out, saved)) in enumerate(zip(g.nodes, rows, strict=True))))
    base: dict[str, Any] = dict(batch_size=8, num_microbatches=4, schedule_kind="1f1b")
    cluster = build.cluster(2)
    low, high = (_peak(solve(g, cluster, SolveOptions(**base, recompute=r))) for r in (True, False))
    cap = (low + high) // 2
    full, op = (solve(g, cluster, SolveOptions(**base, memory_cap_bytes=cap, recompute_policy=pol))
                for pol in ("full", "op"))
    assert any(st.recompute for st in full.stages) and _peak(op) <= cap
    assert op.predicted_step_time_us < full.predicted_step_time_us


def test_kept_nodes_outside_op_or_a_recomputing_stage_are_refused(build: Any) -> None:
    g = _chain(build)
    plan = solve(g, build.cluster(2), SolveOptions(**BASE, recompute=True,
                                                   recompute_policy="op"))
    d = plan.to_dict()
    d["stages"][0]["recompute_kept"] = ["n0"]
    for change in ({"recompute_policy": "full"}, {}):
        bad = json.loads(json.dumps({**d, **change}))
        if not change:
            bad["stages"][0]["recompute"] = False
        with pytest.raises(PlanError, match="recompute_kept"):
            Plan.from_dict(bad)


def test_the_plan_table_says_what_each_stage_keeps(build: Any) -> None:
    from rich.console import Console

    from autopart.apps.report import plan_table

    g = _chain(build)
    plan = solve(g, build.cluster(2), SolveOptions(**BASE, recompute=True,
                                                   recompute_policy="op"))
    kept = [st for st in plan.stages if st.recompute_kept]
    assert kept
    console = Console(width=200, record=True)
    console.print(plan_table(plan))
    text = console.export_text()
    for st in kept:
        assert f"op: {len(st.recompute_kept)}/{st.num_nodes} kept ({st.recompute_kept[0]} 1" in text


@pytest.mark.parametrize("source", ["measured:cpu", "analytical:test"])
def test_a_choice_no_faster_than_selectives_set_by_the_tie_tolerance_keeps_that_set(
        build: Any, source: str) -> None:
    """Room for every keepable node, whose pointwise ones save 0.1 µs each: the knapsack
    keeps them all, for a step predicted well within TIE_TOLERANCE of keeping only the
    matmuls (the selective policy's set), which holds less. On measured costs that set is
    kept; analytical costs carry no timing noise, and keep the knapsack's."""
    g = _chain(build)
    g = replace(g, source=source, nodes=tuple(
        replace(nd, fwd_us=0.1) if nd.op == "aten.gelu.default" else nd for nd in g.nodes))
    model = CostModel(g, build.cluster(1), batch_size=8, training=True, state_factor=2.0,
                      recompute_policy="op")
    cand = evaluate(model, None, "gpipe", 1, 1, 8, (), None, recompute=True).simulated()
    items = keep_items(model, cand)
    names = [nd.name for nd in g.nodes]
    every = evaluate(model.with_kept(frozenset(names[it.node] for it in items)), None,
                     "gpipe", 1, 1, 8, (), None, recompute=True).simulated()
    cand = replace(cand, caps=every.peaks)
    chosen_model, chosen = choose_kept(model, cand, every.peaks, "speed")
    kept = {g.nodes[i].op for i, k in enumerate(chosen_model.kept) if k}
    linears = {"aten.linear.default"}
    assert kept == (linears if source.startswith("measured") else linears | {"aten.gelu.default"})
    assert chosen.max_peak <= every.max_peak


def test_a_stage_keeping_nothing_is_priced_as_full_and_selective_checkpointing_as_run(
        build: Any) -> None:
    """Under "op", a recomputing stage that keeps nothing runs plain checkpointing
    (``codegen.recompute.run_recomputed``): its recomputation is the whole forward, with no
    cost per node; keeping one node puts the whole stage under selective checkpointing,
    whose cost per node is then paid on every node."""
    from autopart.core.runtime_model import RuntimeDescription

    g = _chain(build)
    runtime = RuntimeDescription(selective_us_per_node=(3.0, 2.0))
    kw: dict[str, Any] = dict(batch_size=8, training=True, state_factor=2.0, runtime=runtime)
    full = CostModel(g, build.cluster(1), recompute_policy="full", **kw)
    none = CostModel(g, build.cluster(1), recompute_policy="op", **kw)
    n = len(g.nodes)
    assert not none.checkpoints_selectively(0, n)
    assert none.part_us("recompute", 0, n, 1.0) == full.part_us("recompute", 0, n, 1.0)
    assert none.recompute_fwd_extra_us(0, n) == 0.0
    one = none.with_kept(frozenset({g.nodes[2].name}))
    assert one.checkpoints_selectively(0, n) and not one.checkpoints_selectively(3, n)
    assert one.recompute_fwd_extra_us(0, n) == pytest.approx(3.0 * n)
    # the kept node's forward is not run again; every node pays 2 µs in the recomputation
    assert one.part_us("recompute", 0, n, 1.0) == pytest.approx(
        full.part_us("recompute", 0, n, 1.0) - g.nodes[2].fwd_us + 2.0 * n)


def test_keeping_is_chosen_only_where_it_beats_plain_checkpointing(build: Any) -> None:
    """Selective checkpointing's cost per node (here 30 µs in the forward and again in the
    recomputation, on each of 8 nodes) outweighs what keeping the matmuls saves (40 µs
    each): "op" keeps nothing and runs the stage as "full" does, at its step."""
    from autopart.core.runtime_model import RuntimeDescription

    g = _chain(build)
    runtime = RuntimeDescription(selective_us_per_node=(30.0, 30.0))
    kw: dict[str, Any] = dict(batch_size=8, training=True, state_factor=2.0, runtime=runtime)
    model = CostModel(g, build.cluster(1), recompute_policy="op", **kw)
    cand = evaluate(model, None, "gpipe", 1, 1, 8, (), None, recompute=True).simulated()
    chosen_model, chosen = choose_kept(model, cand, (10**12,), "speed")  # room for all
    assert not any(chosen_model.kept)
    full = CostModel(g, build.cluster(1), recompute_policy="full", **kw)
    assert chosen.step_us == pytest.approx(evaluate(
        full, None, "gpipe", 1, 1, 8, (), None, recompute=True).simulated().step_us)
