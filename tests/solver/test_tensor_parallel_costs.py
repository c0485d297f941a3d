"""Tensor parallelism on a CostGraph: the pairs found from the graph, and one GPU's share of it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from autopart.core.costgraph import CostGraph, NodeCost
from autopart.core.errors import PlanError
from autopart.solver.tensor_parallel import find_tensor_parallel, sequence_parallel_nodes
from autopart.solver.tensor_parallel_costs import shard_costs

MM = "aten.addmm.default"


def _node(name: str, op: str, module: str, inputs: tuple[str, ...], *, fwd: float,
          bwd: float = 0.0, out: int = 4000, saved: int = 0, params: tuple[str, ...] = (),
          param_bytes: int = 0) -> NodeCost:
    return NodeCost(name=name, op=op, module_path=module, fwd_us=fwd, bwd_input_us=bwd,
                    bwd_weight_us=bwd, flops=400, bytes_accessed=800, output_bytes=out,
                    saved_bytes=saved, param_bytes=param_bytes, inputs=inputs, params=params)


def _block(*, leak: bool = False) -> CostGraph:
    """x -> ln -> qkv -> attn -> proj -> add(x) -> head: one attention block and a head."""
    nodes = [
        _node("ln", "aten.layer_norm.default", "blk.ln", ("x",), fwd=15, saved=4000,
              params=("blk.ln.w",), param_bytes=40),
        _node("qkv", MM, "blk.attn.qkv", ("ln",), fwd=105, bwd=105, out=12000, saved=4000,
              params=("blk.attn.qkv.w", "blk.attn.qkv.b"), param_bytes=1240),
        _node("attn", "aten.scaled_dot_product_attention.default", "blk.attn", ("qkv",), fwd=45,
              bwd=85, out=4000, saved=16000),
        _node("proj", MM, "blk.attn.proj", ("attn",), fwd=45, bwd=45, saved=4000,
              params=("blk.attn.proj.w", "blk.attn.proj.b"), param_bytes=440),
        _node("add", "aten.add.Tensor", "blk", ("proj", "x"), fwd=9),
        _node("head", "aten.linear.default", "head", ("add",) + (("attn",) if leak else ()),
              fwd=205, bwd=205, out=8000, saved=4000, params=("head.w",), param_bytes=800),
    ]
    sizes = {"blk.ln.w": (40, 20), "blk.attn.qkv.w": (1200, 600), "blk.attn.qkv.b": (40, 20),
             "blk.attn.proj.w": (400, 200), "blk.attn.proj.b": (40, 20), "head.w": (800, 400)}
    return CostGraph(nodes=tuple(nodes), graph_inputs={"x": 4000}, graph_outputs=("head",),
                     param_sizes={k: v[0] for k, v in sizes.items()},
                     param_numel={k: v[1] for k, v in sizes.items()},
                     trainable=frozenset(sizes), source="analytical:test", bwd_source="estimated",
                     batch_size=1, fingerprint="block")


def test_pairs_are_found_from_the_graph() -> None:
    split = find_tensor_parallel(_block())
    # qkv (column) -> attention (between) -> proj (row); the head is vocab-parallel
    assert split.pairs == (((1,), 3),)
    assert split.between == {2}
    assert split.vocab == {5}
    assert split.params == {"blk.attn.qkv.w": "column", "blk.attn.qkv.b": "column",
                            "blk.attn.proj.w": "row", "head.w": "vocab"}


def test_a_value_read_outside_the_pair_keeps_it_replicated() -> None:
    # the head reads the attention's (split) output: it cannot be split
    split = find_tensor_parallel(_block(leak=True))
    assert split.pairs == ()
    assert "blk.attn.qkv.w" not in split.params


def test_shard_costs_hand_worked() -> None:
    costs = _block()
    tp4 = shard_costs(costs, 4, bandwidth_bytes_per_s=1e9, latency_us=1.0, op_overhead_us=5.0)
    by = {nd.name: nd for nd in tp4.nodes}
    # all-reduce of 4000 bytes over 4 GPUs at 1 GB/s: 2 * 3/4 * 4000 / 1e9 s = 6 µs, + 6 steps
    ar = 6.0 + 6.0
    # column: 5 + (105 - 5) / 4 = 30; its input-gradient backward waits for the all-reduce
    assert by["qkv"].fwd_us == pytest.approx(30.0)
    assert by["qkv"].bwd_input_us == pytest.approx(30.0 + ar)
    assert by["qkv"].bwd_weight_us == pytest.approx(30.0)
    assert by["qkv"].output_bytes == 3000 and by["qkv"].saved_bytes == 4000  # input replicated
    # between: 5 + 40 / 4 = 15; activations split
    assert by["attn"].fwd_us == pytest.approx(15.0)
    assert (by["attn"].output_bytes, by["attn"].saved_bytes) == (1000, 4000)
    # row: 5 + 40 / 4 = 15, then the all-reduce of its whole output
    assert by["proj"].fwd_us == pytest.approx(15.0 + ar)
    assert (by["proj"].output_bytes, by["proj"].saved_bytes) == (4000, 1000)
    # replicated nodes keep their costs
    assert by["ln"] == costs.nodes[0] and by["add"] == costs.nodes[4]
    # vocab-parallel head: 5 + 200 / 4, then the all-gather of its whole 8000-byte logits:
    # 3/4 * 8000 / 1e9 s = 6 µs + 3 steps; backward: the all-reduce of its 4000-byte input's
    # gradient; its output stays whole (every GPU holds the gathered logits)
    assert by["head"].fwd_us == pytest.approx(55.0 + 6.0 + 3.0)
    assert by["head"].bwd_input_us == pytest.approx(55.0 + ar)
    assert by["head"].bwd_weight_us == pytest.approx(55.0)
    assert by["head"].output_bytes == 8000
    # parameters: column weight and bias, row weight and the head split; the row bias is not
    assert tp4.param_sizes == {"blk.ln.w": 40, "blk.attn.qkv.w": 300, "blk.attn.qkv.b": 10,
                               "blk.attn.proj.w": 100, "blk.attn.proj.b": 40, "head.w": 200}
    assert [nd.param_bytes for nd in tp4.nodes] == [40, 310, 0, 140, 0, 200]
    assert tp4.param_numel["blk.attn.qkv.w"] == 150


def test_sequence_parallel_hand_worked() -> None:
    """Megatron's sequence parallelism on the same block at tp 4: the row's all-reduce is a
    reduce-scatter (forward) and an all-gather (backward) of the same 4000 bytes, 6 µs each
    (3/4 * 4000 / 1e9 s + 3 steps); the residual add after it runs on 1/4 of the tokens; the
    head's "f" of that token-split value is an all-gather forward, a reduce-scatter back."""
    costs = _block()
    kw = dict(bandwidth_bytes_per_s=1e9, latency_us=1.0, op_overhead_us=5.0)
    plain = {nd.name: nd for nd in shard_costs(costs, 4, **kw).nodes}
    by = {nd.name: nd for nd in shard_costs(costs, 4, sequence_parallel=True, **kw).nodes}
    half = 6.0
    assert by["proj"].fwd_us == pytest.approx(15.0 + half)
    assert by["proj"].bwd_input_us == pytest.approx(15.0 + half)
    assert by["proj"].output_bytes == 1000  # this GPU's tokens of the sum
    # the add: 5 + (9 - 5) / 4, on a quarter of the tokens
    assert by["add"].fwd_us == pytest.approx(6.0) and by["add"].output_bytes == 1000
    assert by["head"].fwd_us == pytest.approx(55.0 + 6.0 + 3.0 + half)
    assert by["head"].bwd_input_us == pytest.approx(55.0 + half)
    # before the first reduce-scatter the block runs as without it
    assert by["ln"] == plain["ln"] and by["qkv"] == plain["qkv"] and by["attn"] == plain["attn"]
    # the same ring time in all: an all-reduce is a reduce-scatter and an all-gather
    comm = sum(by[n].fwd_us + by[n].bwd_input_us for n in ("proj", "head"))
    assert comm == pytest.approx(sum(plain[n].fwd_us + plain[n].bwd_input_us
                                     for n in ("proj", "head")))
    # gloo reduces the whole buffer for a reduce-scatter: priced as the all-reduce (12 µs)
    gloo = {nd.name: nd for nd in shard_costs(costs, 4, sequence_parallel=True,
                                              reduce_scatter_as_all_reduce=True, **kw).nodes}
    assert gloo["proj"].fwd_us == pytest.approx(15.0 + 2 * half)
    assert gloo["head"].bwd_input_us == pytest.approx(55.0 + 2 * half)
    assert gloo["proj"].bwd_input_us == by["proj"].bwd_input_us  # the all-gather: as before
    # what runs on the tokens: the add (reached from the row node through token-wise ops)
    assert sequence_parallel_nodes(costs, find_tensor_parallel(costs)) == frozenset({4})


