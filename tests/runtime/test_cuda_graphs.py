"""CUDA graphs of stages (issue 32), on the CPU: every stage refuses with its reason, once,
and the step runs eagerly with unchanged numerics. The replay itself: tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autopart.core.capture import capture
from autopart.runtime.local.cuda_graphs import StageGraphs, graph_refusal
from tests.numerics import assert_train_step_matches
from tests.plans import even_positions, local_pipeline, manual_plan
from tests.zoo import mlp


def test_cpu_stages_refuse_with_not_cuda_and_the_step_is_unchanged(
        capsys: pytest.CaptureFixture[str]) -> None:
    model, args, target, loss_fn = mlp()
    captured = capture(model, (args[0][:2],))
    reference = copy.deepcopy(model)
    plan = manual_plan(captured, even_positions(captured, 2), 4, 8, schedule_kind="1f1b")
    pipe = local_pipeline(model, captured, plan, ["cpu", "cpu"], loss_fn=loss_fn)
    pipe.cuda_graphs = True
    assert pipe.cuda_graphs and pipe.cuda_graph_reasons == {}
    assert_train_step_matches(pipe, reference, args, target, loss_fn)
    reasons = pipe.cuda_graph_reasons
    assert sorted(reasons) == [0, 1]
    assert all(r.startswith("not CUDA: the stage runs on cpu") for r in reasons.values())
    pipe.train_step(*args, target=target)  # a second step: nothing captured, nothing new said
    printed = capsys.readouterr().err
    assert printed.count("runs eagerly, not as a CUDA graph: not CUDA") == 2, printed
    assert pipe._executor.graphs is not None and pipe._executor.graphs.graphed() == []


def test_each_reason_a_stage_cannot_be_graphed_is_named() -> None:
    cuda = torch.device("cuda", 0)  # never touched: the reasons are decided before a capture
    lin = nn.Linear(2, 2)
    assert graph_refusal(lin, torch.device("cpu"), recompute=False,
                         splits_backward=False).startswith("not CUDA")
    assert graph_refusal(lin, cuda, recompute=True, splits_backward=False).startswith("recompute")
    assert graph_refusal(lin, cuda, recompute=False,
                         splits_backward=True).startswith("split backward (I and W actions)")
    assert graph_refusal(lin, cuda, recompute=False, splits_backward=False) is None

    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.randn(x.shape, generator=torch.Generator())

    gm = torch.fx.symbolic_trace(Noisy())
    assert "RNG with its own generator" in str(graph_refusal(gm, cuda, recompute=False,
                                                             splits_backward=False))
    graphs = StageGraphs([lin, lin], [torch.device("cpu"), cuda], recompute=[1])
    assert sorted(graphs.reasons) == [0, 1] and graphs.reasons[1].startswith("recompute")


def test_the_replay_bookkeeping_on_cpu_with_capture_stood_in(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """With the capture stood in by the eager module (no GPU here), the executor's use of the
    graph copies: captured after the first step, one copy per microbatch in flight, every
    F finds a free copy, every B gives it back, numerics unchanged, on one thread and on a
    thread per rank. The replay itself is tests/gpu/test_cuda_graphs.py's."""
    import autopart.runtime.local.cuda_graphs as cg

    captures: list[int] = []

    def stand_in(slot: nn.Module, samples: tuple[torch.Tensor, ...], **_: object) -> nn.Module:
        captures.append(len(samples))
        return slot

    monkeypatch.setattr(cg, "graph_refusal", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", stand_in)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    for threads in (1, None):
        model, args, target, loss_fn = mlp()
        captured = capture(model, (args[0][:2],))
        reference = copy.deepcopy(model)
        plan = manual_plan(captured, even_positions(captured, 2), 4, 8, schedule_kind="1f1b")
        pipe = local_pipeline(model, captured, plan, ["cpu", "cpu"], loss_fn=loss_fn)
        pipe.issue_threads = threads
        pipe.cuda_graphs = True
        captures.clear()
        assert_train_step_matches(pipe, reference, args, target, loss_fn)
        graphs = pipe._executor.graphs
        assert graphs is not None and graphs.captured and graphs.graphed() == [0, 1]
        assert captures == [1, 1, 1]  # 1F1B, 2 stages: stage 0 holds 2 microbatches, stage 1 one
        for _ in range(2):  # replayed steps: gradients accumulate on top of the first step's
            pipe.train_step(*args, target=target)
        ref = dict(reference.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, 3 * ref[name].grad, rtol=1e-5, atol=1e-6)
        assert pipe.cuda_graph_reasons == {}
        assert graphs._taken == {} and sorted(graphs._free[0]) == [0, 1]
    assert "eagerly" not in capsys.readouterr().err
