"""Benchmark: solve a GPT-3-175B-shaped analytical CostGraph onto 64 H100s with the full search.

The model (96 layers, d_model 12288, 96 heads, seq 2048, vocab 50257; ``GPT2LMHeadModel``
config) is built on the meta device, captured at batch 1 and profiled analytically for an H100
SXM in bf16. ``solve()`` then searches everything it can: 8 microbatch counts, stages_per_rank,
all four schedule kinds and recompute (``schedule_kind``, ``stages_per_rank`` and ``recompute``
left at None). It is solved twice; the script records solve wall time (and the 1-minute load
average after each solve: the machine is shared), status, objective, bound, gap and the method
that certified it, node and candidate counts, and whether the two plan JSONs are identical
apart from ``solver.wall_s``.
Writes ``results.json`` and ``results.md``.

    .venv/bin/python benchmarks/solver_scale/run.py [--time-limit 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import transformers

from autopart.core.capture import capture
from autopart.core.cluster import PRESETS, Cluster
from autopart.core.errors import InfeasiblePlanError
from autopart.core.jsonio import write_text_atomic
from autopart.profiler import profile_analytical
from autopart.solver import SolveOptions, find_candidates, solve

HERE = Path(__file__).resolve().parent
RANKS = 64
BATCH = 1536  # GPT-3 175B's global batch (3.2M tokens / 2048)
MICROBATCHES = (64, 96, 128, 192, 256, 384, 512, 768)  # 8 divisors of 1536, all >= 64 ranks
CONFIG = dict(n_layer=96, n_embd=12288, n_head=96, n_positions=2048, vocab_size=50257,
              use_cache=False)


def _plan_json(plan: Any) -> str:
    d = plan.to_dict()
    d["solver"]["wall_s"] = 0.0
    return json.dumps(d, sort_keys=True)


def main(argv: list[str] | None = None) -> None:
    """Capture, profile, solve twice; print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT limit per solve, s")
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG)).to(torch.bfloat16)
    x = torch.zeros(1, CONFIG["n_positions"], dtype=torch.long, device="meta")
    captured = capture(model.train(), (x,))
    t1 = time.perf_counter()
    costs = profile_analytical(captured, None, PRESETS["h100-sxm"], dtype=torch.bfloat16)
    t2 = time.perf_counter()
    print(f"captured in {t1 - t0:.1f} s, profiled in {t2 - t1:.1f} s: {len(costs.nodes)} nodes",
          file=sys.stderr)

    cluster = Cluster.uniform(PRESETS["h100-sxm"], [f"cuda:{r}" for r in range(RANKS)])
    options = SolveOptions(batch_size=BATCH, microbatch_candidates=MICROBATCHES,
                           schedule_kind=None, stages_per_rank=None, recompute=None,
                           optimize="speed", time_limit_s=args.time_limit,
                           library_versions={"torch": torch.__version__,
                                             "autopart": version("autopart")})
    runs: list[dict[str, Any]] = []
    texts: list[str] = []
    for _ in range(2):
        s0 = time.perf_counter()
        try:
            plan = solve(costs, cluster, options)
        except InfeasiblePlanError as exc:
            runs.append({"status": "INFEASIBLE", "error": str(exc), "wall_s": time.perf_counter() - s0})
            texts.append(str(exc))
            continue
        wall = time.perf_counter() - s0
        texts.append(_plan_json(plan))
        runs.append({
            "status": plan.solver.status, "wall_s": wall, "solver_wall_s": plan.solver.wall_s,
            "objective": plan.solver.objective, "bound": plan.solver.bound, "gap": plan.solver.gap,
            "method": plan.solver.name, "load_avg_1min": os.getloadavg()[0],
            "predicted_step_time_us": plan.predicted_step_time_us,
            "bubble_fraction": plan.bubble_fraction, "num_microbatches": plan.num_microbatches,
            "schedule_kind": plan.schedule_kind, "stages_per_rank": plan.stages_per_rank,
            "recompute_stages": sum(st.recompute for st in plan.stages),
            "max_peak_memory_bytes": max(r.peak_memory_bytes for r in plan.ranks),
            "baselines": [{"name": b.name, "predicted_step_time_us": b.predicted_step_time_us,
                           "ratio": b.predicted_step_time_us / plan.predicted_step_time_us,
                           "peak_memory_bytes": b.peak_memory_bytes, "recompute": b.recompute,
                           "fits": b.fits}
                          for b in plan.baselines],
        })
    results = {
        "model": "GPT-3 175B shape (GPT2LMHeadModel: 96 layers, d 12288, 96 heads, seq 2048, "
                 "vocab 50257), bf16, meta device, batch 1536",
        "ranks": RANKS, "device_preset": "h100-sxm", "microbatch_candidates": list(MICROBATCHES),
        "nodes": len(costs.nodes),
        "candidates": len(find_candidates(costs, RANKS).positions),
        "params": sum(costs.param_numel[p] for p in costs.trainable),
        "capture_s": t1 - t0, "profile_s": t2 - t1, "runs": runs,
        "identical_plan_json": texts[0] == texts[1] if "INFEASIBLE" not in
        (runs[0]["status"], runs[1]["status"]) else None,
        "under_60_s": all(r["wall_s"] < 60 for r in runs),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "environment": {"machine": platform.machine(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "ortools": version("ortools"), "transformers": transformers.__version__},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out_dir / "results.json",
                      json.dumps(results, indent=2, sort_keys=True) + "\n")
    env = results["environment"]
    lines = [f"{env['machine']}, {env['cpus']} CPUs; Python {env['python']}, torch {env['torch']}, "
             f"ortools {env['ortools']}, transformers {env['transformers']}.", "",
             f"{results['nodes']} nodes, {results['candidates']} cut candidates, "
             f"{results['params'] / 1e9:.1f} B parameters; capture {results['capture_s']:.1f} s, "
             f"profile {results['profile_s']:.1f} s.", "",
             "| run | status | method | solve s | load avg | objective ms | bound ms | gap | "
             "step ms | m | schedule | v | recompute stages |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for i, r in enumerate(runs):
        if r["status"] == "INFEASIBLE":
            lines.append(f"| {i} | INFEASIBLE | | {r['wall_s']:.1f} | | | | | | | | | |")
            continue
        lines.append(f"| {i} | {r['status']} | {r['method']} | {r['wall_s']:.1f} | "
                     f"{r['load_avg_1min']:.1f} | {r['objective'] / 1e3:.1f} | "
                     f"{r['bound'] / 1e3:.1f} | {r['gap']:.2%} | "
                     f"{r['predicted_step_time_us'] / 1e3:.1f} | {r['num_microbatches']} | "
                     f"{r['schedule_kind']} | {r['stages_per_rank']} | {r['recompute_stages']} |")
    if runs[0]["status"] != "INFEASIBLE":
        lines += ["", "Baselines on the same costs (run 0; 1F1B, v = 1, same m):", "",
                  "| baseline | step ms | vs autopart | peak GiB | recompute | fits 80 GB |",
                  "|---|---:|---:|---:|---|---|"]
        for b in runs[0]["baselines"]:
            lines.append(f"| {b['name']} | {b['predicted_step_time_us'] / 1e3:.1f} | "
                         f"{b['ratio']:.2f}x | {b['peak_memory_bytes'] / 2**30:.1f} | "
                         f"{'all stages' if b['recompute'] else 'none'} | "
                         f"{'yes' if b['fits'] else 'no'} |")
    lines += ["", f"Identical plan JSON over both runs (ignoring solver.wall_s): "
                  f"{results['identical_plan_json']}; under 60 s: {results['under_60_s']}."]
    write_text_atomic(args.out_dir / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    if runs[0]["status"] == "INFEASIBLE":
        print(f"infeasible: {runs[0]['error']}", file=sys.stderr)


if __name__ == "__main__":
    main()
