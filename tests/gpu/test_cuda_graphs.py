"""On one CUDA GPU (skipped without one; run by ``benchmarks/gpu/run_all.sh``): issuing threads
and CUDA-graph replay of the local runtime (issue 32) against the plain model, and their step
times printed beside the one-thread eager step (printed, never asserted)."""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import pytest
import torch

from autopart.core.capture import capture
from tests.plans import even_positions, local_pipeline, manual_plan
from tests.zoo import gpt2

pytestmark = pytest.mark.requires_cuda
TOL = {"rtol": 1e-5, "atol": 4e-5}


def _pipe(kind: str, num_stages: int, m: int = 4) -> tuple[Any, ...]:
    model, args, target, loss_fn = gpt2()
    model = model.cuda()
    args, target = tuple(a.cuda() for a in args), target.cuda()
    captured = capture(model, tuple(a[: 8 // m] for a in args))
    reference = copy.deepcopy(model)
    plan = manual_plan(captured, even_positions(captured, num_stages), m, 8, schedule_kind=kind)
    pipe = local_pipeline(model, captured, plan, ["cuda:0"] * num_stages, loss_fn=loss_fn)
    return pipe, reference, args, target, loss_fn


def _check_steps(pipe: Any, reference: torch.nn.Module, args: tuple, target: Any, loss_fn: Any,
                 steps: int = 3) -> None:
    """``steps`` SGD steps of the pipeline and of the plain model: loss, every gradient and
    every weight equal after each (the graphs are captured after step 1, replayed after)."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    ref = dict(reference.named_parameters())
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = pipe.train_step(*args, target=target)
        ref_loss = loss_fn(reference(*args), target)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=name)
        opt.step()
        ref_opt.step()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref[name], **TOL, msg=name)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zero_bubble", "interleaved_1f1b"])
def test_a_thread_per_rank_on_cuda_matches_the_plain_model(kind: str) -> None:
    stages = 4 if kind == "interleaved_1f1b" else 2
    model, args, target, loss_fn = gpt2()
    model = model.cuda()
    args, target = tuple(a.cuda() for a in args), target.cuda()
    captured = capture(model, tuple(a[:2] for a in args))
    reference = copy.deepcopy(model)
    v = 2 if kind == "interleaved_1f1b" else 1
    plan = manual_plan(captured, even_positions(captured, stages), 4, 8, schedule_kind=kind,
                       stages_per_rank=v)
    pipe = local_pipeline(model, captured, plan, ["cuda:0"] * (stages // v), loss_fn=loss_fn)
    pipe.issue_threads = None
    _check_steps(pipe, reference, args, target, loss_fn)


@pytest.mark.parametrize("threads", [1, None], ids=["one-thread", "thread-per-rank"])
def test_cuda_graph_replay_matches_the_plain_model(threads: int | None) -> None:
    pipe, reference, args, target, loss_fn = _pipe("1f1b", 2)
    pipe.issue_threads = threads
    pipe.cuda_graphs = True
    _check_steps(pipe, reference, args, target, loss_fn)
    assert pipe.cuda_graph_reasons == {}, pipe.cuda_graph_reasons
    assert pipe._executor.graphs.graphed() == [0, 1]


def test_split_backward_stages_fall_back_with_their_reason() -> None:
    pipe, reference, args, target, loss_fn = _pipe("zero_bubble", 2)
    pipe.cuda_graphs = True
    _check_steps(pipe, reference, args, target, loss_fn, steps=2)
    reasons = pipe.cuda_graph_reasons
    assert reasons and all("split backward" in r for s, r in reasons.items() if s >= 0), reasons


def test_step_times_eager_threads_and_graphs_printed(capsys: pytest.CaptureFixture[str]) -> None:
    """Four stages on one GPU, tiny GPT-2, 1F1B m = 8: the host-bound case of issue 32.
    Median of 10 steps per setting, settings alternating; printed for the run's log."""
    eager, *_, args, target, _ = _pipe("1f1b", 4, m=8)
    graphed, *_ = _pipe("1f1b", 4, m=8)
    graphed.cuda_graphs = True
    settings = {"eager, one thread": (eager, 1), "eager, thread per rank": (eager, None),
                "graphs, one thread": (graphed, 1), "graphs, thread per rank": (graphed, None)}
    times: dict[str, list[float]] = {k: [] for k in settings}
    for i in range(12):
        for name, (pipe, threads) in settings.items():
            pipe.issue_threads = threads
            pipe.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            pipe.train_step(*args, target=target)
            torch.cuda.synchronize()
            if i >= 2:
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["eager, one thread"])
    with capsys.disabled():
        print(f"\ngraphed stages {graphed._executor.graphs.graphed()}, reasons "
              f"{graphed.cuda_graph_reasons}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"local 4-stage step ({name}): {med * 1e3:.2f} ms ({med / base:.2f}x eager, "
                  "one thread)")
