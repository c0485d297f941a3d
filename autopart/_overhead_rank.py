"""One of the two processes of :func:`autopart.runtime_overhead.run_tiny_pipeline`:
``python -m autopart._overhead_rank RANK STORE OUT PLAN``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopart
from autopart.core.jsonio import write_text_atomic
from autopart.core.plan import Plan
from autopart.profiler.links import one_way_times
from autopart.runtime.host import tune_cpu_allocator
from autopart.runtime_overhead import STEPS, WARMUP, workload


def main(rank: int, store: str, out: str, plan_path: str) -> None:
    """Time the link to the other rank (:func:`autopart.profiler.links.one_way_times`),
    compile the plan at ``plan_path`` on the distributed backend and time ``WARMUP + STEPS``
    steps (each the slower rank's, after a barrier); rank 0 writes
    ``{"steps_s": [...], "one_way_us": [...]}`` to ``out``."""
    torch.set_num_threads(1)  # as each pipeline rank runs on CPU
    tune_cpu_allocator()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        one_way = one_way_times(rank)
        model, x, y, loss_fn = workload()
        pipe = autopart.compile(model, (x,), loss_fn=loss_fn, plan=Plan.load(plan_path),
                                backend="distributed")
        times = []
        for i in range(WARMUP + STEPS):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(x, target=y)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= WARMUP:
                times.append(float(elapsed))
        pipe.close()
        if rank == 0:
            write_text_atomic(Path(out), json.dumps({"steps_s": times, "one_way_us": one_way}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
