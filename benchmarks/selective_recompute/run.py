"""Selective and op-level against full recompute on 2 gloo CPU ranks (pp 2): measured and
predicted per-rank peak memory and step time of the same cuts with no recompute, every
stage recomputing its whole forward, and every stage recomputing under the selective policy
(torch's selective activation checkpointing, torchtitan's op policy); then the solver's own
plans under the highest per-rank cap (2 MiB steps) at which the full policy's plan
recomputes a stage, solved with the full policy, with "auto" and with "op" (the solver's
per-node choice of what to keep), and the op plan's cuts under the selective policy.

    .venv/bin/python benchmarks/selective_recompute/run.py [--steps 7] [--small]

The default model is the demo's GPT-2 (12 layers, n_embd 768, vocab 50257, batch 8 x 128,
random weights); ``--small`` a 6-layer, n_embd 384 one. Writes ``results.json`` and
``results.md`` (``results_small.*`` with ``--small``) beside this file.
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
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

WORKLOAD = "hf:GPT2LMHeadModel"
DEMO = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "batch": 8,
        "seq": 128}
SMALL = {"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 8192, "batch": 8, "seq": 256}
M, KIND = 4, "1f1b"


def _plans(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arms' plans and what the solver was asked for the capped ones."""
    from autopart.apps.bench import load_workload
    from autopart.planning import profile_model
    from autopart.solver.predict import plan_at

    model, args, target, loss_fn = load_workload(WORKLOAD, dict(config))
    profile = profile_model(model, args, devices=["cpu", "cpu"], num_microbatches=M,
                            loss_fn=loss_fn, example_target=target, backend="distributed",
                            split_cost=False, selective_cost=True, cache=False)
    cluster = profile.cluster()
    fixed = dict(schedule_kind=KIND, num_microbatches=M, stages_per_rank=1)
    plain = profile.solve(**fixed, recompute=False)
    cuts = tuple(c.position for c in plain.cuts)
    plans = {"no recompute": plain}
    for policy in ("full", "selective"):
        plans[f"{policy}, every stage"] = plan_at(
            profile.costs, cluster, profile.options(**fixed, recompute_policy=policy), cuts,
            kind=KIND, num_microbatches=M, recompute=True, name=f"{policy} recompute")
    peak = {k: max(r.peak_memory_bytes for r in p.ranks) for k, p in plans.items()}
    # the highest cap (in 2 MiB steps down from no recompute's peak) under which the solver
    # with the full policy recomputes a stage rather than moving the cut: what the selective
    # policy is for
    from autopart.core.errors import InfeasiblePlanError

    cap = peak["no recompute"]
    while True:
        cap -= 2 * 2**20
        try:
            full = profile.solve(**fixed, recompute_policy="full", memory_cap_bytes=cap)
        except InfeasiblePlanError as exc:
            raise SystemExit(f"no cap makes the full policy recompute: {exc}") from None
        if any(st.recompute for st in full.stages):
            break
    plans["solver under cap, full"] = full
    plans["solver under cap, auto"] = profile.solve(**fixed, recompute_policy="auto",
                                                    memory_cap_bytes=cap)
    # the op-level decision under the same cap, and torch's selective-op policy (what
    # torchtitan ships) on the op plan's own cuts and recompute flags
    op = profile.solve(**fixed, recompute_policy="op", memory_cap_bytes=cap)
    plans["solver under cap, op"] = op
    # the op-level decision within the full-policy plan's own largest peak: what it gains at
    # the same memory (the cap above leaves room the full-policy plan does not use)
    tight = max(r.peak_memory_bytes for r in full.ranks)
    refused = None
    try:
        plans["solver under full's peak, op"] = profile.solve(**fixed, recompute_policy="op",
                                                              memory_cap_bytes=tight)
    except InfeasiblePlanError as exc:  # recorded: "op" should fit wherever "full" does
        refused = str(exc)
    plans["op's plan, selective policy"] = plan_at(
        profile.costs, cluster, profile.options(**fixed, recompute_policy="selective"),
        tuple(c.position for c in op.cuts), kind=KIND, num_microbatches=M,
        recompute=[st.recompute for st in op.stages], name="selective on the op plan")
    return plans, {"cap_mib": cap / 2**20, "full_peak_mib": tight / 2**20,
                   "op_at_full_peak_refused": refused,
                   "nodes": {nd.name: (nd.op, nd.output_bytes) for nd in profile.costs.nodes}}


