"""One process training step by step, with glibc's default ``malloc`` and with the thresholds
``autopart.runtime.host.tune_cpu_allocator`` sets: step time and minor page faults.

Each arm runs in a fresh process (``malloc`` options hold for a process's life); arms
alternate, ``--launches`` times each. Writes ``results_allocator.json`` and ``.md``.

    [AUTOPART_PEERS_HEAD_VOCAB=50000] .venv/bin/python benchmarks/pipeline_cpu/allocator.py
        [--workloads resnet50 gpt2_head_heavy] [--launches 3] [--steps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ARMS = ("default", "tuned")
HEAD_VOCAB_ENV = "AUTOPART_PEERS_HEAD_VOCAB"  # gpt2_head_heavy's vocabulary (lm_workloads.py)


def child(name: str, arm: str, steps: int) -> dict[str, Any]:
    """Run in the arm's own process: ``steps`` timed training steps of workload ``name``
    (its m microbatches forward + backward, one thread) after one untimed step."""
    import torch

    from autopart.runtime.host import tune_cpu_allocator
    from benchmarks.pipeline_cpu.peers import catalog

    torch.set_num_threads(1)
    setting = tune_cpu_allocator() if arm == "tuned" else None
    if arm == "tuned" and setting is None:
        raise SystemExit("tune_cpu_allocator set nothing on this host (not glibc?)")
    w = catalog()[1][name]
    model, inputs, target, loss_fn = w.build()
    m = w.num_microbatches
    rows = inputs[0].shape[0] // m
    x = tuple(t[:rows] for t in inputs)  # one microbatch, (rows, ...) each
    y = target[:rows]
    times, faults = [], []
    for i in range(steps + 1):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for _ in range(m):
            loss_fn(model(*x), y).backward()
        if i:  # the first step is a warm-up
            times.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"steps_s": [round(t, 4) for t in times], "step_s": round(statistics.median(times), 4),
            "faults_per_step": int(statistics.median(faults)), "malloc": setting}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["resnet50", "gpt2_head_heavy"])
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "results_allocator.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        print(json.dumps(child(opts.child[0], opts.child[1], opts.steps)))
        return
    import torch

    t_start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    results: dict[str, Any] = {}
    for name in opts.workloads:
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        for launch in range(opts.launches):
            for arm in (ARMS if launch % 2 == 0 else ARMS[::-1]):
                out = subprocess.run([sys.executable, __file__, "--child", name, arm,
                                      "--steps", str(opts.steps)], env=env, check=True,
                                     capture_output=True, text=True)
                runs[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(name, arm, runs[arm][-1]["step_s"], runs[arm][-1]["faults_per_step"],
                      flush=True)
        med = {arm: statistics.median(r["step_s"] for r in runs[arm]) for arm in ARMS}
        results[name] = {"launches": runs, "step_s": med,
                         "tuned_over_default": round(med["tuned"] / med["default"], 4)}
    doc = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "python": platform.python_version(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join([*(f"{k}={os.environ[k]}" for k in (HEAD_VOCAB_ENV,)
                                  if k in os.environ),
                                "benchmarks/pipeline_cpu/allocator.py", *sys.argv[1:]]),
           "wall_s": round(time.perf_counter() - t_start, 1), "workloads": results}
    from autopart.core.jsonio import write_text_atomic

    write_text_atomic(opts.out, json.dumps(doc, indent=1) + "\n")
    lines = ["# One process, default malloc against tune_cpu_allocator\n",
             f"{doc['date']}, {doc['machine']}, Python {doc['python']}, torch {doc['torch']}; "
             f"one thread; `{doc['command']}`; medians of {opts.steps} steps per launch, "
             f"{opts.launches} launches per arm, arms alternated in fresh processes.\n",
             "| workload | default s | tuned s | tuned / default | minor faults per step, "
             "default / tuned |", "|---|---|---|---|---|"]
    for name, r in results.items():
        fd = statistics.median(x["faults_per_step"] for x in r["launches"]["default"])
        ft = statistics.median(x["faults_per_step"] for x in r["launches"]["tuned"])
        lines.append(f"| {name} | {r['step_s']['default']:.3f} | {r['step_s']['tuned']:.3f} | "
                     f"{r['tuned_over_default']:.3f} | {fd:,.0f} / {ft:,.0f} |")
    write_text_atomic(Path(opts.out).with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