def test_tp_one_is_the_graph_itself() -> None:
    costs = _block()
    assert shard_costs(costs, 1, bandwidth_bytes_per_s=1e9, latency_us=0.0,
                       op_overhead_us=5.0) is costs
    with pytest.raises(PlanError, match="tp=0 must be >= 1"):
        shard_costs(costs, 0, bandwidth_bytes_per_s=1e9, latency_us=0.0, op_overhead_us=5.0)


def test_a_vocab_parallel_head_holds_the_gathers_buffers() -> None:
    # training: the head's backward holds 8000 bytes of logits' gradient and 4000 of its
    # input's; at tp 4 its slice of the logits is 2000 bytes
    nodes = list(_block().nodes)
    nodes[5] = replace(nodes[5], transient_bytes=12_000)
    costs = replace(_block(), nodes=tuple(nodes))
    head = shard_costs(costs, 4, bandwidth_bytes_per_s=1e9, latency_us=1.0,
                       op_overhead_us=5.0).nodes[5]
    # forward: the slice (2000) and the gathered parts (8000) beside the whole logits; backward:
    # the gradients (12,000) and the copy of the slice of the logits' gradient (2000)
    assert head.output_bytes == 8000
    assert head.transient_bytes == max(2000 + 8000, 12_000 + 2000) == 14_000
    # inference (no working set profiled): unchanged
    assert shard_costs(_block(), 4, bandwidth_bytes_per_s=1e9, latency_us=1.0,
                       op_overhead_us=5.0).nodes[5].transient_bytes == 0


