"""Context parallelism's costs on one GPU, by hand on a tiny Llama's analytical profile, and
cp in the layout search."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

import autopart  # noqa: E402
from autopart.core.capture import capture  # noqa: E402
from autopart.core.cluster import PRESETS  # noqa: E402
from autopart.core.context import context_inputs  # noqa: E402
from autopart.core.topology import topology_for_device  # noqa: E402
from autopart.profiler import profile_analytical  # noqa: E402
from autopart.solver import SolveOptions  # noqa: E402
from autopart.solver.collectives import all_gather_us, reduce_scatter_us  # noqa: E402
from autopart.solver.context_parallel_costs import (  # noqa: E402
    ATTENTION_OP,
    attention_nodes,
    context_costs,
    repeated_heads,
    split_tokens,
)
from autopart.solver.layout_search import (  # noqa: E402
    LayoutCandidate,
    LayoutOptions,
    evaluate_layout,
    layout_candidates,
    solve_layout,
)
from tests.distributed.cp_worker import tiny_model  # noqa: E402

BW, LAT = 100e9, 5.0
SPEC = PRESETS["a100-80gb"]
SEQ = 256


def _costs(cp: int = 1, name: str = "llama"):
    """The analytical profile of 2 sequences of SEQ tokens, or (cp > 1) of one cp rank's
    SEQ / cp tokens of them, captured with position_ids as the runtime captures it."""
    model, args, _, _ = tiny_model(name, SEQ, 2)
    inputs, kwargs, _ = context_inputs(model, max(cp, 2), args, {})
    if cp == 1:  # whole sequences, with position_ids too, so both graphs have the same ops
        inputs, kwargs = args, {"position_ids": kwargs["position_ids"].new_tensor(
            list(range(SEQ))).expand(2, -1)}
    return profile_analytical(capture(model, inputs, kwargs), None, SPEC)


def _by_op(costs) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for nd in costs.nodes:
        f, b = out.get(nd.op, (0, 0))
        out[nd.op] = (f + nd.flops, b + nd.output_bytes)
    return out


def test_split_tokens_of_whole_sequences_is_the_profile_at_s_over_cp() -> None:
    whole, local = _costs(1), _costs(2)
    split = split_tokens(whole, 2)
    assert split_tokens(whole, 1) is whole
    got, want = _by_op(split), _by_op(local)
    # matmuls and attention do the work of S / cp tokens each (attention: (S / cp)^2)
    for op in ("aten.mm.default", "aten.linear.default", ATTENTION_OP):
        if op in want:
            assert got[op][0] == pytest.approx(want[op][0], rel=1e-6), op
    assert got[ATTENTION_OP][1] == want[ATTENTION_OP][1]
    assert split.param_sizes == whole.param_sizes
    assert sum(split.graph_inputs.values()) == pytest.approx(
        sum(whole.graph_inputs.values()) / 2, rel=0.01)


def test_split_tokens_keeps_each_ops_fixed_time() -> None:
    whole, ov = _costs(1), SPEC.op_overhead_us
    split = split_tokens(whole, 4, ov)
    attn = set(attention_nodes(whole))
    for i, (a, b) in enumerate(zip(whole.nodes, split.nodes, strict=True)):
        div = 16 if i in attn else 4
        for k in ("fwd_us", "bwd_input_us", "bwd_weight_us"):
            t = getattr(a, k)
            want = t if t <= ov else ov + (t - ov) / div  # a rank issues every op
            assert getattr(b, k) == pytest.approx(want), (a.name, k)
        assert b.flops == int(a.flops / div)
    assert split_tokens(whole, 4).total_fwd_us() == pytest.approx(whole.total_fwd_us() / 4,
                                                                  rel=0.1)


@pytest.mark.parametrize("attention", ["all_gather", "ulysses"])
def test_attention_that_skips_the_upper_half_is_priced_against_its_half(attention: str) -> None:
    # a profile whose attention ran with is_causal (CostGraph.causal_attention) did about 2
    # of the 4 chunk blocks a masked kernel computes: the all-gather form's 2 cp + 1 blocks
    # are (2 cp + 1) / 2 of it, Ulysses' causal kernel over the whole sequence cp of it
    cp, local = 4, _costs(4)
    attn = attention_nodes(local)
    skips = dataclasses.replace(local, causal_attention=frozenset(
        local.nodes[i].name for i in attn))
    kw = dict(causal=True, bandwidth_bytes_per_s=BW, latency_us=LAT, attention=attention)
    masked, skipping = context_costs(local, cp, **kw), context_costs(skips, cp, **kw)
    work = cp if attention == "ulysses" else (2 * cp + 1) / 2
    for i in attn:
        a, m, k = local.nodes[i], masked.nodes[i], skipping.nodes[i]
        exchange = m.fwd_us - a.fwd_us * (2 * cp + 1) / 4
        assert k.fwd_us == pytest.approx(a.fwd_us * work + exchange)
        assert k.flops == int(a.flops * work)


@pytest.mark.parametrize(("name", "causal"), [("llama", True), ("bert", False)])
def test_attention_gathers_keys_and_values_and_attends_to_the_whole_sequence(
        name: str, causal: bool) -> None:
    cp = 2
    local = _costs(cp, name)
    out = context_costs(local, cp, causal=causal, bandwidth_bytes_per_s=BW, latency_us=LAT)
    assert context_costs(local, 1, causal=causal, bandwidth_bytes_per_s=BW,
                         latency_us=LAT) is local
    attn = attention_nodes(local)
    assert len(attn) == 2  # one per layer
    by_name = {nd.name: nd for nd in local.nodes}
    work = (2 * cp + 1) / 4 if causal else cp
    for i, (a, b) in enumerate(zip(local.nodes, out.nodes, strict=True)):
        if i not in attn:
            assert a == b
            continue
        # keys / values as attention takes them, the whole sequence: 2 sequences x 4 heads x
        # SEQ tokens x 8 dims x 4 B
        kv = [by_name[n].output_bytes * cp for n in a.inputs[1:3]]
        assert kv == [2 * 4 * SEQ * 8 * 4] * 2
        # Llama's 2 key / value heads are gathered before repeat_kv doubles them
        repeats = [repeated_heads(by_name, n) for n in a.inputs[1:3]]
        assert [r and r[1] for r in repeats] == ([2, 2] if name == "llama" else [None, None])
        moved = [x // 2 for x in kv] if name == "llama" else kv
        gather = sum(all_gather_us(x, cp, BW, LAT) for x in moved)
        assert gather == pytest.approx(2 * (moved[0] / 2 / BW * 1e6 + LAT))
        assert b.fwd_us == pytest.approx(a.fwd_us * work + gather)
        assert b.bwd_input_us == pytest.approx(
            a.bwd_input_us * work + sum(reduce_scatter_us(x, cp, BW, LAT) for x in moved))
        assert b.flops == int(a.flops * work)
        # the other ranks' keys and values held to the backward (the kernel saves the whole
        # sequence's where the model's own saved the rank's), their gradients in its backward
        assert b.saved_bytes == a.saved_bytes + (cp - 1) * sum(kv) // cp
        assert b.transient_bytes == a.transient_bytes + sum(kv)


def _layout(num_gpus: int = 4, **kw) -> LayoutOptions:
    topology = topology_for_device(SPEC.name, SPEC.link_bandwidth_bytes_per_s,
                                   SPEC.link_latency_us)
    return LayoutOptions(num_gpus=num_gpus, topology=topology, **kw)


def test_the_layout_search_tries_cp_where_the_sequence_allows_and_prices_it() -> None:
    whole = _costs(1)
    options = SolveOptions(batch_size=4, num_microbatches=2, time_limit_s=5.0)
    # unknown sequence length: cp stays 1; searched: every divisor of the GPUs dividing S / 2
    assert {c.cp for c in layout_candidates(whole, SPEC, options, _layout(cp=None))} == {1}
    cands = layout_candidates(whole, SPEC, options, _layout(cp=None, max_cp=SEQ // 2))
    assert {c.cp for c in cands} == {1, 2, 4}
    assert all(c.tp * c.pp * c.dp * c.cp == 4 for c in cands)
    assert {(c.pp, c.dp) for c in cands if c.cp == 4} == {(1, 1)}
    # cp 2 halves a GPU's activations: a lower peak than pp 2 alone on half the GPUs
    at = {cp: evaluate_layout(whole, SPEC, options, _layout(2 * cp, cp=cp),
                              LayoutCandidate(1, 2, 1, 0, 0.0, 0, cp=cp)) for cp in (1, 2)}
    assert at[2].cp == 2 and at[1].cp == 1 and at[2].dp == 1
    peak = {cp: max(r.peak_memory_bytes for r in p.ranks) for cp, p in at.items()}
    assert peak[2] < peak[1]
    # under a cap only a cp layout fits: the search picks it and says so in the plan
    cap = (peak[1] + peak[2]) // 2
    plan = solve_layout(whole, SPEC, dataclasses.replace(options, memory_cap_bytes=cap),
                        _layout(cp=None, max_cp=SEQ // 2, pp=2, dp=1))
    assert plan.cp > 1 and plan.num_gpus == 4
    assert max(r.peak_memory_bytes for r in plan.ranks) <= cap


@pytest.mark.parametrize(("name", "causal"), [("llama", True), ("bert", False)])
def test_ulysses_exchanges_queries_keys_values_and_output_and_holds_no_whole_keys(
        name: str, causal: bool) -> None:
    cp = 2
    local = _costs(cp, name)
    attn = attention_nodes(local)
    by_name = {nd.name: nd for nd in local.nodes}
    work = (2 * cp + 1) / 4 if causal else cp
    # heads unknown: grouped-query keys move repeated; 4 heads (Llama: 2 key heads, which cp 2
    # divides): unrepeated; 2 heads (1 key head): repeated
    for heads, halved in ((None, False), (4, name == "llama"), (2, False)):
        out = context_costs(local, cp, causal=causal, bandwidth_bytes_per_s=BW, latency_us=LAT,
                            attention="ulysses", heads=heads)
        for i, (a, b) in enumerate(zip(local.nodes, out.nodes, strict=True)):
            if i not in attn:
                assert a == b
                continue
            # the rank's queries, keys, values and output: 2 x 4 heads x SEQ / cp x 8 x 4 B
            mine = [by_name[n].output_bytes for n in a.inputs[:3]] + [a.output_bytes]
            assert mine == [2 * 4 * SEQ // cp * 8 * 4] * 4
            if halved:
                mine[1:3] = [x // 2 for x in mine[1:3]]
            # four pairwise all-to-alls each way, each sending (cp - 1) / cp of its buffer
            four = sum(x / 2 / BW * 1e6 + LAT for x in mine)
            assert b.fwd_us == pytest.approx(a.fwd_us * work + four)
            assert b.bwd_input_us == pytest.approx(a.bwd_input_us * work + four)
            assert b.flops == int(a.flops * work)
            assert b.saved_bytes == a.saved_bytes  # exchanged tensors of the rank's own bytes
            assert b.transient_bytes == a.transient_bytes + 3 * sum(mine)
    with pytest.raises(ValueError, match="'ring'"):
        context_costs(local, cp, causal=causal, bandwidth_bytes_per_s=BW, latency_us=LAT,
                      attention="ring")


def test_the_search_tries_ulysses_where_tp_x_cp_divides_the_heads_and_it_holds_less() -> None:
    whole = _costs(1)
    options = SolveOptions(batch_size=4, num_microbatches=2, time_limit_s=5.0)

    def tried(**kw) -> set[tuple[int, int, str]]:
        return {(c.tp, c.cp, c.cp_attention) for c in layout_candidates(
            whole, SPEC, options, _layout(cp=None, max_cp=SEQ // 2, **kw)) if c.cp > 1}

    # heads unknown: all-gather only; 4 heads: Ulysses wherever tp x cp divides 4
    assert {a for _, _, a in tried()} == {"all_gather"}
    assert tried(num_heads=4) == {(1, 2, "all_gather"), (1, 2, "ulysses"),
                                  (1, 4, "all_gather"), (1, 4, "ulysses"),
                                  (2, 2, "all_gather"), (2, 2, "ulysses")}
    assert ("ulysses" not in {a for tp, cp, a in tried(num_heads=4, attention_heads=2)
                              if tp * cp == 4})
    assert {a for _, _, a in tried(num_heads=4, cp_attention="all_gather")} == {"all_gather"}
    with pytest.raises(autopart.PlanError, match="no allowed tp and cp divide"):
        layout_candidates(whole, SPEC, options, _layout(cp=2, num_heads=3, tp=1,
                                                        cp_attention="ulysses"))
    # Ulysses holds no whole-sequence keys and values: a lower peak at the same layout
    plans = {a: evaluate_layout(whole, SPEC, options, _layout(2, cp=2, num_heads=4),
                                LayoutCandidate(1, 1, 1, 0, 0.0, 0, cp=2, cp_attention=a))
             for a in ("all_gather", "ulysses")}
    assert plans["ulysses"].cp_attention == "ulysses"
    assert plans["all_gather"].cp_attention == "all_gather"
    peaks = {a: max(r.peak_memory_bytes for r in p.ranks) for a, p in plans.items()}
    assert peaks["ulysses"] < peaks["all_gather"]


@pytest.mark.parametrize(("attention", "per_attention"), [("all_gather", 4), ("ulysses", 8)])
def test_each_collective_pays_its_fixed_cost_after_the_work_between_two(
        attention: str, per_attention: int) -> None:
    """As tp's: the fixed cost is read at one GPU's forward and backward (attention at the
    runtime's work) over the collectives of a forward and backward."""
    cp, local = 2, _costs(2)
    attn = attention_nodes(local)
    plain = context_costs(local, cp, causal=True, bandwidth_bytes_per_s=BW, latency_us=LAT,
                          attention=attention, heads=4)
    seen: list[float] = []
    priced = context_costs(local, cp, causal=True, bandwidth_bytes_per_s=BW, latency_us=LAT,
                           attention=attention, heads=4,
                           collective_overhead=lambda w: seen.append(w) or 7.0)
    total = (sum(nd.fwd_us + nd.bwd_input_us + nd.bwd_weight_us for nd in local.nodes)
             + sum(0.25 * (local.nodes[i].fwd_us + local.nodes[i].bwd_input_us) for i in attn))
    assert seen[0] == pytest.approx(total / (per_attention * len(attn)))
    for i in attn:  # half the collectives in the forward, half in the backward
        assert priced.nodes[i].fwd_us == pytest.approx(plain.nodes[i].fwd_us
                                                       + per_attention / 2 * 7.0)
        assert priced.nodes[i].bwd_input_us == pytest.approx(plain.nodes[i].bwd_input_us
                                                             + per_attention / 2 * 7.0)


def test_a_measured_attention_ratio_replaces_the_block_count_and_only_there() -> None:
    """The runtime's attention timed against the model's (the profiler's figure) prices each
    attention's forward and backward; its FLOPs, the other nodes and the exchanges stay."""
    cp = 2
    local = _costs(cp)
    counted = context_costs(local, cp, causal=True, bandwidth_bytes_per_s=BW, latency_us=LAT)
    timed = context_costs(local, cp, causal=True, bandwidth_bytes_per_s=BW, latency_us=LAT,
                          measured=(1.5, 2.0))
    attn = attention_nodes(local)
    work = (2 * cp + 1) / 4
    for i, (a, c, t) in enumerate(zip(local.nodes, counted.nodes, timed.nodes, strict=True)):
        if i not in attn:
            assert a == c == t
            continue
        assert t.fwd_us == pytest.approx(c.fwd_us + (1.5 - work) * a.fwd_us)
        assert t.bwd_input_us == pytest.approx(c.bwd_input_us + (2.0 - work) * a.bwd_input_us)
        assert t.flops == c.flops and t.saved_bytes == c.saved_bytes


def test_measured_cp_attention_factors_need_one_cp_ranks_costs() -> None:
    with pytest.raises(autopart.PlanError, match="cp_tokens_profiled=True"):
        _layout(cp=2, cp_attention_factors=(("all_gather", 1.4, 1.5),))
    with pytest.raises(autopart.PlanError, match="forward > 0"):
        _layout(cp=2, cp_tokens_profiled=True, cp_attention_factors=(("ring", 1.4, 1.5),))
    layout = _layout(cp=2, cp_tokens_profiled=True,
                     cp_attention_factors=(("all_gather", 1.4, 1.5),))
    assert layout.cp_attention_factors == (("all_gather", 1.4, 1.5),)
