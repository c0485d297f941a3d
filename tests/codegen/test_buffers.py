"""Buffers a model updates while it runs (BatchNorm's running statistics, an EMA) end exactly
as running the unpartitioned model on the same microbatches one after another leaves them,
with and without recompute; the capture keeps each update next to the node that reads it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopart
from autopart.core.capture import capture
from tests.codegen._modules import EmaCentre

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
