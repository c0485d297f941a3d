"""Benchmark: `autopart plan` with the (tp, pp, dp, ZeRO) layout search at cluster scale.

GPT shapes of 7B, 175B and 1T parameters (``GPT2LMHeadModel`` configs, sequence 2048,
vocabulary 50,304, bf16) are profiled analytically for an H100 SXM as a user would,
``autopart profile hf:GPT2LMHeadModel ... --device h100`` on the meta device, then planned
with ``autopart plan PROFILE --cluster h100-sxm:N --batch-size B`` (the CLI's default 3D
search: tp, pp, dp, ZeRO stage, schedule, v, m and recompute all chosen) for N = 1024, 3072
and 8192 GPUs and a global batch of one sequence per GPU. Each plan is timed end to end
(the command's wall time, start-up included) and solved twice: the two plan files must be
identical apart from ``solver.wall_s``. Target: every plan under 60 s on a 2-core CPU.

    .venv/bin/python benchmarks/layout_scale/run.py [--gpus 1024,3072,8192] [--shapes 7b,175b,1t]

Writes ``results.json`` and ``results.md`` (profiles are cached under ``--cache``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AUTOPART = str(Path(sys.executable).with_name("autopart"))
SEQ, VOCAB = 2048, 50304
#: name -> (layers, hidden, heads): GPT-3's 6.7B and 175B (Brown et al., 2020, Table 2.1),
#: Megatron-LM's 1T (Narayanan et al., SC'21, Table 1).
SHAPES = {"7b": (32, 4096, 32), "175b": (96, 12288, 96), "1t": (128, 25600, 160)}


def _profile(name: str, cache: Path) -> tuple[Path, float]:
    """The shape's analytical profile for h100 (cached), and the seconds it took."""
    layers, hidden, heads = SHAPES[name]
    out = cache / f"gpt_{name}.profile.json"
    if out.exists():
        return out, 0.0
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    subprocess.run([AUTOPART, "profile", "hf:GPT2LMHeadModel", "--config", f"n_layer={layers}",
                    "--config", f"n_embd={hidden}", "--config", f"n_head={heads}",
                    "--config", f"n_positions={SEQ}", "--config", f"vocab_size={VOCAB}",
                    "--batch-size", "1", "--seq-len", str(SEQ), "--dtype", "bfloat16",
                    "--device", "h100", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    return out, time.perf_counter() - t0


def _plan(profile: Path, gpus: int, out: Path) -> float:
    """Seconds ``autopart plan`` takes for ``gpus`` H100s, one sequence per GPU."""
    t0 = time.perf_counter()
    proc = subprocess.run([AUTOPART, "plan", str(profile), "--cluster", f"h100-sxm:{gpus}",
                           "--batch-size", str(gpus), "--out", str(out)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"autopart plan failed for {profile.name} on {gpus}: "
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall


def _without_wall(path: Path) -> dict[str, Any]:
    plan = json.loads(path.read_text())
    plan["solver"]["wall_s"] = 0.0
    return plan


def write_results(rows: list[dict[str, Any]], out_dir: Path) -> None:
    """``results.json`` and ``results.md`` for the rows measured so far."""
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs; Python {platform.python_version()}, "
               f"torch {version('torch')}, ortools {version('ortools')}, "
               f"transformers {version('transformers')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"machine": machine, "rows": rows},
                                                     indent=1) + "\n")
    lines = [machine, "", "| shape | GPUs | batch | plan s (2 runs) | same JSON | tp | pp | dp | "
             "ZeRO | schedule | v | m | step s | gap |", "|---|---:|---:|---|---|---:|---:|---:|"
             "---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['gpus']} | {r['batch']} | "
                     f"{r['plan_s'][0]} / {r['plan_s'][1]} | {r['same_json']} | {r['tp']} | "
                     f"{r['pp']} | {r['dp']} | {r['zero_stage']} | {r['schedule_kind']} | "
                     f"{r['stages_per_rank']} | {r['num_microbatches']} | {r['step_s']:.3f} | "
                     f"{100 * r['gap']:.1f}% |")
    worst = max(w for r in rows for w in r["plan_s"])
    lines += ["", f"Slowest plan: {worst:.1f} s; under 60 s: {worst < 60}; identical JSON on every "
              f"row: {all(r['same_json'] for r in rows)}."]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1024,3072,8192", help="comma-separated GPU counts")
    parser.add_argument("--shapes", default="7b,175b,1t", help=f"among {sorted(SHAPES)}")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args()
    rows = []
    for name in args.shapes.split(","):
        profile, profile_s = _profile(name, args.cache)
        for gpus in (int(g) for g in args.gpus.split(",")):
            first, second = args.cache / f"{name}_{gpus}_a.plan.json", \
                args.cache / f"{name}_{gpus}_b.plan.json"
            walls = [_plan(profile, gpus, first), _plan(profile, gpus, second)]
            plan = _without_wall(first)
            rows.append({
                "shape": name, "gpus": gpus, "batch": gpus, "profile_s": round(profile_s, 1),
                "plan_s": [round(w, 1) for w in walls],
                "same_json": plan == _without_wall(second),
                "tp": plan["tp"], "pp": len(plan["ranks"]), "dp": plan["dp"],
                "zero_stage": plan["zero_stage"], "schedule_kind": plan["schedule_kind"],
                "stages_per_rank": plan["stages_per_rank"],
                "num_microbatches": plan["num_microbatches"],
                "step_s": plan["predicted_step_time_us"] / 1e6, "gap": plan["solver"]["gap"]})
            print(json.dumps(rows[-1]), flush=True)
            write_results(rows, args.out_dir)  # after every row: a stopped run keeps its rows


if __name__ == "__main__":
    main()
