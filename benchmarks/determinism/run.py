"""Same job, fresh processes: how many distinct plans come out, and what compile costs.

Each run is a new Python process that builds the model (seed 0), calls ``autopart.compile``
as ``autopart demo`` does and prints the plan it got, the compile's wall and CPU time and its
phase timings. ``cold`` runs each get an empty profile cache (``AUTOPART_CACHE_DIR`` a new
temporary folder); ``warm`` runs share one folder that a first, uncounted run fills. With
``--before PYTHON`` every run is repeated with that interpreter (e.g. the main branch's
virtual environment, whose editable autopart is the code before a change), the two
alternating run by run so that the load of a shared machine hits both alike.

    .venv/bin/python benchmarks/determinism/run.py --model demo --runs 3
    .venv/bin/python benchmarks/determinism/run.py --model small --runs 6 --out small.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: model name -> (GPT-2 config fields, batch, sequence length, stages)
MODELS: dict[str, tuple[dict[str, int], int, int, int]] = {
    # autopart demo's defaults: GPT-2 small (124 M), batch 8 x 128, 4 stages
    "demo": ({"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}, 8, 128, 4),
    # the test zoo's GPT-2: 4 layers, n_embd 64, vocab 512, batch 8 x 16, 2 stages
    "small": ({"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 512}, 8, 16, 2),
}


def worker(model_name: str) -> dict[str, Any]:
    """One compile in this process; what it chose and what it cost."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import autopart
    from autopart.apps.demo import gpt2_loss

    fields, batch, seq, stages = MODELS[model_name]
    torch.manual_seed(0)
    config = GPT2Config(**fields, n_positions=max(64, seq), resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    tokens = torch.randint(0, fields["vocab_size"], (batch, seq))  # (batch, seq)
    cpu0, t0 = time.process_time(), time.perf_counter()
    pipe = autopart.compile(model, (tokens,), loss_fn=gpt2_loss, devices=["cpu"] * stages)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    plan = pipe.plan
    return {
        "plan": {"schedule": plan.schedule_kind, "m": plan.num_microbatches,
                 "v": plan.stages_per_rank, "cuts": [c.position for c in plan.cuts],
                 "recompute": [s.recompute for s in plan.stages]},
        "predicted_step_s": round(plan.predicted_step_time_us / 1e6, 4),
        "compile_wall_s": round(wall, 2), "compile_cpu_s": round(cpu, 2),
        "phases_s": {k.removesuffix("_s"): round(v, 2) for k, v in pipe.timings_s.items()},
        "threads": torch.get_num_threads(),
    }


def split_factor(cache: Path) -> float | None:
    """The split's cost stored in a cache folder's profile file (None: none stored): a
    factor (before 2026-11-24) or µs per node; of a cost stored per microbatch size
    (``...@<rows>``, since 2026-11-25), the smallest microbatch's."""
    found: list[tuple[int, float]] = []
    for path in cache.glob("profile-*.json"):
        measures = json.loads(path.read_text()).get("measures", {})
        for name, value in measures.items():
            if name.startswith(("split_backward_factor", "split_backward_us_per_node")):
                rows = name.rpartition("@")[2]
                found.append((int(rows) if "@" in name and rows.isdigit() else 0, float(value)))
    return min(found)[1] if found else None


def launch(python: str, model: str, cache: Path) -> dict[str, Any]:
    """One fresh process of ``python`` compiling ``model`` with ``cache`` as its cache."""
    env = {**os.environ, "AUTOPART_CACHE_DIR": str(cache)}
    out = subprocess.run([python, str(Path(__file__).resolve()), "--worker", model],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"worker failed ({python}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["split_factor"] = split_factor(cache)
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Distinct plans (with counts) and medians of the times."""
    counts: dict[str, int] = {}
    for r in runs:
        sig = json.dumps(r["plan"], sort_keys=True)
        counts[sig] = counts.get(sig, 0) + 1
    phases = sorted({k for r in runs for k in r["phases_s"]})
    return {
        "runs": len(runs), "distinct_plans": len(counts),
        "plans": [{"plan": json.loads(k), "count": n} for k, n in counts.items()],
        "compile_wall_s_median": statistics.median(r["compile_wall_s"] for r in runs),
        "compile_cpu_s_median": statistics.median(r["compile_cpu_s"] for r in runs),
        "phases_s_median": {k: statistics.median(r["phases_s"].get(k, 0.0) for r in runs)
                            for k in phases},
        "predicted_step_s": [r["predicted_step_s"] for r in runs],
        "split_factors": [r["split_factor"] for r in runs],
    }


def markdown(results: list[dict[str, Any]]) -> str:
    """One table row per (file, arm, mode): distinct plans and compile times."""
    lines = ["| model | code | cache | runs | distinct plans | compile wall s (median) | "
             "compile CPU s (median) | profile s | split_cost s | solve s | split factors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for arm, modes in res["arms"].items():
            for mode, data in modes.items():
                s, ph = data["summary"], data["summary"]["phases_s_median"]
                lines.append(
                    f"| {res['model']} | {arm} | {mode} | {s['runs']} | {s['distinct_plans']} | "
                    f"{s['compile_wall_s_median']:.1f} | {s['compile_cpu_s_median']:.1f} | "
                    f"{ph.get('profile', 0):.2f} | {ph.get('split_cost', 0):.2f} | "
                    f"{ph.get('solve', 0):.1f} | {s['split_factors']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode and interpreter")
    parser.add_argument("--modes", default="cold,warm", help="comma list of cold, warm")
    parser.add_argument("--before", default=None,
                        help="a second interpreter to alternate with (the code before)")
    parser.add_argument("--out", default=str(HERE / "results.json"))
    parser.add_argument("--render", nargs="+", metavar="JSON",
                        help="only write results.md from these results files")
    args = parser.parse_args()
    if args.render:
        text = markdown([json.loads(Path(f).read_text()) for f in args.render])
        (HERE / "results.md").write_text(text)
        print(text)
        return
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    arms = {"after": sys.executable, **({"before": args.before} if args.before else {})}
    results: dict[str, Any] = {
        "model": args.model, "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "arms": {},
    }
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as shared:
            if mode == "warm":
                for arm, python in arms.items():  # fill each arm's cache; not counted
                    launch(python, args.model, Path(shared) / arm)
            runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
            for i in range(args.runs):
                order = list(arms.items()) if i % 2 == 0 else list(arms.items())[::-1]
                for arm, python in order:
                    if mode == "warm":
                        runs[arm].append(launch(python, args.model, Path(shared) / arm))
                    else:
                        with tempfile.TemporaryDirectory() as cold:
                            runs[arm].append(launch(python, args.model, Path(cold)))
                    r = runs[arm][-1]
                    print(f"{mode} {arm} {i}: {r['plan']} wall {r['compile_wall_s']} s, "
                          f"cpu {r['compile_cpu_s']} s, {r['phases_s']}, "
                          f"factor {r['split_factor']}", flush=True)
        for arm, arm_runs in runs.items():
            results["arms"].setdefault(arm, {})[mode] = {"summary": summarise(arm_runs),
                                                         "runs": arm_runs}
    import torch
    import transformers

    results["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    Path(args.out).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    for arm, modes in results["arms"].items():
        for mode, data in modes.items():
            s = data["summary"]
            print(f"{arm:6s} {mode:4s}: {s['distinct_plans']} distinct plan(s) in {s['runs']} "
                  f"runs; compile wall {s['compile_wall_s_median']:.1f} s, cpu "
                  f"{s['compile_cpu_s_median']:.1f} s (medians); phases {s['phases_s_median']}")


if __name__ == "__main__":
    main()
