"""Fidelity of 3D plans: predicted vs measured step time on 4 and 2 gloo CPU ranks.

One profile of a GPT-2-like model (4 layers, n_embd 128, 4 heads, vocabulary 2048, global
batch 16 x 64 tokens) is taken for 4 ``cpu`` ranks as ``autopart.compile`` takes it under
torchrun (distributed backend, the host link measured and cached). Each arm's degrees are
fixed and the layout search (:func:`autopart.layout_planning.solve_world_layout`, 1F1B) plans it
with every rank on a core of its own, which gives a real pipeline; that plan runs, and is
priced again with the world's ranks per core (this process's CPU affinity:
:func:`autopart.planning.cpu_ranks_per_core`) by
:func:`autopart.solver.layout_predict.predict_layout`. On 4 ranks: ``pp2xdp2`` (tp 1, pp 2,
dp 2, ZeRO-0), ``tp2xpp2`` (tp 2, pp 2, dp 1) and ``pp4``; on 2 ranks: ``tp2``, ``dp2`` and
``pp2``. (On shared cores the search itself prefers other plans, e.g. an empty first stage:
they are reported, not run.) Each world's arms run alternately, step by step, in an order
rotated each step (:func:`autopart.apps.bench.run_arms`: ``--steps`` timed ``train_step``
calls, slowest rank after a barrier, one traced step); the 4-rank and 2-rank runs alternate,
and the whole is repeated ``--repeats`` times in fresh processes. Per arm: both predictions,
the median over every timed step, each repeat's median, the spread (max - min of the timed
steps over their median) and, from the traced steps, compute, reduce and wait per rank, and
the exposed communication per pipeline rank (the time its thread waited on a collective:
:meth:`autopart.core.trace.Trace.exposed_comm_us`) against the layout search's figure for it
(:func:`autopart.solver.layout_predict.predict_layout_comm`).

    .venv/bin/python benchmarks/fidelity_3d/run.py [--steps 7] [--repeats 3] \
        [--wait-load 4] [--out DIR]

Writes ``results.json`` and ``results.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
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

WORKLOAD = "hf:GPT2LMHeadModel"
CONFIG = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 2048, "n_positions": 64,
          "batch": 16, "seq": 64}
#: world -> arm -> the degrees the layout search is held to
#: (the pipelines' m is fixed too: with collectives this dear the search prefers m = 1 and
#: an empty first stage, which is no pipeline)
ARMS: dict[int, dict[str, dict[str, int]]] = {
    4: {"pp2xdp2": {"tp": 1, "dp": 2, "zero_stage": 0, "num_microbatches": 4},
        "tp2xpp2": {"tp": 2, "dp": 1, "num_microbatches": 4},
        "pp4": {"tp": 1, "dp": 1, "num_microbatches": 8}},
    2: {"tp2": {"tp": 2, "dp": 1}, "dp2": {"tp": 1, "dp": 2, "zero_stage": 0},
        "pp2": {"tp": 1, "dp": 1, "num_microbatches": 8}}}


def wait_for_load(limit: float, most_s: float = 300.0) -> float:
    """Wait (at most ``most_s`` seconds) until the 1-minute load average is below ``limit``;
    the load average then."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= limit and time.monotonic() - t0 < most_s:
        time.sleep(10)
    return os.getloadavg()[0]


