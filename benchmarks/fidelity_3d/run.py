"""Fidelity of 3D plans: predicted vs measured step time and peak memory on 4 gloo CPU ranks.

One profile of a GPT-2-like model (4 layers, n_embd 128, 4 heads, vocabulary 2048, global
batch 16 x 64 tokens) is taken for 4 ``cpu`` ranks as ``autopart.compile`` takes it under
torchrun (distributed backend, the host link measured and cached); on it the layout search
(:func:`autopart.planning.solve_world_layout`, 1F1B) plans each arm with its degrees fixed:
``pp2xdp2`` (tp 1, pp 2, dp 2, ZeRO-0), ``pp4`` (tp 1, pp 4, dp 1) and ``tp2xpp2`` (tp 2, pp 2,
dp 1). Four gloo ranks with one thread each then build the arms that this build's runtime can
run and run them alternately, step by step, in an order rotated each step
(:func:`autopart.apps.bench.run_arms`: median of ``--steps`` timed ``train_step`` calls, slowest
rank after a barrier, then one step with peak memory measured, AdamW's state held); the
whole run is repeated ``--repeats`` times in fresh processes. Per arm: the prediction, the
median over every timed step, each repeat's median and the spread (max - min of the timed
steps over their median).

    .venv/bin/python benchmarks/fidelity_3d/run.py [--steps 7] [--repeats 2] [--out DIR]

Writes ``results.json`` and ``results.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORLD = 4
WORKLOAD = "hf:GPT2LMHeadModel"
CONFIG = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 2048, "n_positions": 64,
          "batch": 16, "seq": 64}
ARMS = {"pp2xdp2": {"tp": 1, "dp": 2, "zero_stage": 0}, "pp4": {"tp": 1, "dp": 1},
        "tp2xpp2": {"tp": 2, "dp": 1, "zero_stage": 0}}


def _tp_runtime() -> bool:
    """Whether this build's distributed runtime runs tensor-parallel stages."""
    from autopart.runtime.distributed import DistributedPipeline

    return "tp_group" in inspect.signature(DistributedPipeline).parameters


def plan_arms() -> tuple[dict[str, Any], dict[str, Any]]:
    """Profile once for 4 CPU ranks; the plan of every arm, and the profile's facts."""
    from autopart import CompileOptions
    from autopart.apps.bench import load_workload
    from autopart.planning import model_heads, profile_model, solve_world_layout

    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    profile = profile_model(model, args, devices=["cpu"] * WORLD, loss_fn=loss_fn,
                            example_target=target, backend="distributed")
    plans = {name: solve_world_layout(profile, CompileOptions(schedule_kind="1f1b", **fixed),
                                      WORLD, num_heads=model_heads(model))
             for name, fixed in ARMS.items()}
    link = profile.host_link
    facts = {"cost_source": profile.costs.source,
             "link": None if link is None else {"latency_us": link.latency_us,
                                                "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s},
             "transfer_overhead_us": profile.runtime.transfer_overhead_us}
    return plans, facts


def _spread(steps: list[float]) -> float:
    return (max(steps) - min(steps)) / statistics.median(steps) if steps else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    from autopart.apps.bench import run_arms

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    plans, facts = plan_arms()
    runnable = {n: p for n, p in plans.items() if p.tp == 1 or _tp_runtime()}
    notes = {n: "not run: this build's distributed runtime has no tensor parallelism"
             for n in plans if n not in runnable}
    runs: list[dict[str, Any]] = []
    while len(runs) < opts.repeats:
        try:
            runs.append(run_arms(WORKLOAD, runnable, ranks=WORLD, steps=opts.steps,
                                 config=dict(CONFIG), single=False, trace=False))
        except Exception as exc:  # a tp plan the runtime refuses fails every rank's compile
            tp_arms = [n for n, p in runnable.items() if p.tp > 1 and n not in notes]
            if runs or not tp_arms:
                raise
            said = [line for line in str(exc).splitlines() if "PlanError" in line]
            for name in tp_arms:
                notes[name] = f"not run: {said[-1] if said else exc}".replace("|", "/")
                del runnable[name]
    rows = []
    for name, plan in plans.items():
        row: dict[str, Any] = {
            "arm": name, "tp": plan.tp, "pp": len(plan.ranks), "dp": plan.dp,
            "zero_stage": plan.zero_stage, "m": plan.num_microbatches,
            "cuts": [c.position for c in plan.cuts],
            "predicted_step_s": plan.predicted_step_time_us / 1e6,
            "predicted_peak_bytes": [r.peak_memory_bytes for r in plan.ranks]}
        if name not in runnable:
            row["measured"] = None
            row["note"] = notes[name]
        else:
            steps = [s for run in runs for s in run[name].steps_s]
            measured = statistics.median(steps)
            row.update(measured_step_s=measured,
                       repeat_medians_s=[statistics.median(run[name].steps_s) for run in runs],
                       step_spread=_spread(steps), steps_s=steps,
                       error=row["predicted_step_s"] / measured - 1,
                       measured_peak_bytes=runs[-1][name].peak_bytes)
        rows.append(row)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor()})",
            "torch": torch.__version__, "world": WORLD, "threads_per_rank": 1,
            "workload": {"spec": WORKLOAD, **CONFIG}, "steps": opts.steps,
            "repeats": opts.repeats, "load_average_before": load_before,
            "load_average_after": os.getloadavg(), **facts}
    out = Path(opts.out)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# fidelity_3d: {WORLD} gloo CPU ranks, {meta['date']}", "",
             f"{meta['machine']}, torch {meta['torch']}, 1 thread per rank; load average "
             f"{load_before[0]:.1f} before, {meta['load_average_after'][0]:.1f} after; "
             f"{opts.repeats} runs x {opts.steps} timed steps per arm.", "",
             "| arm | tp x pp x dp, ZeRO | m | predicted step | measured step (median) | "
             "repeat medians | spread | error | peak predicted / measured (MiB, per pp rank) |",
             "|---|---|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        layout = f"{r['tp']} x {r['pp']} x {r['dp']}, ZeRO-{r['zero_stage']}"
        pred = "/".join(f"{b / 2**20:.1f}" for b in r["predicted_peak_bytes"])
        if r.get("measured", True) is None:
            lines.append(f"| {r['arm']} | {layout} | {r['m']} | {r['predicted_step_s']:.3f} s "
                         f"| {r['note']} | | | | {pred} / - |")
            continue
        got = "/".join(f"{b / 2**20:.1f}" for b in r["measured_peak_bytes"])
        reps = ", ".join(f"{x:.3f}" for x in r["repeat_medians_s"])
        lines.append(f"| {r['arm']} | {layout} | {r['m']} | {r['predicted_step_s']:.3f} s | "
                     f"{r['measured_step_s']:.3f} s | {reps} | {r['step_spread']:.0%} | "
                     f"{r['error']:+.1%} | {pred} / {got} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
