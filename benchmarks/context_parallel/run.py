"""Context parallelism on gloo CPU ranks: predicted vs measured step and peak, with and
without cp.

A Llama-shaped model (4 layers, hidden 256, 4 / 2 heads, FFN 512, vocabulary 2048, global
batch 4 x 1024 tokens) is profiled as ``autopart.compile`` profiles it under torchrun: whole
sequences for cp 1, one cp rank's 512 tokens (with their positions) for cp 2. Each arm's
degrees are fixed and the layout search (:func:`autopart.layout_planning.solve_world_layout`,
1F1B, m 2, no recompute) plans it with every rank on a core of its own; the plan runs, and is
priced again with the world's ranks per core (as ``benchmarks/fidelity_3d`` does). Arms on 2
ranks: ``pp2`` (cp 1), ``cp2`` and ``cp2-ulysses`` (pp 1; keys and values all-gathered, or
Ulysses' all-to-alls); on 4 ranks: ``pp2xcp2``, ``pp2xcp2-ulysses`` and ``pp2xdp2`` (cp 1).
Arms alternate step by step (:func:`autopart.apps.bench.run_arms`), the whole is repeated
``--repeats`` times in fresh processes; per arm: the prediction, the median of every timed
step, each repeat's median and the spread, and each pipeline rank's predicted and measured
peak (rank 0's pipeline; measured after the repeats, each arm in processes of its own).

    .venv/bin/python benchmarks/context_parallel/run.py [--steps 7] [--repeats 2] [--out DIR]

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

WORKLOAD = f"{Path(__file__).resolve()}:workload"
CONFIG = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
          "max_position_embeddings": 1024, "batch": 4, "seq": 1024}


def workload(batch: int = 4, seq: int = 1024, **config: Any) -> tuple[Any, ...]:
    """The Llama-shaped model (random weights, sdpa attention), ``batch`` sequences of ``seq``
    random tokens, the next tokens as the target (shifted before the model, as Megatron-LM's
    and torchtitan's data loaders shift them: a loss that shifts inside would pair tokens
    across a cp rank's two chunks) and the token-mean cross-entropy."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        use_cache=False, attn_implementation="sdpa", **config))
    tokens = torch.randint(0, config["vocab_size"], (batch, seq + 1))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 target.reshape(-1))

    return model, (tokens[:, :-1],), tokens[:, 1:], loss_fn
FIXED: dict[str, Any] = {"tp": 1, "zero_stage": 0, "num_microbatches": 2}
GATHER, ULYSSES = {"cp_attention": "all_gather"}, {"cp_attention": "ulysses"}
ARMS: dict[int, dict[str, dict[str, Any]]] = {
    2: {"pp2": {**FIXED, "dp": 1, "cp": 1}, "cp2": {**FIXED, "dp": 1, "cp": 2, **GATHER},
        "cp2-ulysses": {**FIXED, "dp": 1, "cp": 2, **ULYSSES}},
    4: {"pp2xcp2": {**FIXED, "dp": 1, "cp": 2, **GATHER},
        "pp2xcp2-ulysses": {**FIXED, "dp": 1, "cp": 2, **ULYSSES},
        "pp2xdp2": {**FIXED, "dp": 2, "cp": 1}}}