def _decision(plan: Any, st: Any, nodes: dict[str, tuple[str, int]]) -> str:
    """What a stage recomputes: "no", the policy, and under "op" how many nodes it keeps
    and of which kinds (the three largest by bytes at the profiled batch)."""
    if not st.recompute:
        return "no"
    if plan.recompute_policy != "op":
        return plan.recompute_policy
    by_op: dict[str, int] = {}
    for name in st.recompute_kept:
        op, nbytes = nodes[name]
        short = op.split(".")[1] if op.count(".") >= 2 else op
        by_op[short] = by_op.get(short, 0) + nbytes
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:3]
    return (f"op: {len(st.recompute_kept)} of {st.num_nodes} kept ("
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in top) + ")")


def _rank(rank: int, world: int, port: int, paths: list[str], steps: int, config: dict,
          out: dict) -> None:
    import autopart
    from autopart.apps.bench import load_workload

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    pipes = []
    for path in paths:
        model, args, target, loss_fn = load_workload(WORKLOAD, dict(config))
        pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=path, backend="distributed")
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-5)
        pipe.train_step(*args, target=target)
        opt.step()
        opt.zero_grad()
        pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
        out[(rank, path, "peak")] = pipe.last_peak_memory_bytes.by_device["cpu"]
        opt.step()
        opt.zero_grad()
        pipes.append((pipe, opt, args, target))
    times: dict[int, list[float]] = {k: [] for k in range(len(paths))}
    for step in range(steps):  # the arms alternate step by step, order rotated
        order = list(range(len(pipes)))
        order = order[step % len(order):] + order[:step % len(order)]
        for k in order:
            pipe, opt, args, target = pipes[k]
            dist.barrier()
            t0 = time.perf_counter()
            pipe.train_step(*args, target=target)
            opt.step()
            opt.zero_grad()
            times[k].append(time.perf_counter() - t0)
    for k, path in enumerate(paths):
        out[(rank, path, "step")] = times[k]
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--small", action="store_true")
    a = parser.parse_args()
    config = SMALL if a.small else DEMO
    torch.set_num_threads(1)  # profiled as each rank runs: one thread on its core
    plans, asked = _plans(config)
    profile_nodes = asked.pop("nodes")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        paths = {}
        for k, (name, plan) in enumerate(plans.items()):
            paths[name] = os.path.join(tmp, f"arm{k}.json")
            plan.save(paths[name])
        out = manager.dict()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, list(paths.values()), a.steps, config, out), nprocs=2,
                 join=True)
        got = dict(out)
    rows = []
    for name, plan in plans.items():
        p = paths[name]
        steps = [max(t) for t in zip(*(got[(r, p, "step")] for r in range(2)), strict=True)]
        rows.append({
            "arm": name, "cuts": [c.position for c in plan.cuts],
            "recompute": [_decision(plan, st, profile_nodes) for st in plan.stages],
            "predicted_peak_mib": [r.peak_memory_bytes / 2**20 for r in plan.ranks],
            "measured_peak_mib": [got[(r, p, "peak")] / 2**20 for r in range(2)],
            "predicted_step_s": plan.predicted_step_time_us / 1e6,
            "measured_step_s": statistics.median(steps),
            "measured_step_range_s": [min(steps), max(steps)]})
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "python": platform.python_version(), "config": config, "steps": a.steps,
            "m": M, "schedule": KIND, "load_avg": os.getloadavg(), **asked}
    stem = "results_small" if a.small else "results"
    (HERE / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# selective_recompute ({meta['date']}, {meta['machine']}, torch {meta['torch']}, "
             f"{config}, m {M}, {KIND}, cap {asked['cap_mib']:.1f} MiB for the solver's arms "
             f"({asked['full_peak_mib']:.1f} MiB: the full-policy plan's largest peak), "
             f"load {meta['load_avg'][0]:.1f})", "",
             "| arm | cut | recompute per stage | predicted peak (rank 0, 1) | measured peak "
             "| predicted / measured | predicted step | measured step (median, range) |",
             "|---|---|---|---|---|---|---:|---:|"]
    for r in rows:
        ratio = ", ".join(f"{p / m:.2f}" for p, m in zip(r["predicted_peak_mib"],
                                                          r["measured_peak_mib"], strict=True))
        lo, hi = r["measured_step_range_s"]
        lines.append(
            f"| {r['arm']} | {r['cuts']} | {', '.join(r['recompute'])} | "
            + ", ".join(f"{x:.1f}" for x in r["predicted_peak_mib"]) + " MiB | "
            + ", ".join(f"{x:.1f}" for x in r["measured_peak_mib"]) + f" MiB | {ratio} | "
            f"{r['predicted_step_s']:.3f} s | {r['measured_step_s']:.3f} s "
            f"({lo:.3f}-{hi:.3f}) |")
    (HERE / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
