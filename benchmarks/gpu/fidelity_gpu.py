"""Fidelity on one GPU: 4 stages on one device (CUDA streams), predicted vs measured.

The GPT-2-like model of ``benchmarks/fidelity`` (wider: n_embd 768, batch 32 x 256) is
profiled on ``cuda:0`` and planned for 4 stages on that one device; each plan of a small grid
(m in {4, 8, 16}; gpipe, 1f1b, zero_bubble) and the solver's own choice is run by the local
runtime (one process, a compute and a copy stream per stage), plans alternated step by
step. Per plan: median of ``--steps`` steps (``torch.cuda.synchronize`` around each), one
traced step (CUDA events), one step's ``torch.cuda.max_memory_allocated``. Not run in CI.

    python benchmarks/gpu/fidelity_gpu.py [--steps 10] [--out benchmarks/gpu/out]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GRID = [("gpipe", 4), ("1f1b", 4), ("1f1b", 8), ("1f1b", 16), ("zero_bubble", 8)]


def workload(device: str = "cuda:0", small: bool = False) -> tuple[Any, ...]:
    """The GPT-2-like model (12 x 768, vocab 32768, batch 32 x 256, fp32) on ``device``;
    ``small`` (2 x 64, vocab 512, batch 32 x 16) is for checking the script without a GPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopart.apps.demo import gpt2_loss

    torch.manual_seed(0)
    layers, width, heads, vocab, batch, seq = ((2, 64, 4, 512, 32, 16) if small
                                               else (12, 768, 12, 32768, 32, 256))
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                     n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    return GPT2LMHeadModel(cfg).to(device), (tokens,), tokens, gpt2_loss


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on ``cpu``)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: str) -> str:
    """The GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).with_name("out")))
    parser.add_argument("--device", default="cuda:0",
                        help="cpu (with --small) checks the script on a machine without a GPU")
    parser.add_argument("--small", action="store_true", help="a 2-layer model, for checking")
    opts = parser.parse_args()
    import copy

    import autopart
    from autopart.apps.figures import gantt
    from autopart.trace import predict

    dev = opts.device
    if torch.device(dev).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs one GPU (or --device cpu --small)")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    devices = [dev] * 4
    model, args, target, loss_fn = workload(dev, opts.small)
    solver_plan, profile = autopart.plan_model(model, args, devices=devices, loss_fn=loss_fn,
                                               example_target=target)
    plans = {"solver": solver_plan}
    for kind, m in GRID:
        plans[f"{kind} m{m}"] = profile.solve(schedule_kind=kind, stages_per_rank=1,
                                              num_microbatches=m)
    arms = {}
    for name, plan in plans.items():
        pipe = autopart.compile(copy.deepcopy(model), args, loss_fn=loss_fn, plan=plan)
        arms[name] = (pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-5))
    times: dict[str, list[float]] = {n: [] for n in arms}
    names = list(arms)
    for i in range(opts.steps + 2):
        for name in names[i % len(names):] + names[:i % len(names)]:
            pipe, opt = arms[name]
            opt.zero_grad()
            synchronize(dev)
            t0 = time.perf_counter()
            pipe.train_step(*args, target=target)
            synchronize(dev)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
            opt.step()
    rows = []
    for name, (pipe, opt) in arms.items():
        opt.zero_grad()
        pipe.train_step(*args, target=target, trace=True)
        opt.zero_grad()
        pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
        plan = plans[name]
        pred = predict(profile, plan)
        measured = statistics.median(times[name])
        rows.append({"plan": name, "schedule": plan.schedule_kind,
                     "num_microbatches": plan.num_microbatches,
                     "predicted_step_s": plan.predicted_step_time_us / 1e6,
                     "measured_step_s": measured,
                     "step_error": plan.predicted_step_time_us / 1e6 / measured - 1,
                     "predicted_peak_bytes_device": sum(r.peak_memory_bytes for r in plan.ranks),
                     "measured_peak_bytes_device": pipe.last_peak_memory_bytes.by_device[dev]})
        if name == "solver":
            pipe.last_trace.save(out / "trace_solver.json")
            gantt(out / "timeline_gpu.png", [("predicted", pred.trace),
                                             ("measured", pipe.last_trace)],
                  title=f"one {device_name(dev)}, 4 stages, solver's plan")
    report = {"device": device_name(dev), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(), "rows": rows}
    (out / "fidelity_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        print(f"{r['plan']:>16}: predicted {r['predicted_step_s']:.4f} s, measured "
              f"{r['measured_step_s']:.4f} s ({r['step_error']:+.1%}); peak predicted "
              f"{r['predicted_peak_bytes_device'] / 2**30:.2f} GiB, measured "
              f"{r['measured_peak_bytes_device'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
