"""Megatron's sequence parallelism on 2 gloo CPU ranks (tp 2): measured and predicted per-rank
peak memory and step time, with and without it, each without recompute and with the stage
recomputing selectively (its all-gathers run again in the backward), on a GPT-2-like model
whose layer norms' and residuals' activations are a visible share of the peak (random
weights).

    .venv/bin/python benchmarks/sequence_parallel/run.py [--steps 5]

Writes ``results.json`` and ``results.md`` beside this file.
"""

from __future__ import annotations

import argparse
import dataclasses
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

WORKLOAD = "hf:GPT2LMHeadModel"
CONFIG = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 2048, "n_positions": 512,
          "batch": 8, "seq": 512}


def _profile() -> object:
    from autopart.apps.bench import load_workload
    from autopart.planning import profile_model, with_collective_overhead, with_selective_cost

    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    profile = profile_model(model, args, devices=["cpu", "cpu"], num_microbatches=2,
                            loss_fn=loss_fn, example_target=target, backend="distributed",
                            split_cost=False, low_batch=False, cache=False)
    profile = with_collective_overhead(profile, 2)  # as compile() prices tp on CPU ranks
    return with_selective_cost(profile, args)  # for the selective arms, as compile() does


def _plan(profile: object, sequence_parallel: bool, selective: bool = False) -> object:
    from autopart.apps.bench import load_workload
    from autopart.layout_planning import layout_request, model_heads
    from autopart.options import CompileOptions
    from autopart.solver.layout_search import evaluate_layout, layout_candidates

    model = load_workload(WORKLOAD, dict(CONFIG))[0]
    spec = profile.cluster().devices[0]
    options = profile.options(schedule_kind="1f1b", num_microbatches=2, stages_per_rank=1,
                              recompute=selective,
                              recompute_policy="selective" if selective else "full",
                              optimizer_state_bytes_per_param_byte=2.0)
    layout = layout_request(CompileOptions(tp=2, dp=1, zero_stage=0,
                                           sequence_parallel=sequence_parallel), 2, spec,
                            model_heads(model), profile.runtime.collective_bandwidth_bytes_per_s)
    cand = next(c for c in layout_candidates(profile.costs, spec, options, layout)
                if (c.tp, c.pp, c.dp) == (2, 1, 1))
    plan = evaluate_layout(profile.costs, spec, options, layout, cand, positions=())
    return dataclasses.replace(
        plan, ranks=tuple(dataclasses.replace(r, device="cpu") for r in plan.ranks),
        stages=tuple(dataclasses.replace(s, device="cpu") for s in plan.stages))


def _rank(rank: int, world: int, port: int, paths: list[str], steps: int, out: dict) -> None:
    import autopart
    from autopart.apps.bench import load_workload

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    pipes = []
    for path in paths:
        model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
        pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=path, backend="distributed")
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-5)
        pipe.train_step(*args, target=target)
        opt.step()
        opt.zero_grad()
        pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
        out[(rank, path, "peak")] = pipe.last_peak_memory_bytes.by_device["cpu"]
        pipes.append((pipe, opt, args, target))
    times: dict[int, list[float]] = {k: [] for k in range(len(paths))}
    for _ in range(steps):  # the arms alternate step by step
        for k, (pipe, opt, args, target) in enumerate(pipes):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(*args, target=target)
            opt.step()
            opt.zero_grad()
            times[k].append(time.perf_counter() - t0)
    for k, path in enumerate(paths):
        out[(rank, path, "step")] = statistics.median(times[k])
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    a = parser.parse_args()
    torch.set_num_threads(1)  # profiled as each rank runs: one thread on its core
    profile = _profile()
    plans = {"tp2": _plan(profile, False), "tp2 + sequence parallel": _plan(profile, True),
             "tp2, selective recompute": _plan(profile, False, True),
             "tp2 + sequence parallel, selective recompute": _plan(profile, True, True)}
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        paths = {}
        for name, plan in plans.items():
            paths[name] = os.path.join(tmp, name.replace(" ", "_") + ".json")
            plan.save(paths[name])
        out = manager.dict()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, list(paths.values()), a.steps, out), nprocs=2,
                 join=True)
        got = dict(out)
    rows = []
    for name, plan in plans.items():
        p = paths[name]
        rows.append({"arm": name,
                     "predicted_peak_mib": plan.ranks[0].peak_memory_bytes / 2**20,
                     "measured_peak_mib": [got[(r, p, "peak")] / 2**20 for r in range(2)],
                     "predicted_step_s": plan.predicted_step_time_us / 1e6,
                     "measured_step_s": max(got[(r, p, "step")] for r in range(2))})
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "python": platform.python_version(), "config": CONFIG, "steps": a.steps}
    (HERE / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# sequence_parallel ({meta['date']}, {meta['machine']}, torch {meta['torch']})", "",
             "| arm | predicted peak | measured peak (tp rank 0, 1) | predicted step | "
             "measured step (median) |", "|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['predicted_peak_mib']:.1f} MiB | "
                     + ", ".join(f"{x:.1f}" for x in r["measured_peak_mib"]) + " MiB | "
                     f"{r['predicted_step_s']:.3f} s | {r['measured_step_s']:.3f} s |")
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
