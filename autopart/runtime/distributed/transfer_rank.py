"""The distributed runtime's side of timing its cost per transfer: the tiny workload and its
steps, run by :func:`autopart.profiler.transfer_overhead.run_transfer_ranks`'s processes."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autopart.codegen import build_stages
from autopart.core.capture import capture
from autopart.core.plan import Plan
from autopart.core.signature import InputSignature, microbatch_inputs
from autopart.runtime.distributed.pipeline import DistributedPipeline
from autopart.runtime.host import tune_cpu_allocator

__all__ = ["workload", "time_steps", "WARMUP", "STEPS"]

#: Untimed and timed steps of the measured pipeline.
WARMUP, STEPS = 3, 15


def workload() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]:
    """The measured model: 8 x ``Linear(32, 32)`` (about 0.1 ms of compute per action), a
    batch of 64 x 32, mean-squared error; seeded, so both ranks and the planner build the
    same one."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    x = torch.randn(64, 32, generator=gen)
    y = torch.randn(64, 32, generator=gen)
    return model, x, y, torch.nn.functional.mse_loss


def time_steps(rank: int, plan_path: str) -> list[float]:
    """On rank ``rank`` of an initialised two-rank gloo group: build this rank's stages of
    the plan at ``plan_path`` (a plan of :func:`workload`) on the distributed runtime and
    time ``WARMUP + STEPS`` training steps, each the slower rank's after a barrier; the
    timed ones in s."""
    tune_cpu_allocator()
    model, x, y, loss_fn = workload()
    plan = Plan.load(plan_path)
    mb_args, mb_kwargs = microbatch_inputs((x,), {}, plan.num_microbatches)
    captured = capture(model, mb_args, mb_kwargs)
    device = torch.device("cpu")
    stages = build_stages(captured, plan, [device] * len(plan.ranks), ranks={rank})
    pipe = DistributedPipeline(model, stages, InputSignature.of(captured), device, loss_fn=loss_fn)
    times = []
    try:
        for i in range(WARMUP + STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(x, target=y)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= WARMUP:
                times.append(float(elapsed))
    finally:
        pipe.close()
    return times