def fidelity_3d() -> Any:
    """benchmarks/fidelity_3d/run.py's helpers (pricing on the world's ranks per core)."""
    path = ROOT / "benchmarks" / "fidelity_3d" / "run.py"
    spec = importlib.util.spec_from_file_location("_fidelity_3d_run", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layout_request_for(profile: Any, world: int, fixed: dict[str, Any], heads: int | None) -> Any:
    """The layout request ``autopart.compile`` makes for ``fixed`` on ``profile``."""
    from autopart import CompileOptions
    from autopart.layout_planning import context_request, layout_request

    spec = profile.cluster().devices[0]
    opts = CompileOptions(schedule_kind="1f1b", recompute=False, **fixed)  # type: ignore[arg-type]
    request = layout_request(opts, world, spec, heads,
                             profile.runtime.collective_bandwidth_bytes_per_s)
    if fixed["cp"] > 1:  # the profile is of one cp rank's tokens, as compile takes it
        request = context_request(request, profile, fixed["cp"], fixed.get("cp_attention"))
    return request


def _price(shared: Any, plan: Any, world: int, fixed: dict[str, Any],
           heads: int | None) -> tuple[float, list[int]]:
    """``plan``'s step (s) and per-rank peaks (bytes) on ``shared`` (a world profile)."""
    from autopart.solver.layout_predict import predict_layout_comm

    spec = shared.cluster().devices[0]
    options = shared.options(schedule_kind="1f1b", optimizer_state_bytes_per_param_byte=2.0)
    priced = predict_layout_comm(plan, shared.costs, spec, options,
                                 layout_request_for(shared, world, fixed, heads)).plan
    return priced.predicted_step_time_us / 1e6, [r.peak_memory_bytes for r in priced.ranks]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    from autopart.apps.bench import load_workload, run_arms
    from autopart.core.context import context_inputs
    from autopart.layout_planning import model_heads
    from autopart.planning import profile_model
    from autopart.solver.layout_search import solve_layout

    f3d = fidelity_3d()
    torch.set_num_threads(1)
    loads = [os.getloadavg()[0]]
    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    heads = model_heads(model)
    profiles = {}
    for cp in (1, 2):
        inputs, kwargs, tgt = context_inputs(model, cp, args, {}, target)
        # measured now, not read from the profile cache: this machine's speed moves by up to
        # 3x from day to day, and a cached profile would price today's steps at another day's
        profiles[cp] = profile_model(model, inputs, example_kwargs=kwargs, devices=["cpu"] * 4,
                                     loss_fn=loss_fn, example_target=tgt, backend="distributed",
                                     cache=False)
    plans: dict[int, dict[str, Any]] = {}
    for world, arms in ARMS.items():
        plans[world] = {}
        for name, fixed in arms.items():
            shared = f3d.world_profile(profiles[fixed["cp"]], world)
            alone = dataclasses.replace(shared, runtime=dataclasses.replace(
                shared.runtime, ranks_per_core=1.0))
            options = alone.options(schedule_kind="1f1b", recompute=False,
                                    num_microbatches=fixed["num_microbatches"],
                                    optimizer_state_bytes_per_param_byte=2.0)
            plans[world][name] = solve_layout(alone.costs, alone.cluster().devices[0], options,
                                              layout_request_for(alone, world, fixed, heads))
    runs: dict[int, list[Any]] = {w: [] for w in ARMS}
    priced: dict[str, list[tuple[float, list[int]]]] = {n: [] for a in ARMS.values() for n in a}
    for _ in range(opts.repeats):
        for world, arms in ARMS.items():
            loads.append(os.getloadavg()[0])
            for name, plan in plans[world].items():
                shared = f3d.world_profile(profiles[arms[name]["cp"]], world)
                priced[name].append(_price(shared, plan, world, arms[name], heads))
            runs[world].append(run_arms(WORKLOAD, plans[world], ranks=world, steps=opts.steps,
                                        config=dict(CONFIG), single=False, trace=False,
                                        measure_memory=False))
    # each arm's peak in processes of its own: torch's CPU memory profiler (kineto) ran out of
    # memory (std::bad_alloc) or crashed in 4 of 5 runs here when one process measured three
    # arms one after the other
    peak_runs = {name: run_arms(WORKLOAD, {name: plan}, ranks=world, steps=1, warmup=1,
                                config=dict(CONFIG), single=False, trace=False,
                                measure_memory=True)[name]
                 for world in ARMS for name, plan in plans[world].items()}
    loads.append(os.getloadavg()[0])
    rows = []
    for world, arms in plans.items():
        for name, plan in arms.items():
            steps = [s for run in runs[world] for s in run[name].steps_s]
            measured = statistics.median(steps)
            predicted = statistics.median(p[0] for p in priced[name])
            peaks = list(peak_runs[name].peak_bytes)
            pp = len(plan.ranks)
            predicted_peaks = priced[name][0][1]
            rows.append({
                "arm": name, "world": world, "tp": plan.tp, "pp": pp, "dp": plan.dp,
                "cp": plan.cp, "cp_attention": plan.cp_attention, "m": plan.num_microbatches,
                "cuts": [c.position for c in plan.cuts],
                "predicted_step_s": predicted,
                "repeat_predictions_s": [p[0] for p in priced[name]],
                "measured_step_s": measured,
                "repeat_medians_s": [statistics.median(r[name].steps_s) for r in runs[world]],
                "step_spread": (max(steps) - min(steps)) / measured, "steps_s": steps,
                "error": predicted / measured - 1,
                "predicted_peak_bytes": predicted_peaks,
                "measured_peak_bytes": peaks,
                # one measured peak per pipeline rank (its pipeline's, as rank 0 gathers them)
                "peak_ratio": [predicted_peaks[r] / peaks[r] for r in range(len(peaks))]})
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{len(os.sched_getaffinity(0))} usable",
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "threads_per_rank": 1, "load_averages": loads, "steps": opts.steps,
            "repeats": opts.repeats, "workload": WORKLOAD, "config": CONFIG}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    mib = 2.0 ** 20
    lines = [f"# Context parallelism on gloo CPU ranks ({meta['date']})", "",
             f"{meta['machine']}; Python {meta['python']}, torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {opts.steps} steps x {opts.repeats} "
             f"repeats; load {min(loads):.1f}-{max(loads):.1f}.", "",
             "| arm | ranks | pp | dp | cp | predicted step | measured (median) | error | "
             "repeat medians | spread | peak MiB per rank, predicted / measured |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        peaks = ", ".join(f"{r['predicted_peak_bytes'][i] / mib:.1f} / {m / mib:.1f}"
                          for i, m in enumerate(r["measured_peak_bytes"]))
        lines.append(f"| {r['arm']} | {r['world']} | {r['pp']} | {r['dp']} | {r['cp']} | "
                     f"{r['predicted_step_s'] * 1e3:.1f} ms | "
                     f"{r['measured_step_s'] * 1e3:.1f} ms | {r['error'] * 100:+.1f} % | "
                     + ", ".join(f"{x * 1e3:.1f}" for x in r["repeat_medians_s"])
                     + f" ms | {r['step_spread'] * 100:.0f} % | {peaks} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
