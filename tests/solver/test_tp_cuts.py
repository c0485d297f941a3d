"""No plan cuts inside a tensor-parallel pair: ``CostGraph.no_cut``, set by ``shard_costs`` and
honoured by the cut candidates and the layout search."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.solver.candidates import crossing_profile, find_candidates
from autopart.solver.layout_search import solve_layout
from autopart.solver.tensor_parallel import find_tensor_parallel, inside_pairs
from autopart.solver.tensor_parallel_costs import shard_costs
from tests.solver.test_layout_search import DEV, _gpt, _layout, _options


def test_inside_pairs_spans_each_pair_from_its_column_to_its_row() -> None:
    costs = _gpt(2)
    names = [nd.name for nd in costs.nodes]  # ln0 qkv0 sdpa0 proj0 res0 ln1 qkv1 ... head
    split = find_tensor_parallel(costs)
    # position k cuts before nodes[k]: after qkv0 (2) and after sdpa0 (3) are inside
    assert inside_pairs(split) == {names.index("sdpa0"), names.index("proj0"),
                                   names.index("sdpa1"), names.index("proj1")}


def test_sharded_graphs_rule_the_pair_positions_out_of_every_candidate_set() -> None:
    costs = _gpt(3)
    tp2 = shard_costs(costs, 2, bandwidth_bytes_per_s=1e9, latency_us=1.0, op_overhead_us=2.0)
    inside = inside_pairs(find_tensor_parallel(costs))
    assert tp2.no_cut == inside and not costs.no_cut
    _, valid = crossing_profile(tp2)
    assert not any(valid[k] for k in inside)
    assert all(valid[k] for k in range(1, len(costs.nodes)) if k not in inside)
    # asking for as many stages as there are valid positions falls back to every valid one
    n_valid = len(costs.nodes) - 1 - len(inside)
    cands = find_candidates(tp2, n_valid + 1)
    assert set(cands.positions).isdisjoint(inside) and len(cands.positions) == n_valid


def test_layout_plans_with_tp_cut_between_pairs_only() -> None:
    costs = _gpt(4)
    names = [nd.name for nd in costs.nodes]
    inside = inside_pairs(find_tensor_parallel(costs))
    for pp in (2, 4):
        plan = solve_layout(costs, DEV, _options(), _layout(2 * pp, tp=2, pp=pp, dp=1))
        assert plan.tp == 2 and len(plan.ranks) == pp
        cuts = {names.index(st.first_node) for st in plan.stages[1:]}
        assert cuts and cuts.isdisjoint(inside), (pp, sorted(cuts))


def test_no_cut_round_trips_and_is_left_out_when_empty() -> None:
    costs = _gpt(1)
    assert "no_cut" not in costs.to_dict()
    marked = replace(costs, no_cut=frozenset({2, 3}))
    d = json.loads(json.dumps(marked.to_dict()))
    assert d["no_cut"] == [2, 3] and CostGraph.from_dict(d) == marked
    with pytest.raises(PlanError, match="no_cut positions"):
        replace(costs, no_cut=frozenset({0}))
