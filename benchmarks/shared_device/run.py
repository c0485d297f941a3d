"""Stages of the one-process runtime on one device: predicted vs measured step and peak.

A GPT-2-like model (4 layers, n_embd 256, 4 heads, vocabulary 8192, batch 16 x 128, fp32)
is planned for 2 and for 4 stages on ``--device`` (default ``cpu``; ``cuda:0`` on a GPU) and
run by the local runtime, which issues every stage from one thread. Per plan (gpipe m4,
1f1b m4 / m8, zero_bubble m8): the median step over ``--steps`` timed steps (plans
alternated step by step after two warm-up rounds) beside the plan's prediction with the
stages sharing the device (``RuntimeDescription.ranks_per_core`` = ranks per device, as
planning sets it) and the same plan replayed with a device each (``ranks_per_core`` 1, the
model before); then one step's measured peak (``measure_memory=True``, with AdamW's state)
beside the device's replayed peak (``Prediction.device_peak_bytes``) and the sum of the
ranks' peaks.

    .venv/bin/python benchmarks/shared_device/run.py [--steps 7] [--device cpu] [--out DIR]

Writes ``results.json`` and ``results.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PLANS = [("gpipe", 4), ("1f1b", 4), ("1f1b", 8), ("zero_bubble", 8)]


def workload(device: str) -> tuple[Any, torch.Tensor, Any]:
    """The model, its tokens (also the target) and the loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopart.apps.demo import gpt2_loss

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, 8192, (16, 128), device=device)
    return GPT2LMHeadModel(cfg).to(device), tokens, gpt2_loss


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_world(stages: int, device: str, steps: int) -> list[dict[str, Any]]:
    """Every plan of :data:`PLANS` on ``stages`` stages of ``device``: predictions, median
    step, peaks."""
    import autopart
    from autopart.trace import predict

    model, x, loss_fn = workload(device)
    _, profile = autopart.plan_model(model, (x,), devices=[device] * stages, loss_fn=loss_fn,
                                     example_target=x)
    own = dataclasses.replace(profile, runtime=dataclasses.replace(profile.runtime,
                                                                   ranks_per_core=1.0))
    arms = {}
    for kind, m in PLANS:
        plan = profile.solve(schedule_kind=kind, stages_per_rank=1, num_microbatches=m)
        pipe = autopart.compile(copy.deepcopy(model), (x,), loss_fn=loss_fn, plan=plan)
        arms[f"{kind} m{m}"] = (plan, pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-5))
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for i in range(steps + 2):
        for name in names[i % len(names):] + names[:i % len(names)]:
            _, pipe, opt = arms[name]
            opt.zero_grad()
            synchronize(device)
            t0 = time.perf_counter()
            pipe.train_step(x, target=x)
            synchronize(device)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
            opt.step()
    rows = []
    for name, (plan, pipe, opt) in arms.items():
        opt.zero_grad()
        pipe.train_step(x, target=x, measure_memory=True, optimizer=opt)
        key = "cpu" if torch.device(device).type == "cpu" else device
        measured_peak = pipe.last_peak_memory_bytes.by_device[key]
        pred = predict(profile, plan)
        med = statistics.median(times[name])
        shared_s = plan.predicted_step_time_us / 1e6
        own_s = predict(own, plan).step_time_us / 1e6
        device_peak = pred.device_peak_bytes.get(key, sum(pred.peak_memory_bytes))
        rows.append({"stages": stages, "plan": name, "ranks_per_device":
                     profile.runtime.ranks_per_core, "measured_step_s": med,
                     "spread": (max(times[name]) - min(times[name])) / med,
                     "predicted_shared_s": shared_s, "predicted_device_each_s": own_s,
                     "error_shared": shared_s / med - 1, "error_device_each": own_s / med - 1,
                     "measured_peak_bytes": measured_peak,
                     "predicted_device_peak_bytes": device_peak,
                     "predicted_summed_peak_bytes": sum(pred.peak_memory_bytes)})
        r = rows[-1]
        print(f"{stages} stages, {name}: measured {med * 1e3:.1f} ms (spread {r['spread']:.0%}); "
              f"shared {shared_s * 1e3:.1f} ms ({r['error_shared']:+.1%}), a device each "
              f"{own_s * 1e3:.1f} ms ({r['error_device_each']:+.1%}); peak measured "
              f"{measured_peak / 2**20:.1f} MiB, device {device_peak / 2**20:.1f} MiB "
              f"({device_peak / measured_peak - 1:+.1%}), summed "
              f"{r['predicted_summed_peak_bytes'] / 2**20:.1f} MiB "
              f"({r['predicted_summed_peak_bytes'] / measured_peak - 1:+.1%})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = [r for stages in (2, 4) for r in run_world(stages, opts.device, opts.steps)]
    load_after = os.getloadavg()[0]
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
           f"Python {platform.python_version()}, device {opts.device}, "
           f"{torch.get_num_threads()} intra-op threads; 1-minute load average "
           f"{load_before:.1f} before, {load_after:.1f} after")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"when": when, "environment": env,
                                                  "rows": rows}, indent=1) + "\n")
    lines = [f"# shared_device: {when}", "", env + f"; medians of {opts.steps} steps.", "",
             "| stages | plan | measured | shared (error) | a device each (error) | spread "
             "| peak measured | device peak (error) | summed peaks (error) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mib = 2**20
        lines.append(
            f"| {r['stages']} | {r['plan']} | {r['measured_step_s'] * 1e3:.1f} ms | "
            f"{r['predicted_shared_s'] * 1e3:.1f} ms ({r['error_shared']:+.1%}) | "
            f"{r['predicted_device_each_s'] * 1e3:.1f} ms ({r['error_device_each']:+.1%}) | "
            f"{r['spread']:.0%} | {r['measured_peak_bytes'] / mib:.1f} MiB | "
            f"{r['predicted_device_peak_bytes'] / mib:.1f} MiB "
            f"({r['predicted_device_peak_bytes'] / r['measured_peak_bytes'] - 1:+.1%}) | "
            f"{r['predicted_summed_peak_bytes'] / mib:.1f} MiB "
            f"({r['predicted_summed_peak_bytes'] / r['measured_peak_bytes'] - 1:+.1%}) |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
