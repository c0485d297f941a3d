"""Tensor parallelism's collectives priced as the runtime runs them, and sibling-module pairs
(BERT's layout), on hand-made cost graphs whose numbers can be checked by hand."""

from __future__ import annotations

import dataclasses

import pytest

from autopart.core.costgraph import CostGraph, NodeCost
from autopart.solver.tensor_parallel import find_tensor_parallel
from autopart.solver.tensor_parallel_costs import shard_costs

LIN = "aten.linear.default"
ADD = "aten.add.Tensor"
# every test: tp = 2 over a 1 GB/s link, 1 µs per ring step, 5 µs fixed per op; a ring
# all-reduce of B bytes over 2 GPUs is 2 * 1/2 * B / 1e9 s + 2 steps = B / 1000 + 2 µs, an
# all-gather half of that
KW = {"bandwidth_bytes_per_s": 1e9, "latency_us": 1.0, "op_overhead_us": 5.0}


def _ar(nbytes: int) -> float:
    return nbytes / 1000 + 2.0


def _node(name: str, op: str, module: str, inputs: tuple[str, ...], *, out: int = 4000,
          saved: int = 0, params: tuple[str, ...] = ()) -> NodeCost:
    return NodeCost(name=name, op=op, module_path=module, fwd_us=25.0, bwd_input_us=25.0,
                    bwd_weight_us=25.0 if params else 0.0, flops=400, bytes_accessed=800,
                    output_bytes=out, saved_bytes=saved, param_bytes=0, inputs=inputs,
                    params=params)


def _graph(nodes: list[NodeCost], *, inputs: dict[str, int] | None = None,
           buffers: tuple[str, ...] = (), loss_saved: int = 0) -> CostGraph:
    params = sorted({p for nd in nodes for p in nd.params})
    first: dict[str, str] = {}
    for nd in nodes:
        for p in nd.params:
            first.setdefault(p, nd.name)
    nodes = [dataclasses.replace(nd, param_bytes=400 * sum(first[p] == nd.name for p in nd.params))
             for nd in nodes]
    return CostGraph(nodes=tuple(nodes), graph_inputs=inputs or {"x": 4000},
                     graph_outputs=(nodes[-1].name,), param_sizes=dict.fromkeys(params, 400),
                     param_numel=dict.fromkeys(params, 100),
                     trainable=frozenset(params) - set(buffers), source="analytical:test",
                     bwd_source="estimated", batch_size=1, fingerprint="hand",
                     loss_saved_bytes=loss_saved)


def _ln(name: str, module: str, inp: str) -> NodeCost:
    return _node(name, "aten.layer_norm.default", module, (inp,), params=(module + ".w",))


def test_one_gradient_all_reduce_per_distinct_column_input() -> None:
    # cross-attention: q reads the decoder's ln, k and v share the encoder's ln (3000 bytes);
    # the runtime's "f" runs once per distinct input: two all-reduces, on the first reader
    costs = _graph([
        _ln("ln_d", "d.ln", "x"),
        _node("enc", "aten.layer_norm.default", "e.ln", ("x",), out=3000, params=("e.ln.w",)),
        _node("q", LIN, "d.att.q", ("ln_d",), params=("d.att.q.w",)),
        _node("k", LIN, "d.att.k", ("enc",), params=("d.att.k.w",)),
        _node("v", LIN, "d.att.v", ("enc",), params=("d.att.v.w",)),
        _node("sdpa", "aten.scaled_dot_product_attention.default", "d.att", ("q", "k", "v")),
        _node("o", LIN, "d.att.o", ("sdpa",), params=("d.att.o.w",)),
    ])
    split = find_tensor_parallel(costs)
    assert split.pairs == (((2, 3, 4), 6),)
    by = {nd.name: nd for nd in shard_costs(costs, 2, **KW).nodes}
    half = 5.0 + 20.0 / 2  # a split node's time
    assert by["q"].bwd_input_us == pytest.approx(half + _ar(4000))
    assert by["k"].bwd_input_us == pytest.approx(half + _ar(3000))
    assert by["v"].bwd_input_us == pytest.approx(half)
    # forward: the row's all-reduce of its 4000-byte output, nothing else
    assert by["o"].fwd_us == pytest.approx(half + _ar(4000))
    assert by["q"].fwd_us == pytest.approx(half) and by["sdpa"].fwd_us == pytest.approx(half)


def test_gate_and_up_share_one_all_reduce() -> None:
    costs = _graph([
        _ln("ln", "m.ln", "x"),
        _node("gate", LIN, "m.mlp.gate", ("ln",), params=("m.mlp.gate.w",)),
        _node("up", LIN, "m.mlp.up", ("ln",), params=("m.mlp.up.w",)),
        _node("act", "aten.silu.default", "m.mlp.act", ("gate",)),
        _node("mul", "aten.mul.Tensor", "m.mlp", ("act", "up")),
        _node("down", LIN, "m.mlp.down", ("mul",), params=("m.mlp.down.w",)),
    ])
    assert find_tensor_parallel(costs).pairs == (((1, 2), 5),)
    tp2 = shard_costs(costs, 2, **KW)
    extra = [nd.bwd_input_us - 15.0 for nd in tp2.nodes[1:]]
    assert extra == pytest.approx([_ar(4000), 0.0, 0.0, 0.0, 0.0])


def test_a_column_reading_a_graph_input_all_reduces_no_gradient() -> None:
    costs = _graph([
        _node("fc1", LIN, "mlp.fc1", ("x",), params=("mlp.fc1.w",)),
        _node("act", "aten.gelu.default", "mlp.act", ("fc1",)),
        _node("fc2", LIN, "mlp.fc2", ("act",), params=("mlp.fc2.w",)),
    ])
    by = {nd.name: nd for nd in shard_costs(costs, 2, **KW).nodes}
    assert by["fc1"].bwd_input_us == pytest.approx(15.0)  # x needs no gradient
    assert by["fc2"].fwd_us == pytest.approx(15.0 + _ar(4000))


