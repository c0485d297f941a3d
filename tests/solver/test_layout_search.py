"""The (tp, pp, dp, ZeRO) search: against brute force, its bounds, memory per GPU, errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autopart.core.cluster import Cluster, DeviceSpec
from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.topology import HostTopology
from autopart.solver import SolveOptions, solve
from autopart.solver.collectives import all_gather_us, reduce_scatter_us
from autopart.solver.layout_dp import dp_step_us
from autopart.solver.layout_dp import layer_units as units_of
from autopart.solver.layout_search import (
    LayoutOptions,
    dp_exposed_us,
    evaluate_layout,
    layout_candidates,
    solve_layout,
)

MM = "aten.addmm.default"
DEV = DeviceSpec("test-gpu", 10**9, 1e12, 1e12, 1e9, 2.0, "made up for tests", op_overhead_us=2.0)
TOPO = HostTopology("test-host", 4, 8e9, 1e9, 1.0, 4.0, 1.0, "made up for tests")


def _gpt(layers: int, *, width: int = 4000, scale: float = 1.0) -> CostGraph:
    """``layers`` blocks of ln -> qkv -> attention -> proj -> residual add, then a head."""
    nodes: list[NodeCost] = []
    sizes: dict[str, tuple[int, int]] = {}
    prev = "x"

    def add(name: str, op: str, module: str, inputs: tuple[str, ...], fwd: float, out: int,
            saved: int, params: tuple[tuple[str, int], ...] = ()) -> None:
        for p, b in params:
            sizes[p] = (b, b // 2)
        nodes.append(NodeCost(name=name, op=op, module_path=module, fwd_us=fwd * scale,
                              bwd_input_us=fwd * scale, bwd_weight_us=fwd * scale if params
                              else 0.0, flops=int(fwd * 1e6), bytes_accessed=out,
                              output_bytes=out, saved_bytes=saved,
                              param_bytes=sum(b for _, b in params), inputs=inputs,
                              params=tuple(p for p, _ in params)))

    for i in range(layers):
        b = f"h.{i}"
        add(f"ln{i}", "aten.layer_norm.default", f"{b}.ln", (prev,), 6, width, width,
            ((f"{b}.ln.w", 64),))
        add(f"qkv{i}", MM, f"{b}.attn.qkv", (f"ln{i}",), 82, 3 * width, width,
            ((f"{b}.attn.qkv.w", 24_000), (f"{b}.attn.qkv.b", 64)))
        add(f"sdpa{i}", "aten.scaled_dot_product_attention.default", f"{b}.attn",
            (f"qkv{i}",), 42, width, 4 * width)
        add(f"proj{i}", MM, f"{b}.attn.proj", (f"sdpa{i}",), 34, width, width,
            ((f"{b}.attn.proj.w", 8_000), (f"{b}.attn.proj.b", 64)))
        add(f"res{i}", "aten.add.Tensor", b, (f"proj{i}", prev), 4, width, 0)
        prev = f"res{i}"
    add("head", "aten.linear.default", "head", (prev,), 122, 2 * width, width,
        (("head.w", 32_000),))
    return CostGraph(nodes=tuple(nodes), graph_inputs={"x": width}, graph_outputs=("head",),
                     param_sizes={k: v[0] for k, v in sizes.items()},
                     param_numel={k: v[1] for k, v in sizes.items()},
                     trainable=frozenset(sizes), source="analytical:test",
                     bwd_source="estimated", batch_size=1, fingerprint=f"gpt{layers}")


def _options(batch: int = 16, **kw: object) -> SolveOptions:
    return SolveOptions(batch_size=batch, max_cpsat_solves=0, max_simulated=1,
                        deterministic_time=0.2, **kw)  # type: ignore[arg-type]


def _layout(n: int = 8, **kw: object) -> LayoutOptions:
    return LayoutOptions(num_gpus=n, topology=TOPO, num_heads=4, **kw)  # type: ignore[arg-type]


def _json(plan: object) -> str:
    d = plan.to_dict()  # type: ignore[attr-defined]
    d["solver"]["wall_s"] = 0.0
    return json.dumps(d, sort_keys=True)


def test_search_matches_brute_force_and_its_bounds_hold() -> None:
    costs, options, layout = _gpt(4), _options(), _layout()
    cands = layout_candidates(costs, DEV, options, layout)
    assert {(c.tp, c.pp, c.dp) for c in cands} == {
        (tp, pp, 8 // (tp * pp)) for tp in (1, 2, 4) for pp in (1, 2, 4, 8) if 8 % (tp * pp) == 0}
    brute = {}
    for c in cands:
        try:
            plan = evaluate_layout(costs, DEV, options, layout, c)
        except InfeasiblePlanError:
            continue
        # no plan of a layout is faster than its bound, nor holds less than its state bound
        assert c.step_lb_us <= plan.predicted_step_time_us + 1e-6, c
        assert c.state_lb_bytes <= max(r.peak_memory_bytes for r in plan.ranks), c
        brute[(c.tp, c.pp, c.dp, c.zero_stage)] = plan.predicted_step_time_us
    best = solve_layout(costs, DEV, options, layout)
    assert best.predicted_step_time_us <= min(brute.values()) + 1e-6
    assert best.solver.bound <= best.predicted_step_time_us
    assert best.tp * len(best.ranks) * best.dp == 8
    assert best.solver.name.startswith("layout-search+")


@pytest.mark.parametrize("optimize", ["speed", "memory"])
def test_search_is_deterministic(optimize: str) -> None:
    costs, layout = _gpt(3), _layout()
    one = solve_layout(costs, DEV, _options(optimize=optimize), layout)
    two = solve_layout(costs, DEV, _options(optimize=optimize), layout)
    assert _json(one) == _json(two)


def test_tp_one_dp_one_gives_the_pipeline_solvers_plan() -> None:
    costs, options = _gpt(3), _options()
    topo = HostTopology("one", 1, DEV.link_bandwidth_bytes_per_s,
                        DEV.link_bandwidth_bytes_per_s, DEV.link_latency_us,
                        DEV.link_latency_us, 1.0, "one GPU per host")
    plan3d = solve_layout(costs, DEV, options, LayoutOptions(num_gpus=4, topology=topo, tp=1,
                                                             dp=1))
    plain = solve(costs, Cluster.uniform(DEV, [f"cuda:{r}" for r in range(4)]), options)
    assert (plan3d.tp, plan3d.dp, plan3d.zero_stage, plan3d.sharded_parameters) == (1, 1, 0, ())
    assert plan3d.cuts == plain.cuts and plan3d.stages == plain.stages
    assert plan3d.num_microbatches == plain.num_microbatches
    assert plan3d.schedule_kind == plain.schedule_kind
    assert plan3d.predicted_step_time_us == plain.predicted_step_time_us
    assert plan3d.ranks == plain.ranks


def test_memory_per_gpu_under_each_zero_stage_is_the_hand_count() -> None:
    costs = _gpt(2)
    trainable = sum(costs.param_sizes.values())  # 2 x (64 + 24064 + 8064) + 32000 = 96384
    assert trainable == 96_384
    options = _options(num_microbatches=1, schedule_kind="1f1b", recompute=False)
    peaks, units = {}, {}
    for zero, layer_units in ((0, True), (1, False), (2, False), (3, False), (1, True),
                              (2, True), (3, True)):
        layout = _layout(4, tp=1, pp=1, dp=4, zero_stage=zero, zero_layer_units=layer_units)
        cand = layout_candidates(costs, DEV, options, layout)[0]
        plan = evaluate_layout(costs, DEV, options, layout, cand)
        (units if layer_units and zero else peaks)[zero] = plan.ranks[0].peak_memory_bytes
        assert plan.zero_layer_units == (layer_units and zero >= 1)
    # AdamW (2x state), dp = 4, held at the step's peak per parameter byte (one stage, one
    # FSDP unit): ZeRO-0 1 + 1 + 2 = 4; ZeRO-1 shards (1 + 2) / 4 + gathered 1 + unsharded
    # gradients 1 + one kept collective buffer 1 = 3.75; ZeRO-2 and -3 the sharded gradients
    # 1 / 4 too and two kept buffers: 1 + 3 + 1 = 5
    assert peaks[0] - peaks[1] == trainable * (4 - 3.75)
    assert peaks[2] - peaks[0] == peaks[3] - peaks[0] == trainable * (5 - 4)
    # one unit per layer (h.0, h.1: 32,192 bytes each) and the root (head.w, 32,000): shards
    # (1 + 1 + 2) / 4 = 1 x, then ZeRO-3 2 R + 3 L + 2 max(R, L), ZeRO-2 the stage again +
    # R + L + 2 max(R, L), ZeRO-1 the stage and its gradients + 2 max(R, L)
    root, layer = 32_000, 32_192
    assert units[1] - peaks[0] == trainable * (3 - 4) + 2 * layer
    assert units[3] - peaks[0] == trainable * (1 - 4) + 2 * root + 5 * layer
    assert units[2] - peaks[0] == trainable * (2 - 4) + root + 3 * layer
    # with a third layer the whole-stage gather holds 4 x (R + 3 L) where units hold
    # 2 R + 5 L
    costs3 = _gpt(3)
    by_units = {}
    for layer_units in (False, True):
        layout = _layout(4, tp=1, pp=1, dp=4, zero_stage=3, zero_layer_units=layer_units)
        cand = layout_candidates(costs3, DEV, options, layout)[0]
        by_units[layer_units] = evaluate_layout(costs3, DEV, options, layout,
                                                cand).ranks[0].peak_memory_bytes
    assert by_units[False] - by_units[True] == 2 * root + 7 * layer


def test_a_fixed_pp2_dp2_plan_holds_the_hand_counted_state_per_rank() -> None:
    # _gpt(2) cut at 5 (after block 0's residual add): rank 0 holds block 0's parameters
    # (64 + 24,064 + 8,064 = 32,192 bytes), rank 1 block 1's and the head's (64,192)
    costs = _gpt(2)
    options = _options(batch=8, num_microbatches=2, schedule_kind="1f1b", recompute=False)
    held = (32_192, 64_192)
    peaks, steps = {}, {}
    # "3 units" serialized, as CPU ranks run them; "3 units overlapped" as GPUs do
    serialized = replace(options, runtime=RuntimeDescription(collectives_share_compute=True))
    for zero in (0, 1, 2, 3, "3 units", "3 units overlapped"):
        units = isinstance(zero, str)
        layout = _layout(4, tp=1, pp=2, dp=2, zero_stage=3 if units else zero,
                         zero_layer_units=units)
        opts = serialized if zero == "3 units" else options
        cand = next(c for c in layout_candidates(costs, DEV, opts, layout) if c.pp == 2)
        plan = evaluate_layout(costs, DEV, opts, layout, cand, positions=(5,))
        assert [c.position for c in plan.cuts] == [5] and plan.num_microbatches == 2
        assert [sum(plan.stages[s].param_bytes for s in r.stage_indices)
                for r in plan.ranks] == list(held)
        peaks[zero] = [r.peak_memory_bytes for r in plan.ranks]
        steps[zero] = plan.predicted_step_time_us
    # the activations are the same under every ZeRO stage: the peaks differ by the state,
    # 4.5x (ZeRO-1) and 6x (ZeRO 2-3) against ZeRO-0's 4x at dp = 2
    for r in (0, 1):
        assert peaks[1][r] - peaks[0][r] == held[r] // 2
        assert peaks[2][r] - peaks[0][r] == peaks[3][r] - peaks[0][r] == 2 * held[r]
    # per-layer units: shards 2x, then 2 R + 3 L + 2 max(R, L) (rank 0: one layer, no root;
    # rank 1: one layer and the head)
    assert peaks["3 units"][0] - peaks[0][0] == -2 * held[0] + 5 * 32_192
    assert peaks["3 units"][1] - peaks[0][1] == -2 * held[1] + 2 * 32_000 + 5 * 32_192
    # rank 1 runs two units (h.1 and the head): each of its two all-gathers and its
    # reduce-scatter per microbatch (m = 2) pays one more ring step (dp = 2)
    assert steps["3 units"] == pytest.approx(steps[3] + 2 * 3 * TOPO.link(2)[1], abs=2e-3)
    # overlapped with each layer's compute (tests/solver/test_zero_layer_overlap.py): less
    assert steps["3 units overlapped"] < steps["3 units"]
    # the dp collectives on the dp link: ZeRO-1 one all-gather and one reduce-scatter per
    # step, after the schedule, the fuller rank's (64,192 bytes); ZeRO-2 one of each in every
    # microbatch's forward and backward, ZeRO-3 a second all-gather in the backward, which
    # 1F1B's step ((m - 1) x the slowest stage + every stage once; stage 1, with the head,
    # is the slowest with or without them) pays (m - 1) + 1 = 2 times on stage 1, once on
    # stage 0
    bw, lat = TOPO.link(2)
    gather = [all_gather_us(h, 2, bw, lat) for h in held]
    scatter = [reduce_scatter_us(h, 2, bw, lat) for h in held]
    zero1 = gather[1] + scatter[1]
    zero2 = 2 * (gather[1] + scatter[1]) + gather[0] + scatter[0]
    assert steps[2] - steps[1] == pytest.approx(zero2 - zero1, abs=2e-3)
    assert steps[3] - steps[2] == pytest.approx(2 * gather[1] + gather[0], abs=2e-3)
    with pytest.raises(PlanError, match=r"costs a fixed plan: set the options' schedule_kind "
                                        r"\(None\) and num_microbatches \(2\) too"):
        evaluate_layout(costs, DEV, replace(options, schedule_kind=None), _layout(
            4, tp=1, pp=2, dp=2, zero_stage=0), cand, positions=(5,))


def test_zero23_collectives_in_every_action_cost_m_times_at_pp1_and_fill_the_pipeline() -> None:
    # dp_step_us prices ZeRO 2-3's per-microbatch collectives inside each F and B and takes
    # the schedule's step with them less without: at pp = 1 that is m times a microbatch's,
    # the rank's collectives (dp_exposed_us); at pp 2 the fill and drain pay them again
    costs = _gpt(2)
    options = _options(batch=8, num_microbatches=4, schedule_kind="1f1b", recompute=False)
    runtime = RuntimeDescription(collectives_share_compute=True)
    for pp, positions in ((1, ()), (2, (5,))):
        layout = _layout(2 * pp, tp=1, pp=pp, dp=2, zero_stage=3)
        cand = next(c for c in layout_candidates(costs, DEV, options, layout) if c.pp == pp)
        plan = evaluate_layout(costs, DEV, options, layout, cand, positions=positions)
        per_rank = dp_exposed_us(plan, layout, runtime, costs)
        # one stage per rank: the plan's units per rank are its units per stage
        step = dp_step_us(plan, (1, 2, 3, False), layout, runtime, units_of(plan, costs),
                          plan.zero_layer_units, costs)
        if pp == 1:
            assert step == pytest.approx(per_rank[0], rel=1e-9)
        else:  # 1F1B: (m - 1) x the slowest stage's extra (stage 1's, which holds more) + both
            extra = [x / 4 for x in per_rank]
            assert extra[1] > extra[0] > 0
            assert step == pytest.approx(3 * extra[1] + extra[0] + extra[1], rel=1e-6)
            assert step > max(per_rank)


def test_fixed_degrees_are_kept() -> None:
    plan = solve_layout(_gpt(4), DEV, _options(), _layout(tp=2, pp=2, dp=2, zero_stage=1))
    assert (plan.tp, len(plan.ranks), plan.dp, plan.zero_stage) == (2, 2, 2, 1)
    styles = {p.name: p.style for p in plan.sharded_parameters}
    assert styles["h.0.attn.qkv.w"] == "column" and styles["h.0.attn.proj.w"] == "row"
    assert styles["head.w"] == "vocab" and "h.0.ln.w" not in styles
    assert plan.model_flops == 3 * sum(nd.flops for nd in _gpt(4).nodes) * 16


def test_baselines_and_frontier_pay_the_dp_collectives_too() -> None:
    # dp = 2 with ZeRO-1: the plan's step includes the gradient collectives after the flush;
    # the baselines beside it and its own frontier point must include them as well
    plan = solve_layout(_gpt(4), DEV, replace(_options(), baselines=True),
                        _layout(tp=1, pp=4, dp=2, zero_stage=1))
    peak = max(r.peak_memory_bytes for r in plan.ranks)
    assert (plan.predicted_step_time_us, peak) in {
        (p.predicted_step_time_us, p.peak_memory_bytes) for p in plan.pareto}
    assert plan.baselines
    for b in plan.baselines:
        if b.fits:
            assert b.predicted_step_time_us >= plan.predicted_step_time_us - 1e-3, b


@pytest.mark.parametrize(("kw", "match"), [
    ({"tp": 3}, r"tp=3 must divide the 4 GPUs per host.*nearest valid: \[2, 4\]"),
    ({"tp": 4, "num_heads": 6}, r"tp=4 does not divide the model's 6 attention heads; "
                                r"nearest valid: \[1, 2\]"),
    ({"tp": 2, "pp": 2, "dp": 3}, r"tp x pp x dp = 2 x 2 x 3 = 12, but the cluster has 8 GPUs"
                                  r".*use dp=2"),
    ({"zero_stage": 4}, r"zero_stage=4 is not a ZeRO stage; valid: 0"),
])
def test_bad_layouts_name_the_value_and_the_nearest_valid(kw: dict[str, object],
                                                          match: str) -> None:
    args: dict[str, object] = {"num_heads": 4, **kw}
    with pytest.raises(PlanError, match=match):
        LayoutOptions(num_gpus=8, topology=TOPO, **args)  # type: ignore[arg-type]


def test_a_batch_dp_cannot_split_is_refused() -> None:
    with pytest.raises(PlanError, match=r"global batch 12 does not split over dp=8.*nearest "
                                        r"valid dp: \[4, 6\], or a batch of \[8, 16\]"):
        layout_candidates(_gpt(2), DEV, _options(batch=12), _layout(tp=1, pp=1, dp=8))
    with pytest.raises(PlanError, match=r"gives 8 per replica, which m=3 microbatches cannot "
                                        r"split; nearest valid m: \[2, 4\]"):
        layout_candidates(_gpt(2), DEV, _options(batch=16, num_microbatches=3),
                          _layout(tp=1, pp=4, dp=2))


def test_nothing_fits_names_the_smallest_state() -> None:
    tiny = replace(DEV, memory_bytes=10_000)
    with pytest.raises(InfeasiblePlanError, match="no .tp, pp, dp, ZeRO. layout of 8 GPUs fits "
                                                  "10000 bytes per GPU"):
        solve_layout(_gpt(2), tiny, _options(), _layout())


def test_a_layout_whose_activations_do_not_fit_is_named_in_whole_clauses() -> None:
    # the state fits, the activations do not: the refusal names the layout and why, the
    # pipeline solver's first clause whole (not cut mid-word), without its advice for
    # solve() callers (explain_infeasible), and the search's own advice
    costs, options = _gpt(2), _options(recompute=False)
    layout = _layout(tp=1, pp=1, dp=8, zero_stage=0)
    cand = layout_candidates(costs, DEV, options, layout)[0]
    peak = max(r.peak_memory_bytes for r in solve_layout(costs, DEV, options, layout).ranks)
    cap = (cand.state_lb_bytes + peak) // 2
    with pytest.raises(InfeasiblePlanError) as info:
        solve_layout(costs, replace(DEV, memory_bytes=cap), options, layout)
    message = str(info.value)
    assert (f"tp 1 x pp 1 x dp 8 ZeRO-0: no partition onto 1 ranks fits the memory cap of "
            f"{cap} bytes") in message
    assert "explain_infeasible" not in message
    assert message.endswith("Use more GPUs, a higher ZeRO stage, or recompute")


def test_microbatch_sizes_set_m_per_layout() -> None:
    layout = _layout(tp=1, pp=2, dp=4, microbatch_sizes=(1, 2))
    plan = solve_layout(_gpt(2), DEV, _options(batch=16), layout)
    # a replica's batch is 16 / 4 = 4 rows: m = 4 (1 row each) or 2 (2 rows each)
    assert plan.num_microbatches in (2, 4) and plan.dp == 4
    with pytest.raises(PlanError, match=r"microbatch_sizes=\(\) must be sizes >= 1"):
        _layout(microbatch_sizes=())


def test_layer_units_are_recorded_only_where_the_runtime_runs_them() -> None:
    costs = _gpt(3)
    fixed = _options(schedule_kind="1f1b", num_microbatches=2)
    plan = solve_layout(costs, DEV, fixed, _layout(4, tp=1, pp=2, dp=2, zero_stage=3))
    assert plan.zero_layer_units and plan.schedule_kind == "1f1b"
    whole = solve_layout(costs, DEV, fixed, _layout(4, tp=1, pp=2, dp=2, zero_stage=3,
                                                    zero_layer_units=False))
    assert not whole.zero_layer_units
    assert max(r.peak_memory_bytes for r in plan.ranks) < max(
        r.peak_memory_bytes for r in whole.ranks)
    # a schedule that splits its backwards gathers the stage from I to W: one unit per stage
    zb = solve_layout(costs, DEV, replace(fixed, schedule_kind="zero_bubble"),
                      _layout(4, tp=1, pp=2, dp=2, zero_stage=3))
    assert not zb.zero_layer_units
    assert not solve_layout(costs, DEV, fixed, _layout(
        4, tp=1, pp=2, dp=2, zero_stage=0)).zero_layer_units
    assert solve_layout(costs, DEV, fixed, _layout(
        4, tp=1, pp=2, dp=2, zero_stage=1)).zero_layer_units
    with pytest.raises(PlanError, match=r"zero_layer_units=True with dp=2, zero_stage=3 and "
                                        r"schedule_kind='zero_bubble'"):
        replace(zb, zero_layer_units=True)
    d = plan.to_dict()
    del d["zero_layer_units"]  # a plan written before the field loads as one unit per stage
    assert type(plan).from_dict(d).zero_layer_units is False


def test_a_fixed_plan_keeps_its_stages_own_recompute() -> None:
    # a plan whose stages differ in recompute is priced with each stage's flag: the
    # recomputing stage holds less, and predict_layout_peaks gives the plan's own peaks
    from autopart.solver.layout_predict import predict_layout_peaks

    costs = _gpt(2)
    options = _options(batch=8, num_microbatches=2, schedule_kind="1f1b", recompute=None)
    layout = _layout(4, tp=1, pp=2, dp=2, zero_stage=0)
    cand = next(c for c in layout_candidates(costs, DEV, options, layout) if c.pp == 2)
    plans = {flags: evaluate_layout(costs, DEV, options, layout, cand, positions=(5,),
                                    recompute=flags)
             for flags in ((False, False), (True, False))}
    mixed, plain = plans[(True, False)], plans[(False, False)]
    assert [s.recompute for s in mixed.stages] == [True, False]
    assert mixed.ranks[0].peak_memory_bytes < plain.ranks[0].peak_memory_bytes
    assert mixed.ranks[1].peak_memory_bytes == plain.ranks[1].peak_memory_bytes
    assert predict_layout_peaks(mixed, costs, DEV, options, layout) == tuple(
        r.peak_memory_bytes for r in mixed.ranks)