def plan_arms() -> tuple[Any, dict[int, dict[str, Any]], dict[str, dict[str, Any]],
                        dict[str, Any]]:
    """Profile once for 4 CPU ranks, and per world measure the collectives' fixed cost
    (:func:`autopart.planning.with_collective_overhead`). Per world and arm: the plan
    the layout search makes with every rank on a core of its own (a real pipeline: the arm
    that runs), and per arm what the search on shared cores would choose instead
    (``shared_search``, its cuts and m). Returns the profile too, to price the plans again
    before each run (:func:`price`)."""
    from autopart import CompileOptions
    from autopart.apps.bench import load_workload
    from autopart.layout_planning import model_heads, solve_world_layout
    from autopart.planning import profile_model

    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    # measured now, not read from the profile cache: a cached CPU profile keeps another
    # day's op times, and this machine's speed moves by up to 3x between days
    profile = profile_model(model, args, devices=["cpu"] * 4, loss_fn=loss_fn,
                            example_target=target, backend="distributed", cache=False)
    heads = model_heads(model)
    plans: dict[int, dict[str, Any]] = {}
    preds: dict[str, dict[str, Any]] = {}
    for world, arms in ARMS.items():
        shared = world_profile(profile, world)
        alone = dataclasses.replace(shared, runtime=dataclasses.replace(shared.runtime,
                                                                       ranks_per_core=1.0))
        plans[world] = {}
        for name, fixed in arms.items():
            opts = CompileOptions(schedule_kind="1f1b", **fixed)  # type: ignore[arg-type]
            plan = solve_world_layout(alone, opts, world, num_heads=heads)
            plans[world][name] = plan
            chosen = solve_world_layout(shared, opts, world, num_heads=heads)
            preds[name] = {"core_each_s": plan.predicted_step_time_us / 1e6,
                           "shared_search": {"step_s": chosen.predicted_step_time_us / 1e6,
                                             "m": chosen.num_microbatches,
                                             "cuts": [c.position for c in chosen.cuts]}}
    link = profile.host_link
    facts = {"cost_source": profile.costs.source, "num_heads": heads,
             "link": None if link is None else {"latency_us": link.latency_us,
                                                "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s},
             "transfer_overhead_us": profile.runtime.transfer_overhead_us,
             "ranks_per_core": {w: _per_core(w) for w in ARMS}}
    return profile, plans, preds, facts


def _per_core(world: int) -> float:
    from autopart.planning import cpu_ranks_per_core

    return cpu_ranks_per_core(world)


def world_profile(profile: Any, world: int) -> Any:
    """``profile`` for ``world`` CPU ranks of this host: their ranks per core, and the fixed
    cost per collective measured now in ``world`` processes."""
    from autopart.planning import with_collective_overhead

    runtime = dataclasses.replace(profile.runtime, ranks_per_core=_per_core(world))
    shared = dataclasses.replace(profile, devices=("cpu",) * world, runtime=runtime)
    return with_collective_overhead(shared, world)


def price(shared: Any, plan: Any, world: int, fixed: dict[str, int], heads: int | None,
          ) -> tuple[float, list[float]]:
    """``plan``'s step on ``shared`` (a :func:`world_profile`), s, and the communication each
    pipeline rank is predicted to wait for, ms
    (:func:`autopart.solver.layout_predict.predict_layout_comm`)."""
    from autopart import CompileOptions
    from autopart.layout_planning import layout_request
    from autopart.solver.layout_predict import predict_layout_comm

    spec = shared.cluster().devices[0]
    opts = CompileOptions(schedule_kind="1f1b", **fixed)  # type: ignore[arg-type]
    pred = predict_layout_comm(plan, shared.costs, spec,
                               shared.options(schedule_kind="1f1b",
                                              optimizer_state_bytes_per_param_byte=2.0),
                               layout_request(opts, world, spec, heads,
                                              shared.runtime.collective_bandwidth_bytes_per_s))
    return pred.step_us / 1e6, [x / 1e3 for x in pred.exposed_comm_us]


def _spread(steps: list[float]) -> float:
    return (max(steps) - min(steps)) / statistics.median(steps) if steps else 0.0


def trace_summary(trace: Any) -> dict[str, list[float]]:
    """Per pipeline rank of a traced step: compute (F/B/I/W), reduce, wait and send/recv
    time on its compute lane, its collectives in flight (``comm``) and the part of them its
    thread waited for (``exposed``), ms."""
    out: dict[str, list[float]] = {"compute": [], "reduce": [], "wait": [], "transfer": [],
                                   "comm": [], "exposed": []}
    if trace is None:
        return out
    for r in range(trace.num_ranks):
        evs = trace.lane("compute").of_rank(r)
        out["compute"].append(sum(e.duration_us for e in evs if e.action is not None) / 1e3)
        for key, words in (("reduce", ("reduce",)), ("wait", ("wait",)),
                           ("transfer", ("send", "recv"))):
            out[key].append(sum(e.duration_us for e in evs if e.action is None
                                and e.kind in words) / 1e3)
        out["comm"].append(trace.comm_us(r) / 1e3)
        out["exposed"].append(trace.exposed_comm_us(r) / 1e3)
    return out


def action_means(trace: Any) -> dict[str, float]:
    """Mean duration of each stage's forward and backward actions in a traced step
    (``"0F"``, ``"0B"``, ...), ms."""
    sums: dict[str, list[float]] = {}
    if trace is None:
        return {}
    for r in range(trace.num_ranks):
        for e in trace.of_rank(r):
            if e.action is None:
                continue
            stage = e.name.rstrip("0123456789")  # "1F3" -> "1F"
            sums.setdefault(stage, []).append(e.duration_us / 1e3)
    return {k: statistics.mean(v) for k, v in sorted(sums.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wait-load", type=float, default=0.0,
                        help="before profiling and each run, wait (up to 5 min) for the "
                             "1-minute load average to fall below this (default: no wait)")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    from autopart.apps.bench import run_arms

    torch.set_num_threads(1)
    loads = [wait_for_load(opts.wait_load) if opts.wait_load else os.getloadavg()[0]]
    profile, plans, preds, facts = plan_arms()
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in ARMS}
    priced: dict[str, list[float]] = {name: [] for arms in ARMS.values() for name in arms}
    exposed: dict[str, list[list[float]]] = {name: [] for arms in ARMS.values() for name in arms}
    points: dict[int, list[Any]] = {w: [] for w in ARMS}
    for _ in range(opts.repeats):
        for world in ARMS:
            if opts.wait_load:
                wait_for_load(opts.wait_load)
            loads.append(os.getloadavg()[0])
            shared = world_profile(profile, world)  # measured just before the run
            points[world].append((shared.runtime.collective_overhead_points,
                                  shared.runtime.transfer_wait_points,
                                  shared.runtime.collective_bandwidth_bytes_per_s))
            for name, plan in plans[world].items():
                step_s, waits_ms = price(shared, plan, world, ARMS[world][name],
                                         facts["num_heads"])
                priced[name].append(step_s)
                exposed[name].append(waits_ms)
            runs[world].append(run_arms(WORKLOAD, plans[world], ranks=world, steps=opts.steps,
                                        config=dict(CONFIG), single=False, trace=True,
                                        measure_memory=False))
    loads.append(os.getloadavg()[0])
    rows = []
    for world, arms in plans.items():
        for name, plan in arms.items():
            got = runs[world]
            steps = [s for run in got for s in run[name].steps_s]
            measured = statistics.median(steps)
            predicted = statistics.median(priced[name])
            rows.append({
                "arm": name, "world": world, "tp": plan.tp, "pp": len(plan.ranks), "dp": plan.dp,
                "zero_stage": plan.zero_stage, "m": plan.num_microbatches,
                "cuts": [c.position for c in plan.cuts], "predicted_step_s": predicted,
                "repeat_predictions_s": priced[name],
                "predicted_core_each_s": preds[name]["core_each_s"],
                "shared_search": preds[name]["shared_search"], "measured_step_s": measured,
                "repeat_medians_s": [statistics.median(run[name].steps_s) for run in got],
                "repeat_errors": [p / statistics.median(run[name].steps_s) - 1
                                  for p, run in zip(priced[name], got, strict=True)],
                "step_spread": _spread(steps), "steps_s": steps,
                "error": predicted / measured - 1,
                "error_core_each": preds[name]["core_each_s"] / measured - 1,
                "traced_ms": [trace_summary(run[name].trace) for run in got],
                "predicted_exposed_ms": [statistics.median(x)
                                         for x in zip(*exposed[name], strict=True)],
                "repeat_predicted_exposed_ms": exposed[name],
                "stage_predicted_ms": {f"{i}F": st.predicted_fwd_us / 1e3
                                       for i, st in enumerate(plan.stages)}
                | {f"{i}B": st.predicted_bwd_us / 1e3 for i, st in enumerate(plan.stages)},
                "stage_traced_ms": [action_means(run[name].trace) for run in got]})
    facts["collective_overhead_points"] = {w: [[list(p) for p in pts[0]] for pts in got]
                                           for w, got in points.items()}
    facts["transfer_wait_points"] = {w: [[list(p) for p in pts[1]] for pts in got]
                                     for w, got in points.items()}
    facts["collective_bandwidth_bytes_per_s"] = {w: [pts[2] for pts in got]
                                                 for w, got in points.items()}
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{len(os.sched_getaffinity(0))} usable",
            "torch": torch.__version__, "threads_per_rank": 1,
            "workload": {"spec": WORKLOAD, **CONFIG}, "steps": opts.steps,
            "repeats": opts.repeats, "load_average_1min": loads, **facts}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# fidelity_3d: gloo CPU ranks, {meta['date']}", "",
             f"{meta['machine']}, torch {meta['torch']}, 1 thread per rank; 1-minute load "
             f"average {min(loads):.1f}-{max(loads):.1f} (before the profile, each run and "
             f"after: {', '.join(f'{x:.1f}' for x in loads)}); {opts.repeats} runs x "
             f"{opts.steps} timed steps per arm; ranks per core "
             f"{facts['ranks_per_core']}.", "",
             "| ranks | arm | tp x pp x dp | m | cuts | predicted | measured (median) "
             "| repeat medians | repeat errors | spread | error | a core each (error) |",
             "|---:|---|---|---:|---|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        reps = ", ".join(f"{x:.3f}" for x in r["repeat_medians_s"])
        errs = ", ".join(f"{x:+.0%}" for x in r["repeat_errors"])
        lines.append(f"| {r['world']} | {r['arm']} | {r['tp']} x {r['pp']} x {r['dp']} | "
                     f"{r['m']} | {r['cuts']} | {r['predicted_step_s']:.3f} s | "
                     f"{r['measured_step_s']:.3f} s | {reps} | {errs} | {r['step_spread']:.0%} | "
                     f"{r['error']:+.1%} | {r['predicted_core_each_s']:.3f} s "
                     f"({r['error_core_each']:+.1%}) |")
    lines += ["", "Fixed cost per collective and (shared cores) per transfer, (work µs, µs) in "
              "core time, measured before each run:", ""]
    lines += [f"- {w} ranks, all-reduce bus bandwidth: "
              + ", ".join(f"{pts[2] / 1e9:.2f} GB/s" for pts in got) for w, got in points.items()]
    for k, what in enumerate(("collective", "transfer")):
        lines += [f"- {w} ranks, per {what}: " + "; ".join(
            ", ".join(f"({a:.0f}, {b:.0f})" for a, b in pts[k]) or "none" for pts in got)
            for w, got in points.items()]
    lines += ["", "What the search on shared cores chooses instead (not run):", ""]
    lines += [f"- {r['arm']}: m {r['shared_search']['m']}, cuts {r['shared_search']['cuts']}, "
              f"predicted {r['shared_search']['step_s']:.3f} s" for r in rows]
    lines += ["", "Traced step (last repeat), per pipeline rank, ms:", "",
              "| arm | compute | reduce | wait | send/recv |", "|---|---|---|---|---|"]
    for r in rows:
        t = r["traced_ms"][-1]
        lines.append(f"| {r['arm']} | " + " | ".join(
            "/".join(f"{x:.1f}" for x in t[k]) for k in ("compute", "reduce", "wait",
                                                          "transfer")) + " |")
    lines += ["", "Exposed communication per pipeline rank (the time its thread waited on a "
              "collective: dp buckets, FSDP gathers and reduce-scatters, the sums after the "
              "step; tp collectives inside an action and pipeline transfers not counted), "
              "predicted (median over the repeats) / traced (each repeat's traced step), ms; "
              "in brackets the traced collectives' time in flight:", "",
              "| arm | rank | predicted | traced (in flight) | error of the median |",
              "|---|---:|---:|---|---:|"]
    for r in rows:
        for k, want in enumerate(r["predicted_exposed_ms"]):
            got = [t["exposed"][k] for t in r["traced_ms"] if len(t["exposed"]) > k]
            flight = [t["comm"][k] for t in r["traced_ms"] if len(t["comm"]) > k]
            mid = statistics.median(got) if got else 0.0
            lines.append(f"| {r['arm']} | {k} | {want:.1f} | "
                         + ", ".join(f"{a:.1f} ({b:.1f})" for a, b in zip(got, flight,
                                                                           strict=True))
                         + f" | {f'{want / mid - 1:+.0%}' if mid > 0 else '-'} |")
    lines += ["", "Per action (last repeat), mean traced vs the plan's own prediction (a core "
              "each), ms:", ""]
    for r in rows:
        got = r["stage_traced_ms"][-1]
        lines.append(f"- {r['arm']}: " + ", ".join(
            f"{k} {got.get(k, float('nan')):.1f}/{v:.1f}"
            for k, v in sorted(r["stage_predicted_ms"].items())))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
