"""Benchmark: ZeRO-0's gradient all-reduce overlapped with the backward vs after the flush,
and ZeRO-1/3 with one FSDP unit per layer vs per stage, on gloo CPU ranks: measured and
predicted step, and the dp communication exposed per rank.

A GPT-2-like model whose gradient all-reduce is a visible share of its step (4 layers,
n_embd 256, 4 heads, vocabulary 16,384: 7.4M parameters, 29 MB of float32 gradients; global
batch 16 x 32 tokens) is profiled for the distributed runtime as ``autopart.compile`` profiles
it, and the layout search plans two arms with fixed degrees (with a core per rank, which
gives a real pipeline, as ``benchmarks/fidelity_3d`` does; priced with the world's ranks per
core): ``dp2`` (2 ranks, tp 1, pp 1,
dp 2, ZeRO-0) and ``pp2xdp2`` (4 ranks, m = 4, 1F1B). Each plan runs twice, the plan as the
search wrote it (``overlap_grad_reduce``: buckets launched during each stage's last backward,
``autopart/runtime/distributed/_grad_buckets.py``) and the same plan with it off (averaged
after the schedule), alternated step by step (:func:`autopart.apps.bench.run_arms`), the
whole repeated in fresh processes. ``pp2xdp2-zero1`` and ``pp2xdp2-zero3`` (the same
degrees under ZeRO-1 and ZeRO-3) run as planned (``zero_layer_units``: each layer its own
FSDP unit, reduce-scattered in the stage's last backward at ZeRO-1, gathered per layer with
prefetch) and with one unit per stage. Per arm: the predicted step (the plan priced as it runs,
:func:`autopart.solver.layout_predict.predict_layout`), the median measured step, each
repeat's median, the spread; per rank, the dp collectives the cost model leaves after the
schedule (:func:`autopart.solver.layout_search.dp_exposed_us`) and the traced step's
``reduce`` span (the wait for the overlapped buckets, then the tied sums and the rest); and
the exposed communication per rank, predicted (those dp collectives and the tied sums:
:attr:`autopart.solver.layout_predict.LayoutPrediction.exposed_comm_us`) against the traced
step's (the time each rank's thread waited on a collective, FSDP2's inside the actions
included: :meth:`autopart.core.trace.Trace.exposed_comm_us`).

    .venv/bin/python benchmarks/overlap_cpu/run.py [--steps 7] [--repeats 3]

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
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORKLOAD = "hf:GPT2LMHeadModel"
CONFIG = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 16384, "n_positions": 32,
          "batch": 16, "seq": 32}
#: world -> arm -> the degrees the layout search is held to
ARMS: dict[int, dict[str, dict[str, int]]] = {
    2: {"dp2": {"tp": 1, "dp": 2, "zero_stage": 0, "num_microbatches": 1}},
    4: {"pp2xdp2": {"tp": 1, "dp": 2, "zero_stage": 0, "num_microbatches": 4},
        "pp2xdp2-zero1": {"tp": 1, "dp": 2, "zero_stage": 1, "num_microbatches": 4},
        "pp2xdp2-zero3": {"tp": 1, "dp": 2, "zero_stage": 3, "num_microbatches": 4}}}


def variants(plan: Any, name: str, zero: int) -> dict[str, Any]:
    """The two ways one plan runs its dp communication: ZeRO-0 overlapped with the last
    backward or after the schedule (``overlap_grad_reduce``); ZeRO 1-3 one FSDP unit per
    layer (gathered and reduce-scattered layer by layer, prefetched) or per stage
    (``zero_layer_units``)."""
    if zero == 0:
        return {f"{name} overlap": dataclasses.replace(plan, overlap_grad_reduce=True),
                f"{name} flush": dataclasses.replace(plan, overlap_grad_reduce=False)}
    return {f"{name} layers": dataclasses.replace(plan, zero_layer_units=True),
            f"{name} stage": dataclasses.replace(plan, zero_layer_units=False)}


def _request(shared: Any, world: int, fixed: dict[str, int], heads: int | None
             ) -> tuple[Any, Any, Any]:
    from autopart import CompileOptions
    from autopart.layout_planning import layout_request

    spec = shared.cluster().devices[0]
    opts = CompileOptions(schedule_kind="1f1b", **fixed)  # type: ignore[arg-type]
    layout = layout_request(opts, world, spec, heads,
                            shared.runtime.collective_bandwidth_bytes_per_s)
    solve = shared.options(schedule_kind="1f1b", optimizer_state_bytes_per_param_byte=2.0)
    return spec, layout, solve


def price(shared: Any, plan: Any, world: int, fixed: dict[str, int], heads: int | None
          ) -> tuple[float, list[float], list[float]]:
    """``plan``'s predicted step on ``shared`` (s), its dp collectives exposed after the
    schedule per pipeline rank (ms), and all the communication each rank is predicted to
    wait for, the tied sums included (ms)."""
    from autopart.solver.layout_predict import predict_layout_comm
    from autopart.solver.layout_search import dp_exposed_us

    spec, layout, solve = _request(shared, world, fixed, heads)
    pred = predict_layout_comm(plan, shared.costs, spec, solve, layout)
    exposed = [x / 1e3 for x in dp_exposed_us(plan, layout, shared.runtime, shared.costs)]
    return pred.step_us / 1e6, exposed, [x / 1e3 for x in pred.exposed_comm_us]


def _fidelity_3d() -> Any:
    """``benchmarks/fidelity_3d/run.py`` as a module (its world profile and trace summary)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fidelity_3d_run", ROOT / "benchmarks" / "fidelity_3d" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    from autopart import CompileOptions
    from autopart.apps.bench import load_workload, run_arms
    from autopart.layout_planning import model_heads, solve_world_layout
    from autopart.planning import profile_model
    fidelity = _fidelity_3d()
    trace_summary, world_profile = fidelity.trace_summary, fidelity.world_profile

    torch.set_num_threads(1)
    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    params = sum(p.numel() for p in model.parameters())
    # measured now, not read from the profile cache: a cached CPU profile keeps another
    # day's op times, and this machine's speed moves by up to 3x between days
    profile = profile_model(model, args, devices=["cpu"] * 4, loss_fn=loss_fn,
                            example_target=target, backend="distributed", cache=False)
    heads = model_heads(model)
    loads = [os.getloadavg()[0]]
    plans: dict[int, dict[str, Any]] = {}
    for world, arms in ARMS.items():
        shared = world_profile(profile, world)
        # planned with a core per rank, a real pipeline (on shared cores the search prefers
        # an almost empty first stage: benchmarks/fidelity_3d/README.md); priced as shared
        alone = dataclasses.replace(shared, runtime=dataclasses.replace(shared.runtime,
                                                                       ranks_per_core=1.0))
        plans[world] = {}
        for name, fixed in arms.items():
            plan = solve_world_layout(alone, CompileOptions(schedule_kind="1f1b", **fixed),
                                      world, num_heads=heads)  # type: ignore[arg-type]
            plans[world].update(variants(plan, name, fixed["zero_stage"]))
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in ARMS}
    priced: dict[str, list[tuple[float, list[float], list[float]]]] = {}
    for _ in range(opts.repeats):
        for world, arms in plans.items():
            loads.append(os.getloadavg()[0])
            shared = world_profile(profile, world)  # the collectives' cost measured now
            for name, plan in arms.items():
                fixed = ARMS[world][name.split()[0]]
                priced.setdefault(name, []).append(price(shared, plan, world, fixed, heads))
            runs[world].append(run_arms(WORKLOAD, arms, ranks=world, steps=opts.steps,
                                        config=dict(CONFIG), single=False, trace=True,
                                        measure_memory=False))
    loads.append(os.getloadavg()[0])
    rows = []
    for world, arms in plans.items():
        for name, plan in arms.items():
            got = runs[world]
            steps = [s for run in got for s in run[name].steps_s]
            measured = statistics.median(steps)
            predicted = statistics.median(p[0] for p in priced[name])
            exposed = [statistics.median(p[1][r] for p in priced[name])
                       for r in range(len(plan.ranks))]
            traced = [trace_summary(run[name].trace)["reduce"] for run in got]
            traced_median = [statistics.median(t[r] for t in traced)
                             for r in range(len(plan.ranks))]
            waits = [statistics.median(p[2][r] for p in priced[name])
                     for r in range(len(plan.ranks))]
            waited = [trace_summary(run[name].trace)["exposed"] for run in got]
            waited_median = [statistics.median(t[r] for t in waited)
                             for r in range(len(plan.ranks))]
            rows.append({
                "arm": name, "world": world, "pp": len(plan.ranks), "dp": plan.dp,
                "m": plan.num_microbatches, "cuts": [c.position for c in plan.cuts],
                "zero_stage": plan.zero_stage, "overlap_grad_reduce": plan.overlap_grad_reduce,
                "zero_layer_units": plan.zero_layer_units,
                "predicted_step_s": predicted, "measured_step_s": measured,
                "repeat_medians_s": [statistics.median(run[name].steps_s) for run in got],
                "spread": (max(steps) - min(steps)) / measured, "steps_s": steps,
                "error": predicted / measured - 1,
                "predicted_exposed_ms": exposed, "traced_reduce_ms": traced,
                "traced_reduce_median_ms": traced_median,
                "exposed_error": [e / t - 1 if t > 0 else None
                                  for e, t in zip(exposed, traced_median, strict=True)],
                "predicted_exposed_comm_ms": waits, "traced_exposed_ms": waited,
                "traced_exposed_median_ms": waited_median,
                "exposed_comm_error": [e / t - 1 if t > 0 else None
                                       for e, t in zip(waits, waited_median, strict=True)]})
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{len(os.sched_getaffinity(0))} usable",
            "python": platform.python_version(), "torch": torch.__version__,
            "threads_per_rank": 1, "workload": {"spec": WORKLOAD, **CONFIG},
            "parameters": params, "steps": opts.steps, "repeats": opts.repeats,
            "load_average_1min": loads}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# overlap_cpu: gloo CPU ranks, {meta['date']}", "",
             f"{meta['machine']}, Python {meta['python']}, torch {meta['torch']}, 1 thread per "
             f"rank; {params / 1e6:.2f}M parameters; 1-minute load average "
             f"{min(loads):.1f}-{max(loads):.1f}; {opts.repeats} runs x {opts.steps} timed "
             "steps per arm, arms of a world alternated step by step.", "",
             "| ranks | arm | pp x dp | m | predicted | measured (median) | repeat medians | "
             "spread | error | dp exposed per rank, predicted ms | traced reduce ms |",
             "|---:|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        reps = ", ".join(f"{x:.3f}" for x in r["repeat_medians_s"])
        lines.append(f"| {r['world']} | {r['arm']} | {r['pp']} x {r['dp']} | {r['m']} | "
                     f"{r['predicted_step_s']:.3f} s | {r['measured_step_s']:.3f} s | {reps} | "
                     f"{r['spread']:.0%} | {r['error']:+.1%} | "
                     f"{' / '.join(f'{x:.1f}' for x in r['predicted_exposed_ms'])} | "
                     f"{' / '.join(f'{x:.1f}' for x in r['traced_reduce_median_ms'])} |")
    lines += ["", "Exposed communication per rank (the time its thread waited on a collective: "
              "dp buckets, FSDP2's gathers and reduce-scatters, the sums after the step), "
              "predicted / traced (median over the repeats' traced steps), ms:", "",
              "| arm | predicted | traced | error |", "|---|---|---|---|"]
    for r in rows:
        errs = " / ".join("-" if e is None else f"{e:+.0%}" for e in r["exposed_comm_error"])
        lines.append(f"| {r['arm']} | "
                     f"{' / '.join(f'{x:.1f}' for x in r['predicted_exposed_comm_ms'])} | "
                     f"{' / '.join(f'{x:.1f}' for x in r['traced_exposed_median_ms'])} | "
                     f"{errs} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
