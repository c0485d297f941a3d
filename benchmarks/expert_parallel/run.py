"""Expert parallelism on gloo CPU ranks: predicted vs measured step, with and without ep.

One profile of a Mixtral-like model (4 layers, hidden 256, 8 experts of FFN 512, top-2,
8 / 2 heads, vocabulary 2048, global batch 16 x 64 tokens) is taken for 4 ``cpu`` ranks as
``autopart.compile`` takes it under torchrun (distributed backend, host link and the
collectives' fixed costs measured). Each arm's degrees are fixed and the layout search
(:func:`autopart.layout_planning.solve_world_layout`, 1F1B unless the arm names its
schedule, ZeRO 0) plans it with every rank on a core of its own; the plan runs, and is
priced again with the world's ranks per core by
:func:`autopart.solver.layout_predict.predict_layout_comm` (as ``benchmarks/fidelity_3d``
does). On 4 ranks: ``pp2xdp2-ep2`` and ``pp2xdp2`` (ep 1), and ``dualpipev-ep2`` (pp 2 x
dp 2, DualPipe-V, its forward-backward pairs one action after the other, as CPU ranks run
them) beside the same plan run ``dualpipev-ep2-overlapped`` (each pair at once, on two
threads, so that one's all-to-alls wait while the other computes; priced so); on 2 ranks: ``dp2-ep2`` and ``dp2``. Arms
alternate step by step (:func:`autopart.apps.bench.run_arms`), the whole is repeated ``--repeats`` times in fresh processes; per arm: the prediction, the median of every
timed step, each repeat's median and the spread.

    .venv/bin/python benchmarks/expert_parallel/run.py [--steps 7] [--repeats 2] [--out DIR]

Writes ``results.json`` and ``results.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
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

WORKLOAD = "hf:MixtralForCausalLM"
CONFIG = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
          "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 64,
          "batch": 16, "seq": 64}
ARMS: dict[int, dict[str, dict[str, Any]]] = {
    4: {"pp2xdp2-ep2": {"tp": 1, "dp": 2, "zero_stage": 0, "ep": 2, "num_microbatches": 4},
        "pp2xdp2": {"tp": 1, "dp": 2, "zero_stage": 0, "num_microbatches": 4},
        "dualpipev-ep2": {"tp": 1, "dp": 2, "zero_stage": 0, "ep": 2, "num_microbatches": 4,
                          "schedule_kind": "dualpipev"},
        "dualpipev-ep2-overlapped": {"tp": 1, "dp": 2, "zero_stage": 0, "ep": 2,
                                     "num_microbatches": 4, "schedule_kind": "dualpipev"}},
    2: {"dp2-ep2": {"tp": 1, "dp": 2, "zero_stage": 0, "ep": 2, "num_microbatches": 2},
        "dp2": {"tp": 1, "dp": 2, "zero_stage": 0, "num_microbatches": 2}}}


#: arms that run another arm's plan with its DualPipe-V pairs at once
#: (``DistributedPipeline.overlap_pairs = True``; CPU ranks run them one after the other by
#: default), priced so
OVERLAPPED = {"dualpipev-ep2-overlapped": "dualpipev-ep2"}


def _price(shared: Any, plan: Any, world: int, fixed: dict[str, Any], heads: int | None,
           overlapped: bool) -> float:
    """``plan``'s step on ``shared`` (``benchmarks/fidelity_3d``'s world profile) under its
    own schedule kind, s; ``overlapped``: with its DualPipe-V pairs priced as run at once
    (``layout_search.hides_expert_exchanges`` answering yes for the pricing; on CPU ranks
    it says no, as the runtime runs them)."""
    from autopart import CompileOptions
    from autopart.layout_planning import layout_request
    from autopart.solver import layout_search
    from autopart.solver.layout_predict import predict_layout_comm

    spec = shared.cluster().devices[0]
    kind = fixed.get("schedule_kind", "1f1b")
    opts = CompileOptions(**{"schedule_kind": "1f1b", **fixed})
    rule = layout_search.hides_expert_exchanges
    if overlapped:
        layout_search.hides_expert_exchanges = lambda *_, **__: True  # type: ignore[assignment]
    try:
        pred = predict_layout_comm(plan, shared.costs, spec,
                                   shared.options(schedule_kind=kind,
                                                  optimizer_state_bytes_per_param_byte=2.0),
                                   layout_request(opts, world, spec, heads,
                                                  shared.runtime.collective_bandwidth_bytes_per_s))
    finally:
        layout_search.hides_expert_exchanges = rule  # type: ignore[assignment]
    return pred.step_us / 1e6


def _fidelity_3d() -> Any:
    """benchmarks/fidelity_3d/run.py's helpers (pricing on the world's ranks per core)."""
    path = ROOT / "benchmarks" / "fidelity_3d" / "run.py"
    spec = importlib.util.spec_from_file_location("_fidelity_3d_run", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    from autopart import CompileOptions
    from autopart.apps.bench import load_workload, run_arms
    from autopart.layout_planning import model_heads, solve_world_layout
    from autopart.planning import profile_model
    from autopart.solver.expert_parallel_costs import routing_imbalance

    f3d = _fidelity_3d()
    torch.set_num_threads(1)
    loads = [os.getloadavg()[0]]
    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    # measured now, not read from the profile cache: a cached CPU profile keeps another
    # day's op times, and this machine's speed moves by up to 3x between days
    profile = profile_model(model, args, devices=["cpu"] * 4, loss_fn=loss_fn,
                            example_target=target, backend="distributed", cache=False)
    heads = model_heads(model)
    plans: dict[int, dict[str, Any]] = {}
    for world, arms in ARMS.items():
        shared = f3d.world_profile(profile, world)
        alone = dataclasses.replace(shared, runtime=dataclasses.replace(shared.runtime,
                                                                       ranks_per_core=1.0))
        plans[world] = {name: solve_world_layout(alone, CompileOptions(
            **{"schedule_kind": "1f1b", **fixed}, recompute=False), world, num_heads=heads)
            for name, fixed in arms.items() if name not in OVERLAPPED}
        plans[world].update({name: plans[world][of] for name, of in OVERLAPPED.items()
                             if name in arms})
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in ARMS}
    priced: dict[str, list[float]] = {n: [] for arms in ARMS.values() for n in arms}
    even: dict[str, list[float]] = {n: [] for arms in ARMS.values() for n in arms}
    for _ in range(opts.repeats):
        for world in ARMS:
            loads.append(os.getloadavg()[0])
            shared = f3d.world_profile(profile, world)
            for name, plan in plans[world].items():
                overlapped = name in OVERLAPPED
                priced[name].append(_price(shared, plan, world, ARMS[world][name], heads,
                                           overlapped))
                # the same profile with its measured routing left out: balanced routing
                even_costs = dataclasses.replace(shared.costs, expert_tokens=())
                even[name].append(_price(dataclasses.replace(shared, costs=even_costs), plan,
                                         world, ARMS[world][name], heads, overlapped))
            runs[world].append(run_arms(WORKLOAD, plans[world], ranks=world, steps=opts.steps,
                                        config=dict(CONFIG), single=False, trace=False,
                                        measure_memory=False,
                                        overlap_pairs={n: True for n in OVERLAPPED
                                                       if n in plans[world]}))
    loads.append(os.getloadavg()[0])
    rows = []
    for world, arms in plans.items():
        for name, plan in arms.items():
            steps = [s for run in runs[world] for s in run[name].steps_s]
            measured = statistics.median(steps)
            predicted = statistics.median(priced[name])
            rows.append({
                "arm": name, "world": world, "schedule": plan.schedule_kind,
                "pairs_overlapped": name in OVERLAPPED,
                "tp": plan.tp, "pp": len(plan.ranks),
                "dp": plan.dp, "ep": plan.ep, "zero_stage": plan.zero_stage,
                "m": plan.num_microbatches, "cuts": [c.position for c in plan.cuts],
                "predicted_step_s": predicted, "repeat_predictions_s": priced[name],
                "predicted_balanced_s": statistics.median(even[name]),
                "measured_step_s": measured,
                "repeat_medians_s": [statistics.median(r[name].steps_s) for r in runs[world]],
                "step_spread": (max(steps) - min(steps)) / measured, "steps_s": steps,
                "error": predicted / measured - 1,
                "predicted_peak_bytes": max(r.peak_memory_bytes for r in plan.ranks)})
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{len(os.sched_getaffinity(0))} usable",
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "threads_per_rank": 1, "load_averages": loads, "steps": opts.steps,
            "repeats": opts.repeats, "workload": WORKLOAD, "config": CONFIG,
            "cost_source": profile.costs.source,
            "expert_tokens": [list(x) for x in profile.costs.expert_tokens],
            "routing_imbalance_ep2": {path: routing_imbalance(tokens, 2)
                                      for path, tokens in profile.costs.expert_tokens}}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Expert parallelism on gloo CPU ranks ({meta['date']})", "",
             f"{meta['machine']}; Python {meta['python']}, torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {opts.steps} steps x {opts.repeats} "
             f"repeats; load {min(loads):.1f}-{max(loads):.1f}.", "",
             "Routing imbalance at ep 2, per MoE layer, measured on the profiled batch: "
             + ", ".join(f"{v:.3f}" for v in meta["routing_imbalance_ep2"].values()) + ".", "",
             "| arm | ranks | schedule | pp | dp | ep | m | predicted | "
             "predicted, balanced routing | measured (median) | error | repeat medians | "
             "spread |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['world']} | {r['schedule']} | {r['pp']} | "
                     f"{r['dp']} | {r['ep']} | "
                     f"{r['m']} | {r['predicted_step_s'] * 1e3:.1f} ms | "
                     f"{r['predicted_balanced_s'] * 1e3:.1f} ms | "
                     f"{r['measured_step_s'] * 1e3:.1f} ms | {r['error'] * 100:+.1f} % | "
                     + ", ".join(f"{x * 1e3:.1f}" for x in r["repeat_medians_s"])
                     + f" ms | {r['step_spread'] * 100:.0f} % |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
