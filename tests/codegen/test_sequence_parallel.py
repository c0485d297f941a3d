"""Sequence parallelism's graph pass on one process (no collectives run): which all-reduces
become reduce-scatters, which ops run on 1/tp of the tokens, where the whole tensor comes back,
and that the solver prices the same ops (its numerics against the plain model run on gloo
ranks in tests/distributed/test_tensor_parallel.py)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from autopart.codegen import TensorParallelRank, build_stages  # noqa: E402
from autopart.codegen.sequence_parallel import sequence_parallel  # noqa: E402
from autopart.core.capture import capture  # noqa: E402
from autopart.core.cluster import PRESETS  # noqa: E402
from autopart.profiler import profile_analytical  # noqa: E402
from autopart.solver.tensor_parallel import (  # noqa: E402
    find_tensor_parallel,
    sequence_parallel_nodes,
)
from tests.distributed.tp_worker import tiny, tp_plan  # noqa: E402

TP = TensorParallelRank(0, 2, "tp")
ops = torch.ops.autopart


def _stages(name: str, rows: int = 2, seq: int = 8, pp: int = 1) -> tuple[object, object]:
    model, args, _, _ = tiny(name)
    captured = capture(model, (args[0][:rows, :seq],))
    plan = tp_plan(name, captured, pp, 2, 2 * rows)
    return captured, build_stages(captured, plan, ["cpu"] * pp, tp=TP)


def _targets(gm: torch.fx.GraphModule, op: object) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target == op]


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_every_all_reduce_becomes_a_reduce_scatter_and_the_norms_run_on_half_the_tokens(
        name: str) -> None:
    _, stages = _stages(name)
    gm = stages.modules[0]
    reduces = len(_targets(gm, ops.tp_reduce.default))
    split = sequence_parallel(gm, TP)
    assert not _targets(gm, ops.tp_reduce.default)
    assert len(_targets(gm, ops.tp_reduce_scatter.default)) == reduces > 0
    norms = [n for n in gm.graph.nodes if n.name in split and n.target in (
        torch.ops.aten.layer_norm.default, torch.ops.aten.mean.dim)]
    # every norm but the final one before the head reads token-split values: 2 per layer
    assert len(norms) >= 4
    for n in norms:
        assert n.meta["val"].shape[:2] == (2, 4), (n.name, n.meta["val"].shape)
    # the column inputs are gathered (backward reduce-scatters): one per pair that reads
    # a token-split value, and the vocab-parallel head's
    assert len(_targets(gm, ops.tp_seq_gather_split.default)) >= 3
    gm.recompile()
    assert "tp_reduce_scatter" in gm.code


def test_gpt2_conv1d_rows_split_within_each_sequence() -> None:
    """GPT-2's row matmuls are 2-D ``addmm``s over ``[batch * seq, h]`` rows: the tokens are
    split per sequence (``outer`` = the batch), so the view back to ``[batch, seq, h]`` keeps
    them apart."""
    _, stages = _stages("gpt2")
    gm = stages.modules[0]
    split = sequence_parallel(gm, TP)
    layouts = {tuple(n.args[1:3]) for n in _targets(gm, ops.tp_reduce_scatter.default)}
    assert layouts == {(0, 2), (1, 1)}  # the rows of addmm; the embedding's [b, s, h]
    shapes = {tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.name in split
              and isinstance(n.meta["val"], torch.Tensor)}
    assert shapes == {(8, 32), (2, 4, 32)}  # batch 2 x 4 of the 8 tokens, hidden 32


def test_the_solver_prices_the_ops_the_pass_splits() -> None:
    for name in ("gpt2", "llama", "bert"):
        captured, stages = _stages(name)
        split = sequence_parallel(stages.modules[0], TP)
        costs = profile_analytical(captured, None, PRESETS["a100-80gb"])
        priced = {costs.nodes[i].name for i in sequence_parallel_nodes(
            costs, find_tensor_parallel(costs))}
        names = {nd.name for nd in costs.nodes}
        assert priced == split & names, name


def test_the_whole_tensor_comes_back_where_an_op_is_not_token_wise_and_at_the_output() -> None:
    _, stages = _stages("bert")  # the prediction head's dense layer is not a tp pair
    gm = stages.modules[0]
    sequence_parallel(gm, TP)
    gathers = _targets(gm, ops.tp_seq_gather.default)
    assert [u.target for g in gathers for u in g.users] == [torch.ops.aten.linear.default]
    _, stages = _stages("gpt2", pp=2)
    first = stages.modules[0]
    split = sequence_parallel(first, TP)
    out = next(n for n in first.graph.nodes if n.op == "output")
    assert not {a.name for a in out.all_input_nodes} & split  # nothing leaves token-split
    assert ops.tp_seq_gather.default in {a.target for a in out.all_input_nodes}


def test_tokens_tp_does_not_divide_keep_the_all_reduce() -> None:
    _, stages = _stages("gpt2", seq=7)
    gm = stages.modules[0]
    before = len(_targets(gm, ops.tp_reduce.default))
    assert sequence_parallel(gm, TP) == frozenset()
    assert len(_targets(gm, ops.tp_reduce.default)) == before > 0


def test_a_plan_with_sequence_parallel_builds_it_and_needs_tp() -> None:
    captured, stages = _stages("gpt2")
    plan = dataclasses.replace(stages.plan, sequence_parallel=True)
    built = build_stages(captured, plan, ["cpu"], tp=TP)
    assert _targets(built.modules[0], ops.tp_reduce_scatter.default)
    with pytest.raises(Exception, match="sequence_parallel=True with tp=1"):
        dataclasses.replace(plan, tp=1, sharded_parameters=())
