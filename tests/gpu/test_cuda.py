"""On one CUDA GPU (skipped without one; run by ``benchmarks/gpu/run_all.sh``): the whole
job (capture, profile on the GPU, solve, codegen, the local runtime's streams) against the
unpartitioned model, the traced step (CUDA events), measured peak memory, BatchNorm running
statistics and a checkpoint round trip."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import autopart
from autopart.planning import profile_model
from tests.zoo import ZOO

pytestmark = pytest.mark.requires_cuda
TOL = {"rtol": 1e-5, "atol": 4e-5}
DEVICES = ["cuda:0", "cuda:0"]


def _on_cuda(args: tuple, target: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    return tuple(a.cuda() for a in args), target.cuda()


def _microbatched_step(reference: torch.nn.Module, args: tuple, target: torch.Tensor,
                       loss_fn: Any, m: int = 4) -> torch.Tensor:
    """Forward and backward of ``reference`` on the same ``m`` microbatches the pipeline runs
    (BatchNorm sees microbatches), gradients accumulated; returns the full-batch loss."""
    losses = []
    for a, t in zip(args[0].chunk(m), target.chunk(m), strict=True):
        loss = loss_fn(reference(a), t) / m
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses).sum()


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_compile_on_cuda_trains_like_the_unpartitioned_model(name: str) -> None:
    model, args, target, loss_fn = ZOO[name]()
    model = model.cuda()
    args, target = _on_cuda(args, target)
    reference = copy.deepcopy(model)
    pipe = autopart.compile(model, args, loss_fn=loss_fn, example_target=target,
                            devices=DEVICES, num_microbatches=4)
    assert pipe.plan.num_microbatches == 4 and len(pipe.plan.stages) >= 2
    costs = profile_model(copy.deepcopy(reference), args, devices=DEVICES[:1],
                          num_microbatches=4, cache=False).costs
    assert costs.source.startswith("measured:cuda")
    assert sum(n.fwd_us for n in costs.nodes) > 0
    loss = pipe.train_step(*args, target=target)
    torch.testing.assert_close(loss, _microbatched_step(reference, args, target, loss_fn), **TOL)
    ref = dict(reference.named_parameters())
    for pname, p in pipe.named_parameters():
        assert p.device.type == torch.device(DEVICES[0]).type, pname
        torch.testing.assert_close(p.grad, ref[pname].grad, **TOL, msg=pname)
    ref_buffers = dict(reference.named_buffers())
    for bname, b in pipe.named_buffers():  # BatchNorm running statistics
        torch.testing.assert_close(b, ref_buffers[bname], **TOL, msg=bname)


def test_traced_step_and_peak_memory_on_cuda(tmp_path: Path) -> None:
    model, args, target, loss_fn = ZOO["gpt2"]()
    model = model.cuda()
    args, target = _on_cuda(args, target)
    plan, profile = autopart.plan_model(model, args, loss_fn=loss_fn, example_target=target,
                                        devices=DEVICES, num_microbatches=4,
                                        schedule_kind="1f1b")
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan)
    pipe.train_step(*args, target=target)
    pipe.train_step(*args, target=target, trace=True)
    trace = pipe.last_trace
    assert trace.source.startswith("measured:cuda")
    m = pipe.plan.num_microbatches
    for rank in range(trace.num_ranks):
        forwards = [a for a in trace.actions(rank) if "F" in a]
        assert len(forwards) == m * len(pipe.plan.ranks[rank].stage_indices), trace.actions(rank)
    assert all(e.end_us >= e.start_us for e in trace.events)
    path = autopart.trace.save(trace, tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"]
    pipe.train_step(*args, target=target, measure_memory=True)
    peak = pipe.last_peak_memory_bytes.by_device["cuda:0"]
    summed = sum(r.peak_memory_bytes for r in pipe.plan.ranks)
    # both stages on cuda:0: the device's replayed peak, at most the ranks' peaks summed
    predicted = autopart.trace.predict(profile, plan).device_peak_bytes["cuda:0"]
    assert profile.runtime.ranks_per_core == 2.0
    assert 0 < peak
    assert peak <= predicted <= summed, (peak, predicted, summed)  # never an under-prediction


def test_checkpoint_round_trip_on_cuda(tmp_path: Path) -> None:
    model, args, target, loss_fn = ZOO["gpt2"]()
    model = model.cuda()
    args, target = _on_cuda(args, target)
    pipe = autopart.compile(model, args, loss_fn=loss_fn, example_target=target,
                            devices=DEVICES, num_microbatches=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.train_step(*args, target=target)
    opt.step()
    pipe.save(tmp_path / "ckpt", optimizer=opt)
    fresh, _, _, _ = ZOO["gpt2"]()
    restored = autopart.load(tmp_path / "ckpt", fresh.cuda(), args)
    for (n, p), (_, q) in zip(pipe.named_parameters(), restored.named_parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)


def test_steps_reuse_their_streams_and_follow_the_optimizer() -> None:
    """Three AdamW steps equal the unpartitioned model's, step by step (each step's stages
    wait for the optimizer's update on the default stream), and memory does not grow from
    step to step (streams, hence cuBLAS workspaces, are made once)."""
    model, args, target, loss_fn = ZOO["gpt2"]()
    model = model.cuda()
    args, target = _on_cuda(args, target)
    reference = copy.deepcopy(model)
    pipe = autopart.compile(model, args, loss_fn=loss_fn, example_target=target,
                            devices=DEVICES, num_microbatches=4, schedule="1f1b")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    held = []
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.train_step(*args, target=target)
        torch.testing.assert_close(loss, _microbatched_step(reference, args, target, loss_fn),
                                   **TOL)
        opt.step()
        ref_opt.step()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    ref = dict(reference.named_parameters())
    for pname, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref[pname], **TOL, msg=pname)
    assert held[2] - held[1] < 2**20, held  # nothing new is kept per step
