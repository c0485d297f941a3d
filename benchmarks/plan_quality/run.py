"""Benchmark: autopart's predicted step time against four baseline partitioners on the same costs.

GPT-2 small, BERT-base, a Llama-2-7B-shaped model and ResNet-50 are built from their
transformers configs on the meta device (no weights, no downloads), captured, and profiled
analytically for an H100 SXM in bf16. Each is solved onto 2, 4 and 8 ranks; the plan's
``baselines`` (torchtitan uniform layers, DeepSpeed parameters, PiPPy equal size, torchgpipe
balance_by_time, priced by the solver with the same cost model) give the ratio
baseline / autopart. GPT-2 small on 4 ranks is also solved with ``optimize="memory"`` and
compared with ``"speed"``. Writes ``results.json`` and ``results.md``.

    .venv/bin/python benchmarks/plan_quality/run.py [--models gpt2-small,bert-base] [--ranks 2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import transformers

from autopart.core.capture import capture
from autopart.core.cluster import PRESETS, Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.errors import InfeasiblePlanError
from autopart.profiler import profile_analytical
from autopart.solver import SolveOptions, solve
from autopart.solver.baselines import run_baselines

HERE = Path(__file__).resolve().parent
PRESET = "h100-sxm"


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


# name -> (builder of (model, example input), full batch, description)
MODELS: dict[str, tuple[Callable[[int], tuple[torch.nn.Module, torch.Tensor]], int, str]] = {
    "gpt2-small": (lambda b: (transformers.GPT2LMHeadModel(transformers.GPT2Config(use_cache=False)),
                              _ids(b, 1024)),
                   32, "GPT2LMHeadModel 124M (12 layers, d 768), seq 1024"),
    "bert-base": (lambda b: (transformers.BertForMaskedLM(transformers.BertConfig()), _ids(b, 512)),
                  32, "BertForMaskedLM base (12 layers, d 768), seq 512"),
    "llama-2-7b": (lambda b: (transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, use_cache=False)),
        _ids(b, 2048)),
        8, "LlamaForCausalLM 7B shape (32 layers, d 4096, ffn 11008), seq 2048"),
    "resnet-50": (lambda b: (transformers.ResNetForImageClassification(transformers.ResNetConfig()),
                             torch.zeros(b, 3, 224, 224, dtype=torch.bfloat16, device="meta")),
                  64, "ResNetForImageClassification ResNet-50 config, 224x224"),
}


def profile(name: str) -> tuple[CostGraph, float]:
    """Build ``name`` on meta in bf16, capture it at its full batch, profile for h100-sxm."""
    build, batch, _ = MODELS[name]
    t0 = time.perf_counter()
    with torch.device("meta"):
        model, x = build(batch)
    model = model.to(torch.bfloat16).train()
    costs = profile_analytical(capture(model, (x,)), None, PRESETS[PRESET], dtype=torch.bfloat16)
    return costs, time.perf_counter() - t0


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "autopart": version("autopart")}


def solve_case(costs: CostGraph, ranks: int, optimize: str, time_limit_s: float) -> dict[str, Any]:
    """Solve onto ``ranks`` H100s; the plan's numbers, its baselines and their ratios."""
    cluster = Cluster.uniform(PRESETS[PRESET], [f"cuda:{r}" for r in range(ranks)])
    options = SolveOptions(batch_size=costs.batch_size, optimize=optimize,
                           time_limit_s=time_limit_s, library_versions=_versions())
    t0 = time.perf_counter()
    try:
        plan = solve(costs, cluster, options)
    except InfeasiblePlanError as exc:
        return {"ranks": ranks, "optimize": optimize, "status": "INFEASIBLE", "error": str(exc),
                "solve_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    step = plan.predicted_step_time_us
    baselines = [{**asdict(b), "ratio": b.predicted_step_time_us / step if step else None}
                 for b in plan.baselines]
    cuts = {b.name: list(b.cuts) if b.cuts is not None else b.reason
            for b in run_baselines(costs, plan.num_stages)}
    return {
        "ranks": ranks, "optimize": optimize, "status": plan.solver.status, "solve_s": wall,
        "predicted_step_time_us": step, "bubble_fraction": plan.bubble_fraction,
        "max_peak_memory_bytes": max(r.peak_memory_bytes for r in plan.ranks),
        "num_microbatches": plan.num_microbatches, "schedule_kind": plan.schedule_kind,
        "stages_per_rank": plan.stages_per_rank,
        "recompute": [st.recompute for st in plan.stages],
        "gap": plan.solver.gap, "cuts": [c.position for c in plan.cuts],
        "baselines": baselines, "baseline_cuts": cuts,
        "never_worse": all(b["ratio"] >= 1 - 1e-9 for b in baselines) if baselines else None,
        "pareto": [p if isinstance(p, dict) else asdict(p) for p in getattr(plan, "pareto", ())],
    }


def environment() -> dict[str, Any]:
    """Machine and library versions the numbers were taken with."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                                capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "ortools": version("ortools"),
            "transformers": transformers.__version__, "autopart_commit": commit,
            "device_preset": PRESET}


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables."""
    env = results["environment"]
    names = ["uniform_layers", "deepspeed_parameters", "pippy_equal_size", "torchgpipe_balance_by_time"]
    lines = [f"Machine: {env['machine']}, {env['cpus']} CPUs; Python {env['python']}, torch "
             f"{env['torch']}, ortools {env['ortools']}, transformers {env['transformers']}; "
             f"autopart {env['autopart_commit']}; analytical {env['device_preset']} bf16 costs.", "",
             "Step time in ms (predicted); in brackets baseline / autopart; `-` = baseline not "
             "applicable or not reported by the solver; `r` = the baseline fits only with every "
             "stage recomputing; `!` = it does not fit 80 GB even so.", "",
             "| model | ranks | autopart ms | m | schedule | v | gap | " + " | ".join(names) + " |",
             "|---|---:|---:|---:|---|---:|---:|" + "---:|" * len(names)]
    for model, cases in results["models"].items():
        for c in cases["speed"]:
            if c["status"] == "INFEASIBLE":
                lines.append(f"| {model} | {c['ranks']} | infeasible | | | | |" + " |" * len(names))
                continue
            by_name = {b["name"]: b for b in c["baselines"]}
            cells = [f"{by_name[n]['predicted_step_time_us'] / 1e3:.2f} ({by_name[n]['ratio']:.2f}x)"
                     + ("r" if by_name[n].get("recompute") else "")
                     + ("" if by_name[n].get("fits", True) else "!")
                     if n in by_name else "-" for n in names]
            lines.append(f"| {model} | {c['ranks']} | {c['predicted_step_time_us'] / 1e3:.2f} | "
                         f"{c['num_microbatches']} | {c['schedule_kind']} | {c['stages_per_rank']} | "
                         f"{c['gap']:.1%} | " + " | ".join(cells) + " |")
    mv = results.get("memory_vs_speed")
    if mv:
        lines += ["", "GPT-2 small, 4 ranks, optimize=speed vs optimize=memory:", "",
                  "| optimize | step ms | largest rank peak GiB | m | schedule |", "|---|---:|---:|---:|---|"]
        for key in ("speed", "memory"):
            c = mv[key]
            if c["status"] == "INFEASIBLE":
                lines.append(f"| {key} | infeasible | | | |")
                continue
            lines.append(f"| {key} | {c['predicted_step_time_us'] / 1e3:.2f} | "
                         f"{c['max_peak_memory_bytes'] / 2**30:.2f} | {c['num_microbatches']} | "
                         f"{c['schedule_kind']} |")
        if "peak_reduction" in mv:
            lines += ["", f"Largest rank peak {mv['peak_reduction']:+.1%} for {mv['step_time_cost']:+.1%} "
                          "step time."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Profile, solve, write ``results.json`` and ``results.md`` next to this script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--ranks", default="2,4,8", help="comma-separated rank counts")
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT limit per solve, s")
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--profiles-dir", type=Path, default=None,
                        help="also save each CostGraph here (input for `autopart plan`)")
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    results: dict[str, Any] = {"environment": environment(), "models": {}}
    for name in args.models.split(","):
        costs, profile_s = profile(name)
        print(f"{name}: {len(costs.nodes)} nodes, profiled in {profile_s:.1f} s", file=sys.stderr)
        if args.profiles_dir is not None:
            costs.save(args.profiles_dir / f"{name}.costgraph.json")
        cases = [solve_case(costs, r, "speed", args.time_limit) for r in ranks]
        for c in cases:
            print(f"  {c['ranks']} ranks: {c.get('predicted_step_time_us', 'infeasible')} us, "
                  f"{len(c.get('baselines', []))} baselines, {c['solve_s']:.1f} s", file=sys.stderr)
        results["models"][name] = {"description": MODELS[name][2], "batch_size": costs.batch_size,
                                   "nodes": len(costs.nodes), "profile_s": profile_s,
                                   "params": sum(costs.param_numel[p] for p in costs.trainable),
                                   "speed": cases}
        if name == "gpt2-small" and 4 in ranks:
            speed = next(c for c in cases if c["ranks"] == 4)
            memory = solve_case(costs, 4, "memory", args.time_limit)
            mv: dict[str, Any] = {"speed": speed, "memory": memory}
            if "INFEASIBLE" not in (speed["status"], memory["status"]):
                mv["peak_reduction"] = memory["max_peak_memory_bytes"] / speed["max_peak_memory_bytes"] - 1
                mv["step_time_cost"] = memory["predicted_step_time_us"] / speed["predicted_step_time_us"] - 1
            results["memory_vs_speed"] = mv
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    table = markdown(results)
    (args.out_dir / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
