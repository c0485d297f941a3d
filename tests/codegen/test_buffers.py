"""Buffers a model updates while it runs (BatchNorm's running statistics, an EMA) end exactly
as running the unpartitioned model on the same microbatches one after another leaves them,
with and without recompute; the capture keeps each update next to the node that reads it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import autopart
from autopart.codegen.split import split_graph
from autopart.core.capture import capture, op_nodes
from autopart.core.capturedgraph import buffer_update_cuts
from autopart.core.errors import PlanError
from autopart.profiler import profile_graph
from autopart.solver.candidates import crossing_profile
from tests.codegen._modules import EmaCentre
from tests.plans import manual_plan

B, M = 8, 2


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
        nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 2 * 2, 16), EmaCentre(16), nn.Tanh(), nn.Linear(16, 3)).train()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def test_capture_updates_buffers_in_place_where_they_are_read() -> None:
    captured = capture(_bn_net(), (torch.randn(B, 3, 8, 8),))
    graph = captured.graph_module.graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.ops.aten._native_batch_norm_legit_functional.default not in targets
    assert targets.count(torch.ops.aten._native_batch_norm_legit.default) == 3
    assert targets.count(torch.ops.aten.add_.Tensor) == 3  # num_batches_tracked
    # the EMA's copy_ follows the node making its new value, not the graph's end
    (copy_node,) = [n for n in graph.nodes if n.target == torch.ops.aten.copy_.default]
    assert copy_node.prev is copy_node.args[1]


def test_no_cut_falls_between_a_buffers_readers_and_its_update() -> None:
    x = torch.randn(B // M, 3, 8, 8)
    captured = capture(_bn_net(), (x,))
    ops = op_nodes(captured.graph_module.graph)
    (clone,) = [i for i, n in enumerate(ops) if n.target == torch.ops.aten.clone.default]
    (update,) = [i for i, n in enumerate(ops) if n.target == torch.ops.aten.copy_.default]
    assert ops[clone].args[0] is ops[update].args[0]  # the EMA read, then written
    # BatchNorm reads and writes its statistics in one op: only the EMA's span is ruled out
    span = set(range(clone + 1, update + 1))
    assert buffer_update_cuts(captured.graph_module.graph) == span
    costs = profile_graph(captured, [x], warmup=0, repeats=1)
    assert span <= costs.no_cut
    _, valid = crossing_profile(costs)
    assert not any(valid[k] for k in span) and valid[clone] and valid[update + 1]
    for k in (clone + 1, update):  # what profiled before this rule still cannot run
        with pytest.raises(PlanError, match=f"cut at position {k} separates a buffer"):
            split_graph(captured, [k])
    split_graph(captured, [update + 1])


@pytest.mark.parametrize("position", ["before_read", "after_update"])
def test_cuts_around_a_buffers_update_train_as_microbatching_by_hand(position: str) -> None:
    """The cuts nearest the EMA's span, replayed (the timing-driven test below could take any
    cut): the loss, buffers and gradients of running the microbatches one after another."""
    x, y = torch.randn(B, 3, 8, 8), torch.randint(0, 3, (B,))
    model = _bn_net()
    reference = copy.deepcopy(model)
    captured = capture(model, (x[:B // M],))
    span = sorted(buffer_update_cuts(captured.graph_module.graph))
    cut = span[0] - 1 if position == "before_read" else span[-1] + 1
    pipe = autopart.compile(model, (x,), loss_fn=_loss,
                            plan=manual_plan(captured, [cut], M, B, schedule_kind="1f1b"))
    _check_against_microbatching(pipe, reference, x, y)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_running_stats_and_gradients_equal_microbatching_by_hand(num_stages: int,
                                                                 recompute: bool) -> None:
    model = _bn_net()
    reference = copy.deepcopy(model)
    x, y = torch.randn(B, 3, 8, 8), torch.randint(0, 3, (B,))
    pipe = autopart.compile(model, (x,), loss_fn=_loss, num_stages=num_stages,
                            num_microbatches=M, recompute=recompute, schedule="1f1b",
                            time_limit_s=5.0)
    _check_against_microbatching(pipe, reference, x, y)


def _check_against_microbatching(pipe: Any, reference: nn.Module, x: torch.Tensor,
                                 y: torch.Tensor) -> None:
    loss = pipe.train_step(x, target=y)
    ref_loss = torch.zeros(())
    for xc, yc in zip(x.chunk(M), y.chunk(M), strict=True):
        part = _loss(reference(xc), yc) / M
        part.backward()
        ref_loss += part.detach()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    ref_buffers = dict(reference.named_buffers())
    buffers = dict(pipe.named_buffers())
    assert buffers.keys() == ref_buffers.keys()
    for name, b in buffers.items():
        torch.testing.assert_close(b, ref_buffers[name], rtol=1e-6, atol=1e-7, msg=name)
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-7,
                                   msg=name)


def test_profiling_leaves_the_buffers_as_they_were() -> None:
    from autopart.profiler import profile_graph

    model = _bn_net()
    before = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(B, 3, 8, 8)
    captured = capture(model, (x,))
    profile_graph(captured, [x], warmup=0, repeats=1)
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name
