"""Expert parallelism's costs on one GPU, by hand on a tiny Mixtral's analytical profile."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from autopart.core.capture import capture  # noqa: E402
from autopart.core.cluster import PRESETS  # noqa: E402
from autopart.core.costgraph import CostGraph  # noqa: E402
from autopart.profiler import profile_analytical  # noqa: E402
from autopart.solver.collectives import all_to_all_us  # noqa: E402
from autopart.solver.expert_parallel_costs import (  # noqa: E402
    expert_costs,
    expert_module_paths,
    routing_imbalance,
)
from tests.distributed.ep_worker import tiny_moe  # noqa: E402

BW, LAT = 100e9, 5.0


def _costs(name: str = "mixtral"):
    model, args, _, _ = tiny_moe(name)
    return profile_analytical(capture(model, (args[0][:2],)), None, PRESETS["a100-80gb"])


def test_each_gpu_holds_its_experts_and_pays_two_all_to_alls_each_way() -> None:
    costs = _costs()
    paths = expert_module_paths(costs)
    assert paths == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    out = expert_costs(costs, 2, bandwidth_bytes_per_s=BW, latency_us=LAT)
    experts = {p for p in costs.param_sizes if ".experts." in p}
    assert len(experts) == 4
    for fqn in costs.param_sizes:
        want = costs.param_sizes[fqn] // 2 if fqn in experts else costs.param_sizes[fqn]
        assert out.param_sizes[fqn] == want
        assert out.param_numel[fqn] == costs.param_numel[fqn] // (2 if fqn in experts else 1)
    # rows: 2 x 8 tokens x top-2 pairs of hidden 32 in float32
    rows = 2 * 8 * 2 * 32 * 4
    one = all_to_all_us(rows, 2, BW, LAT)
    assert one == pytest.approx(rows / 2 / BW * 1e6 + LAT)
    changed = [(a, b) for a, b in zip(costs.nodes, out.nodes, strict=True) if a != b]
    lasts = [b for a, b in changed if b.fwd_us != a.fwd_us]
    assert len(lasts) == 2  # one per MoE layer: its last node carries the all-to-alls
    for a, b in changed:
        if b.fwd_us != a.fwd_us:
            assert b.fwd_us - a.fwd_us == pytest.approx(2 * one + LAT)  # + the counts' exchange
            assert b.bwd_input_us - a.bwd_input_us == pytest.approx(2 * one)
    # recorded apart too, for the DualPipe-V pairs that hide them (no low batch here)
    index = {nd.name: i for i, nd in enumerate(out.nodes)}
    assert [(i, f, b) for i, f, b, _, _ in out.expert_exchanges] == [
        (index[nd.name], pytest.approx(2 * one + LAT), pytest.approx(2 * one)) for nd in lasts]
    assert CostGraph.from_dict(out.to_dict()).expert_exchanges == out.expert_exchanges
    assert sum(nd.param_bytes for nd in out.nodes) < sum(nd.param_bytes for nd in costs.nodes)
    for a, b in zip(costs.nodes, out.nodes, strict=True):  # compute as under balanced routing
        assert b.flops == a.flops


def test_the_fixed_cost_per_collective_is_paid_once_per_layer_by_the_counts_exchange() -> None:
    """The forward's counts exchange pays the runtime's fixed cost per collective (the wait
    for the ep partner); the dispatch, the combine and the backward's two all-to-alls, with
    the partners in step, move their rows only (measured on CPU ranks: a stage's backward at
    ep 2 within 0.7 ms per microbatch of ep 1's)."""
    costs = _costs()
    plain = expert_costs(costs, 2, bandwidth_bytes_per_s=BW, latency_us=LAT)
    fixed = expert_costs(costs, 2, bandwidth_bytes_per_s=BW, latency_us=LAT,
                         collective_overhead=lambda work_us: 100.0)
    changed = [(a, b) for a, b in zip(plain.nodes, fixed.nodes, strict=True) if a != b]
    assert len(changed) == 2  # each MoE layer's last node
    for a, b in changed:
        assert b.fwd_us - a.fwd_us == pytest.approx(100.0)
        assert b.bwd_input_us == a.bwd_input_us


def test_the_most_loaded_gpu_sets_the_layers_expert_compute_and_all_to_alls() -> None:
    import dataclasses

    from autopart.core.op_names import GROUPED_MM_OPS

    assert routing_imbalance((6, 2, 1, 3), 2) == pytest.approx(8 / 6)
    assert routing_imbalance((6, 2, 1, 3), 4) == pytest.approx(6 / 3)
    assert routing_imbalance((6, 2, 1, 3), 3) == 1.0  # 3 does not divide 4 experts
    assert routing_imbalance(None, 2) == routing_imbalance((5, 5, 5, 5), 2) == 1.0
    costs = _costs()
    paths = expert_module_paths(costs)
    # layer 0: experts 0-1 get 24 of the 32 token-expert pairs (GPU 0: 1.5x the mean of 16);
    # layer 1: balanced
    routed = dataclasses.replace(costs, expert_tokens=((paths[0], (12, 12, 4, 4)),
                                                       (paths[1], (8, 8, 8, 8))))
    base = expert_costs(costs, 2, bandwidth_bytes_per_s=BW, latency_us=LAT)
    out = expert_costs(routed, 2, bandwidth_bytes_per_s=BW, latency_us=LAT)
    rows = 2 * 8 * 2 * 32 * 4
    for a, b, nd in zip(base.nodes, out.nodes, costs.nodes, strict=True):
        layer0 = nd.module_path.startswith(paths[0])
        if layer0 and nd.op in GROUPED_MM_OPS:
            assert b.fwd_us == pytest.approx(1.5 * a.fwd_us) and b.fwd_us > 0
            assert b.bwd_input_us == pytest.approx(1.5 * a.bwd_input_us)
        elif not layer0:
            assert b == a
    # the layer's last node (after its second GEMM: the weighted sum) carries the
    # all-to-alls, of 1.5x the rows into the most loaded GPU
    last0 = max(i for i, nd in enumerate(costs.nodes) if nd.module_path.startswith(paths[0]))
    assert costs.nodes[last0].op not in GROUPED_MM_OPS
    extra = all_to_all_us(int(rows * 1.5), 2, BW, LAT) - all_to_all_us(rows, 2, BW, LAT)
    assert out.nodes[last0].fwd_us - base.nodes[last0].fwd_us == pytest.approx(2 * extra)
    assert out.nodes[last0].bwd_input_us - base.nodes[last0].bwd_input_us == \
        pytest.approx(2 * extra)


def test_a_second_profiled_batch_gets_the_same_all_to_alls_and_imbalance_at_its_rows() -> None:
    import dataclasses

    from autopart.core.op_names import GROUPED_MM_OPS

    costs = _costs()
    assert costs.batch_size == 2
    paths = expert_module_paths(costs)
    # the batch line through a second batch of 1 row: half of every time there
    two = dataclasses.replace(
        costs, low_batch_size=1, expert_tokens=((paths[0], (12, 12, 4, 4)),),
        low_times=tuple((nd.fwd_us / 2, nd.bwd_input_us / 2, nd.bwd_weight_us / 2)
                        for nd in costs.nodes))
    out = expert_costs(two, 2, bandwidth_bytes_per_s=BW, latency_us=LAT)
    rows = 2 * 8 * 2 * 32 * 4  # at 2 rows; the most loaded GPU of layer 0 takes 1.5x
    for i, nd in enumerate(costs.nodes):
        if nd.module_path.startswith(paths[0]) and nd.op in GROUPED_MM_OPS:
            assert out.low_times[i][0] == pytest.approx(1.5 * two.low_times[i][0])
    for path, share in ((paths[0], 1.5), (paths[1], 1.0)):
        last = max(i for i, nd in enumerate(costs.nodes) if nd.module_path.startswith(path))
        for batch_rows, got, was in ((1.0, out.nodes[last].fwd_us, costs.nodes[last].fwd_us),
                                     (0.5, out.low_times[last][0], two.low_times[last][0])):
            one = all_to_all_us(int(rows * share * batch_rows), 2, BW, LAT)
            assert got - was == pytest.approx(2 * one + LAT)


def test_ep_1_and_dense_models_are_unchanged() -> None:
    costs = _costs()
    assert expert_costs(costs, 1, bandwidth_bytes_per_s=BW, latency_us=LAT) is costs
    from tests.distributed.tp_worker import tiny

    model, args, _, _ = tiny("llama")
    dense = profile_analytical(capture(model, (args[0][:2],)), None, PRESETS["a100-80gb"])
    assert expert_costs(dense, 4, bandwidth_bytes_per_s=BW, latency_us=LAT) is dense


def test_the_layout_search_tries_ep_where_it_divides_dp_and_the_experts() -> None:
    from autopart.core.cluster import PRESETS as DEVICES
    from autopart.core.topology import topology_for_device
    from autopart.solver import SolveOptions
    from autopart.solver.layout_search import LayoutOptions, layout_candidates, solve_layout

    costs = _costs()
    spec = DEVICES["a100-80gb"]
    topology = topology_for_device(spec.name, spec.link_bandwidth_bytes_per_s,
                                   spec.link_latency_us)
    options = SolveOptions(batch_size=8, num_microbatches=2, time_limit_s=5.0)
    searched = LayoutOptions(num_gpus=4, topology=topology, ep=None, num_experts=4)
    cands = layout_candidates(costs, spec, options, searched)
    with_ep = {(c.tp, c.pp, c.dp, c.zero_stage, c.ep) for c in cands if c.ep > 1}
    assert with_ep == {(1, pp, 4 // pp, zero, ep) for pp, ep in ((1, 2), (1, 4), (2, 2))
                       for zero in range(4)}
    assert all(c.ep == 1 for c in cands if c.tp > 1)
    # unknown expert count: ep stays 1; a fixed ep keeps only the layouts it runs
    assert {c.ep for c in layout_candidates(costs, spec, options, replace_ep(searched, None,
                                                                            None))} == {1}
    fixed = layout_candidates(costs, spec, options, replace_ep(searched, 2, 4))
    assert {(c.tp, c.dp % 2, c.ep) for c in fixed} == {(1, 0, 2)}
    plan = solve_layout(costs, spec, options, replace_ep(searched, 4, 4))
    assert (plan.ep, plan.dp, plan.tp) == (4, 4, 1)
    # the same layout holds a quarter of the experts per GPU at ep 4, and pays all-to-alls
    from autopart.solver.layout_search import LayoutCandidate, evaluate_layout

    # (one schedule for both: at ep 4 a one-rank DualPipe-V would hide its all-to-alls)
    one = replace(options, schedule_kind="1f1b")
    at = {ep: evaluate_layout(costs, spec, one, replace_ep(searched, ep, 4),
                              LayoutCandidate(1, 1, 4, 0, 0.0, 0, ep=ep)) for ep in (1, 4)}
    assert at[4].ep == 4 and at[1].ep == 1
    assert at[4].stages[0].param_bytes < at[1].stages[0].param_bytes
    assert max(r.peak_memory_bytes for r in at[4].ranks) < max(
        r.peak_memory_bytes for r in at[1].ranks)
    assert at[4].predicted_step_time_us > at[1].predicted_step_time_us  # compute unchanged
    # under ZeRO the experts stay whole and the dense parameters are sharded
    zero3 = evaluate_layout(costs, spec, options, replace_ep(searched, 4, 4),
                            LayoutCandidate(1, 1, 4, 3, 0.0, 0, ep=4))
    assert (zero3.ep, zero3.zero_stage) == (4, 3)


def test_zero_leaves_the_experts_state_whole_in_the_memory_model() -> None:
    from autopart.core.runtime_model import RuntimeDescription
    from autopart.solver._memory_model import MemoryModel
    from autopart.solver.data_parallel import held_state_multiplier
    from autopart.solver.expert_parallel_costs import expert_params

    costs = expert_costs(_costs(), 4, bandwidth_bytes_per_s=BW, latency_us=LAT)
    experts = expert_params(costs)
    assert experts == {f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                       for w in ("gate_up_proj", "down_proj")}
    zero3 = held_state_multiplier(3, 4, 2.0, 1.0) - 2.0  # state factor of ZeRO-3 over dp 4

    def state(whole: frozenset[str]) -> int:
        model = MemoryModel(costs, batch_size=2, training=True, state_factor=zero3,
                            runtime=RuntimeDescription(), whole_state=(whole, 2.0))
        return model.state_of(0, len(costs.nodes))[0]

    expert_bytes = sum(costs.param_sizes[p] for p in experts)
    got = state(experts) - state(frozenset())
    assert got == pytest.approx(expert_bytes * (4.0 - (2.0 + zero3)), abs=len(experts))

def test_expert_gradients_are_averaged_over_their_own_replicas_not_over_dp() -> None:
    """By hand: at dp 4 the dense gradients are all-reduced over the 4 replicas; an ep rank's
    experts over the dp / ep replicas holding the same ones (none at ep = dp), as
    ``ExpertGrads`` runs it, where the plan charged them over all 4 before."""
    from autopart.core.runtime_model import RuntimeDescription
    from autopart.core.topology import topology_for_device
    from autopart.solver import SolveOptions
    from autopart.solver.data_parallel import data_parallel_cost
    from autopart.solver.expert_parallel_costs import expert_params
    from autopart.solver.layout_dp import dp_exposed_us, dp_step_us
    from autopart.solver.layout_search import (
        LayoutCandidate,
        LayoutOptions,
        evaluate_layout,
        sharded_costs,
    )

    costs = _costs()
    spec = PRESETS["a100-80gb"]
    topology = topology_for_device(spec.name, spec.link_bandwidth_bytes_per_s,
                                   spec.link_latency_us)
    # collectives after the flush (as on CPU ranks), with a fixed cost and copies to count
    runtime = RuntimeDescription(collectives_share_compute=True,
                                 collective_overhead_points=((0.0, 40.0),),
                                 copy_bytes_per_s=5e9)
    options = SolveOptions(batch_size=8, num_microbatches=2, schedule_kind="1f1b",
                           time_limit_s=5.0, runtime=runtime)
    bw, lat = topology.link(4)

    def reduce_us(nbytes: int, replicas: int) -> float:
        return data_parallel_cost(nbytes, dp=replicas, zero_stage=0, bandwidth_bytes_per_s=bw,
                                  latency_us=lat, overhead_us=40.0,
                                  copy_bytes_per_s=5e9).step_us(2)

    exposed = {}
    for ep in (1, 2, 4):
        layout = LayoutOptions(num_gpus=4, topology=topology, ep=ep, num_experts=4)
        plan = evaluate_layout(costs, spec, options, layout,
                               LayoutCandidate(1, 1, 4, 0, 0.0, 0, ep=ep))
        sharded = sharded_costs(costs, 1, spec, layout, runtime, None, ep)
        # the stage's parameter bytes, as the dense reduction prices them
        experts = sum(sharded.param_sizes[p] for p in expert_params(sharded)) if ep > 1 else 0
        want = reduce_us(sum(sharded.param_sizes.values()) - experts, 4) + (
            reduce_us(experts, 4 // ep) if 1 < ep < 4 else 0.0)
        (exposed[ep],) = dp_exposed_us(plan, layout, runtime, sharded)
        assert exposed[ep] == pytest.approx(want, rel=1e-9)
        # the layout search prices a replica's plan before it carries its layout's ep
        replica = replace(plan, ep=1)
        degrees = (1, 4, 0, plan.overlap_grad_reduce)
        assert dp_step_us(replica, degrees, layout, runtime, costs=sharded,
                          ep=ep) == pytest.approx(want, rel=1e-9)
    assert exposed[4] < exposed[2] < exposed[1]


def replace_ep(layout, ep, num_experts):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(layout, ep=ep, num_experts=num_experts)
