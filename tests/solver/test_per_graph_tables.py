"""The solver's tables made once per cost graph object: shared by the models of one graph,
never by another graph (one with other trainable parameters, other times or other experts),
and dropped with their graph."""

from __future__ import annotations

import gc
from dataclasses import replace

from autopart.core.costgraph import NodeCost
from autopart.solver._cost_model import CostModel
from autopart.solver.candidates import _BY_GRAPH, _per_graph
from autopart.solver.expert_parallel_costs import expert_params


def _model(costs, cluster, **kw) -> CostModel:
    return CostModel(costs, cluster, batch_size=8, training=True, state_factor=2.0, **kw)


def test_models_of_one_graph_share_its_tables_and_another_graph_gets_its_own(build) -> None:
    costs = build.chain(6, param_bytes=400)
    cluster = build.cluster(2)
    a, b = _model(costs, cluster), _model(costs, cluster, recompute_policy="op")
    assert a._saved is b._saved and a._last_use is b._last_use  # the graph's memory tables
    assert a._parts is not b._parts  # another policy: its own time tables
    assert _model(costs, cluster)._parts is a._parts
    # the same nodes with nothing trainable: no new weight gradients (400 bytes) beside
    # each backward, so each node's working set is its output (100); slower nodes take longer
    frozen = replace(costs, trainable=frozenset())
    assert frozen.nodes is costs.nodes
    assert a.transient_bytes(0, 6, 1.0) == 400
    assert _model(frozen, cluster).transient_bytes(0, 6, 1.0) == 100
    slow = replace(costs, nodes=tuple(replace(nd, fwd_us=2 * nd.fwd_us) for nd in costs.nodes))
    assert _model(slow, cluster).part_us("fwd", 0, 6, 1.0) == 2 * a.part_us("fwd", 0, 6, 1.0)


def test_a_graphs_entries_go_with_it(build) -> None:
    costs = build.chain(3)
    key = ("test entry", id(costs))
    assert _per_graph("test entry", costs, lambda c: len(c.nodes)) == 3
    assert _per_graph("test entry", costs, lambda c: -1) == 3  # remembered
    assert key in _BY_GRAPH
    del costs
    gc.collect()
    assert key not in _BY_GRAPH


def test_expert_params_reads_each_graphs_own_experts(build) -> None:
    def moe(layers: int):
        nodes, params, prev = [], {}, "x"
        for i in range(layers):
            for j, (op, mod) in enumerate((("aten.mm.default", f"layers.{i}.mlp.gate"),
                                           ("aten._grouped_mm.default", f"layers.{i}.mlp.experts"),
                                           ("aten.mul.default", f"layers.{i}.mlp.experts.act"))):
                fqn = f"{mod}.w"
                params[fqn] = (64, 16)
                nodes.append(replace(build.node(f"n{i}_{j}", (prev,), params=(fqn,),
                                                param_bytes=64, module=mod), op=op))
                prev = nodes[-1].name
        return build.graph(nodes, params=params)

    two = moe(2)
    assert expert_params(two) == {"layers.0.mlp.experts.w", "layers.0.mlp.experts.act.w",
                                  "layers.1.mlp.experts.w", "layers.1.mlp.experts.act.w"}
    assert expert_params(two) is expert_params(two)
    # a graph of other nodes is read afresh, though an older answer is remembered
    one = moe(1)
    assert expert_params(one) == {"layers.0.mlp.experts.w", "layers.0.mlp.experts.act.w"}
    plain = replace(one, nodes=tuple(replace(nd, op="aten.mm.default") if isinstance(nd, NodeCost)
                                     else nd for nd in one.nodes))
    assert expert_params(plain) == frozenset()
