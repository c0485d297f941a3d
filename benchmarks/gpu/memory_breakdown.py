"""Where a pipeline's peak device memory goes: the plan's per-rank prediction against
``torch.cuda.max_memory_allocated`` of one training step, split into what is resident before
the step (parameters, gradients, inputs), the cuBLAS workspaces the step's streams create,
and the step itself. Run it twice, once with ``CUDA_LAUNCH_BLOCKING=1``: a block freed on
one stream and used on another is returned to the caching allocator only once the host sees
the other stream's work done, so a host running ahead of the GPU holds more at once.

    python benchmarks/gpu/memory_breakdown.py [--model zoo-gpt2|fidelity-gpt2] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def allocated(device: str) -> int:
    """Bytes the caching allocator has handed out on ``device`` after its queued work (0 on
    ``cpu``)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.memory_allocated(device))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="zoo-gpt2", choices=["zoo-gpt2", "fidelity-gpt2"])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    import autopart

    dev = opts.device
    if opts.model == "zoo-gpt2":
        from tests.zoo import ZOO

        model, args, target, loss_fn = ZOO["gpt2"]()
        model, args, target = model.to(dev), tuple(a.to(dev) for a in args), target.to(dev)
    else:
        from fidelity_gpu import workload

        model, args, target, loss_fn = workload(dev)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    pipe = autopart.compile(copy.deepcopy(model), args, loss_fn=loss_fn, example_target=target,
                            devices=[dev, dev], num_microbatches=opts.m, schedule=opts.schedule)
    del model
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-5)
    rows = {}
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        before = allocated(dev)
        pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
        opt.step()
        rows[f"step{step}"] = {"resident_before": before,
                               "peak": pipe.last_peak_memory_bytes.by_device[dev],
                               "after": allocated(dev)}
    workspaces = 0
    if torch.device(dev).type == "cuda":
        held = allocated(dev)
        torch._C._cuda_clearCublasWorkspaces()
        workspaces = held - allocated(dev)
    plan = pipe.plan
    report = {
        "model": opts.model, "device": str(dev), "schedule": plan.schedule_kind,
        "m": plan.num_microbatches,
        "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "0"),
        "param_bytes": params,
        "predicted_rank_peaks": [r.peak_memory_bytes for r in plan.ranks],
        "predicted_stage_peaks": [s.predicted_peak_memory_bytes for s in plan.stages],
        "steps": rows, "cublas_workspace_bytes": workspaces,
        "torch": torch.__version__,
    }
    text = json.dumps(report)
    print(text)
    if opts.out:
        Path(opts.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