def _rotary(table_params: tuple[str, ...], buffers: tuple[str, ...]) -> CostGraph:
    return _graph([
        _ln("ln", "b.ln", "x"),
        _node("table", "aten.mul.Tensor", "rope", ("x",), out=1000, params=table_params),
        _node("q", LIN, "b.att.q", ("ln",), params=("b.att.q.w",)),
        _node("rot", "aten.mul.Tensor", "b.att", ("q", "table")),
        _node("o", LIN, "b.att.o", ("rot",), params=("b.att.o.w",)),
    ], buffers=buffers)


def test_a_broadcast_operand_all_reduces_only_when_it_needs_a_gradient() -> None:
    # a learned table read by the nodes between: its gradient is summed over the GPUs
    learned = shard_costs(_rotary(("rope.w",), ()), 2, **KW)
    assert learned.nodes[3].bwd_input_us == pytest.approx(15.0 + _ar(1000))
    # a table made from a buffer (Llama's inv_freq): no gradient, no all-reduce
    fixed = shard_costs(_rotary(("rope.inv_freq",), ("rope.inv_freq",)), 2, **KW)
    assert fixed.nodes[3].bwd_input_us == pytest.approx(15.0)
    assert find_tensor_parallel(fixed).between == {3}


def test_vocab_pricing_and_the_loss_memory_stays_whole() -> None:
    # tied embedding (forward all-reduce of tokens x h, nothing backward) and head (forward
    # all-gather of tokens x V, backward all-reduce of its input's gradient); the loss saved
    # 3000 of the head's 7000 saved bytes and keeps them on every GPU
    costs = _graph([
        _node("emb", "aten.embedding.default", "wte", ("x",), params=("wte.w",)),
        _ln("ln", "ln_f", "emb"),
        dataclasses.replace(_node("head", LIN, "lm_head", ("ln",), out=16000, saved=7000,
                                  params=("wte.w",)), backward_peak_bytes=20000),
    ], loss_saved=3000)
    split = find_tensor_parallel(costs)
    assert split.vocab == {0, 2} and split.params == {"wte.w": "vocab"}
    tp2 = shard_costs(costs, 2, **KW)
    emb, _, head = tp2.nodes
    assert (emb.fwd_us, emb.bwd_input_us) == pytest.approx((15.0 + _ar(4000), 15.0))
    assert head.fwd_us == pytest.approx(15.0 + _ar(16000) / 2)
    assert head.bwd_input_us == pytest.approx(15.0 + _ar(4000))
    assert (head.output_bytes, head.saved_bytes, tp2.loss_saved_bytes) == (16000, 7000, 3000)
    assert head.backward_peak_bytes == 20000  # from the whole logits' gradient


def _bert_layer(*, residual_inside: bool = False) -> CostGraph:
    """BERT's layout: q/k/v under ``attention.self``, the output dense under
    ``attention.output``; the MLP's dense layers under ``intermediate`` and ``output``."""
    p = "enc.layer.0."
    nodes = [
        _ln("h", "emb.ln", "x"),
        _node("mask", "aten.mul.Tensor", "bert", ("x",), out=500),
        _node("q", LIN, p + "attention.self.query", ("h",), params=(p + "q.w",)),
        _node("k", LIN, p + "attention.self.key", ("h",), params=(p + "k.w",)),
        _node("v", LIN, p + "attention.self.value", ("h",), params=(p + "v.w",)),
        _node("sdpa", "aten.scaled_dot_product_attention.default", p + "attention.self",
              ("q", "k", "v", "mask")),
        _node("ctx", "aten.view.default", p + "attention.self", ("sdpa",)),
        _node("ao", LIN, p + "attention.output.dense", ("ctx",), params=(p + "ao.w",)),
        _node("res1", ADD, p + "attention.output", ("ao", "h")),
        _ln("ln1", p + "attention.output.LayerNorm", "res1"),
        _node("fc1", LIN, p + "intermediate.dense", ("ln1",), params=(p + "fc1.w",)),
        _node("act", "aten.gelu.default", p + "intermediate.act", ("fc1",)),
    ]
    if residual_inside:  # a residual add on the row's input side: no pair may cross it
        nodes.append(_node("res2", ADD, p + "output", ("act", "x_big")))
    nodes += [
        _node("fc2", LIN, p + "output.dense", ("res2" if residual_inside else "act",),
              params=(p + "fc2.w",)),
        _node("res3", ADD, p + "output", ("fc2", "ln1")),
    ]
    return _graph(nodes, inputs={"x": 4000, "x_big": 4000})


def test_sibling_modules_pair_through_parameter_free_nodes() -> None:
    split = find_tensor_parallel(_bert_layer())
    # q/k/v -> output.dense across attention.self / attention.output; the mask is a
    # broadcast operand from outside; intermediate.dense -> output.dense across the layer
    assert split.pairs == (((2, 3, 4), 7), ((10,), 12))
    assert split.between == {5, 6, 11}
    styles = {k.rsplit(".", 2)[-2]: v for k, v in split.params.items()}
    assert styles == {"q": "column", "k": "column", "v": "column", "ao": "row",
                      "fc1": "column", "fc2": "row"}


def test_no_sibling_pair_across_a_residual_add() -> None:
    # the MLP's row reads act + x_big (as large as the add's output): a residual, not a
    # broadcast operand; the attention pair is unaffected
    split = find_tensor_parallel(_bert_layer(residual_inside=True))
    assert split.pairs == (((2, 3, 4), 7),)