def test_collective_outputs_are_what_the_forward_collectives_return() -> None:
    """The selective recompute policy keeps what tp's forward collectives return: proj's
    all-reduce (its whole 4000-byte output), the vocab-parallel head's all-gather of the
    logits (8000), and with sequence parallelism proj's
    reduce-scatter beside the matmul's whole partial sum (4000 counted here, the node lists
    2000)."""
    costs = _block()
    ar = shard_costs(costs, 2, bandwidth_bytes_per_s=1e9, latency_us=0.0, op_overhead_us=0.0)
    assert dict(ar.collective_outputs) == {3: 4000, 5: 8000}
    assert CostGraph.from_dict(ar.to_dict()).collective_outputs == ar.collective_outputs
    assert "collective_outputs" not in costs.to_dict()
    sp = shard_costs(costs, 2, bandwidth_bytes_per_s=1e9, latency_us=0.0, op_overhead_us=0.0,
                     sequence_parallel=True)
    assert dict(sp.collective_outputs)[3] == 4000


def test_sequence_parallel_gathers_are_recomputed_not_kept(build: Any) -> None:
    """With sequence parallelism, the all-gather of a token-split value (the residual add's
    output, split by proj's reduce-scatter, before the head) is not among what a selective
    stage keeps: it gathers again in its backward, also where it keeps the matmul after the
    gather, so the recomputed forward carries its time (Megatron-LM re-gathers a
    sequence-parallel linear's input)."""
    from autopart.solver._cost_model import CostModel

    costs = _block()
    kw = dict(bandwidth_bytes_per_s=1e9, latency_us=0.0, op_overhead_us=0.0)
    sp = shard_costs(costs, 2, sequence_parallel=True, **kw)  # type: ignore[arg-type]
    plain = shard_costs(costs, 2, **kw)  # type: ignore[arg-type]
    gathers = {i: t for i, t, _ in sp.recomputed_gathers}
    assert set(gathers) == {5}
    assert plain.recomputed_gathers == ()
    for i, t in gathers.items():
        assert 0.0 < t < sp.nodes[i].fwd_us
    # kept: proj's reduce-scatter (4000) and the head's logits gather (8000); not the head's
    # gathered input
    assert dict(sp.collective_outputs) == {3: 4000, 5: 8000}
    assert CostGraph.from_dict(sp.to_dict()).recomputed_gathers == sp.recomputed_gathers
    assert "recomputed_gathers" not in plain.to_dict()
    cluster = build.cluster(1)
    sel = CostModel(sp, cluster, batch_size=1, training=True, state_factor=2.0,
                    recompute_policy="selective")
    full = CostModel(sp, cluster, batch_size=1, training=True, state_factor=2.0)
    # the head (kept) is not run again, its input's gather is
    node_fwd = [full.part_us("fwd", i, i + 1, 1.0) for i in range(len(sp.nodes))]
    unkept = sum(node_fwd[i] for i in (0, 4))  # ln and the add
    assert sel.part_us("recompute", 0, 6, 1.0) == pytest.approx(unkept + gathers[5])
    assert sel.regather_us(5, 1.0) == pytest.approx(gathers[5])
    assert sel.regather_us(1, 1.0) == 0.0
