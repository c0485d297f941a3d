"""Receives posted at the start of a step against torch's placement, on gloo CPU ranks.

torch's schedule runtime posts each receive just before the action that needs it; the
distributed runtime on gloo posts them all when the step starts
(``DistributedPipeline.receives_first``, True on gloo). Both orders run the same compiled
pipelines here (the attribute set before each step), step by step in alternation: the plans of
``benchmarks/fidelity_3d`` (a GPT-2-like model, 4 layers, n_embd 128, vocabulary 2048,
global batch 16 x 64; the profile cached there is reused) -- ``pp2xdp2``, ``tp2xpp2`` and
``pp4`` on 4 ranks (two per core of this 2-core machine) and ``pp2`` on 2 ranks (a core
each). Per world, after two warm-up rounds, each timed round runs every plan once in each
order (the arms rotated each round); a step's time is the slowest rank's after a barrier.
Reported per arm: the median step of each order, their ratio, each order's spread
((max - min) / median) and whether the losses of the two orders were identical.

    .venv/bin/python benchmarks/early_receives/run.py [--steps 15] [--repeats 2] [--out DIR]

Writes ``results.json`` and ``results.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "fidelity_3d"))

ORDERS = ("torch", "receives_first")
WARMUP = 2


def _rank_main(rank: int, world: int, port: int, work: str) -> None:
    import torch.distributed as dist

    import autopart
    from autopart.apps.bench import load_workload
    from autopart.core.plan import Plan
    from autopart.runtime.host import tune_cpu_allocator

    spec = json.loads(Path(work, "spec.json").read_text())
    torch.set_num_threads(1)
    tune_cpu_allocator()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    model, args, target, loss_fn = load_workload(spec["workload"], spec["config"])
    arms = []
    for name in spec["names"]:
        plan = Plan.load(Path(work, f"{name}.json"))
        pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed")
        arms.extend((name, order, pipe) for order in ORDERS)
    steps: dict[str, dict[str, list[float]]] = {n: {o: [] for o in ORDERS} for n in spec["names"]}
    losses: dict[str, dict[str, list[float]]] = {n: {o: [] for o in ORDERS}
                                                 for n in spec["names"]}
    for i in range(WARMUP + spec["steps"]):
        for k in range(len(arms)):
            name, order, pipe = arms[(i + k) % len(arms)]
            pipe.receives_first = order == "receives_first"  # the same on every rank
            dist.barrier()
            t0 = time.perf_counter()
            loss = pipe.train_step(*args, target=target)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            for p in pipe.parameters():
                p.grad = None
            if i >= WARMUP:
                steps[name][order].append(float(elapsed))
                losses[name][order].append(float(loss))
    for _, _, pipe in arms[::2]:
        pipe.close()
    if rank == 0:
        Path(work, "result.json").write_text(json.dumps({"steps": steps, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, plans: dict[str, Any], steps: int) -> dict[str, Any]:
    """Every plan of ``plans`` in both orders on ``world`` spawned gloo processes."""
    import run as fidelity  # benchmarks/fidelity_3d/run.py
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autopart-receives-") as work:
        for name, plan in plans.items():
            plan.save(Path(work, f"{name}.json"))
        Path(work, "spec.json").write_text(json.dumps({
            "workload": fidelity.WORKLOAD, "config": fidelity.CONFIG, "names": list(plans),
            "steps": steps}))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank_main, args=(world, port, work), nprocs=world,
                           start_method="spawn")
        return json.loads(Path(work, "result.json").read_text())


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    import run as fidelity  # benchmarks/fidelity_3d/run.py

    torch.set_num_threads(1)
    loads = [os.getloadavg()[0]]
    _, plans, _, _ = fidelity.plan_arms()
    chosen = {4: {n: plans[4][n] for n in ("pp2xdp2", "tp2xpp2", "pp4")},
              2: {"pp2": plans[2]["pp2"]}}
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(opts.repeats):
        for world, arms in chosen.items():
            got = run_world(world, arms, opts.steps)
            loads.append(os.getloadavg()[0])
            for name in arms:
                runs.setdefault(name, []).append({
                    "steps_s": got["steps"][name], "losses": got["losses"][name]})
    rows = []
    for world, arms in chosen.items():
        for name, plan in arms.items():
            per = {o: [s for r in runs[name] for s in r["steps_s"][o]] for o in ORDERS}
            med = {o: statistics.median(per[o]) for o in ORDERS}
            rows.append({
                "ranks": world, "arm": name, "m": plan.num_microbatches,
                "tp_pp_dp": [plan.tp, len(plan.ranks), plan.dp],
                "median_s": med, "spread": {o: _spread(per[o]) for o in ORDERS},
                "repeat_medians_s": {o: [statistics.median(r["steps_s"][o])
                                         for r in runs[name]] for o in ORDERS},
                "ratio": med["receives_first"] / med["torch"],
                "same_losses": all(r["losses"]["torch"] == r["losses"]["receives_first"]
                                   for r in runs[name])})
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{len(os.sched_getaffinity(0))} usable",
            "torch": torch.__version__, "python": platform.python_version(),
            "steps": opts.steps, "repeats": opts.repeats, "load_average_1min": loads}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# early_receives: gloo CPU ranks, {meta['date']}", "",
             f"{meta['machine']}, Python {meta['python']}, torch {meta['torch']}, 1 thread per "
             f"rank; 1-minute load average {min(loads):.1f}-{max(loads):.1f}; "
             f"{opts.repeats} runs x {opts.steps} timed steps per arm and order, alternated.",
             "", "| ranks | arm | tp x pp x dp | m | torch's order | receives first | ratio "
             "| repeat medians (torch / first) | spread (torch / first) | same losses |",
             "|---:|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        med, rep, spr = r["median_s"], r["repeat_medians_s"], r["spread"]
        lines.append(
            f"| {r['ranks']} | {r['arm']} | {' x '.join(map(str, r['tp_pp_dp']))} | {r['m']} "
            f"| {med['torch']:.4f} s | {med['receives_first']:.4f} s | {r['ratio']:.3f} "
            f"| {', '.join(f'{x:.4f}' for x in rep['torch'])} / "
            f"{', '.join(f'{x:.4f}' for x in rep['receives_first'])} "
            f"| {spr['torch']:.0%} / {spr['receives_first']:.0%} | {r['same_losses']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
