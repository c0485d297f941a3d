"""``make demo``: the win measured on this machine: 2-process speed-up, memory that fits, numerics.

The default model is a GPT-2-like language model whose head (a 16k vocabulary) costs as
much as several of its eight blocks, so where the cuts go matters. It is planned for two
CPU ranks, then measured on two real processes (:func:`autopart.apps.bench.run_arms`: gloo, one
thread each, arms alternated step by step) against the same model in one process with the
same microbatching and against the usual hand split (equal layers per stage). A second plan
is solved with ``optimize="memory"`` under a per-rank cap halfway between the least peak
the solver can reach and the equal-layers split's predicted peak, with the same schedule
(1F1B) and microbatch count, and its peak is measured beside the others'. Everything
measured is printed beside the plan's prediction; the plan, stage sources, a Perfetto
trace of one step and a PNG of predicted and measured
timelines with per-rank memory go to ``out_dir``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

__all__ = ["demo_workload", "run_measured_demo"]

N_LAYER, N_EMBD, N_HEAD, VOCAB, BATCH, SEQ, RANKS = 8, 256, 8, 16384, 16, 128, 2


def demo_workload() -> tuple[Any, tuple[Any, ...], Any, Any]:
    """The demo's model, inputs ``(BATCH, SEQ)`` token ids, target and loss (seed 0)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopart.apps.demo import gpt2_loss

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, vocab_size=VOCAB,
                     n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))  # (batch, seq)
    return GPT2LMHeadModel(cfg), (tokens,), tokens, gpt2_loss


def run_measured_demo(out_dir: str | Path = "autopart-out", *, steps: int = 7,
                      console: Console | None = None) -> dict[str, Any]:
    """Plan the demo model for 2 ranks, measure it, print and write the results.

    Returns:
        ``{"speedup", "fraction_of_ideal", "over_equal_layers", "losses_match",
        "memory_fits", ...}`` as measured (see the module docstring).
    """
    import autopart
    from autopart.apps.bench import SINGLE, run_arms
    from autopart.apps.figures import gantt
    from autopart.apps.report import print_plan
    from autopart.core.errors import InfeasiblePlanError
    from autopart.core.progress import phase
    from autopart.solver.predict import baseline_plan
    from autopart.trace import predict

    console = console or Console(width=None if Console().is_terminal else 120)
    out = Path(out_dir)
    torch.set_num_threads(1)  # plan as each rank runs: one thread
    model, args, target, loss_fn = demo_workload()
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"GPT-2-like: {N_LAYER} layers, n_embd {N_EMBD}, vocab {VOCAB} "
                  f"({n_params / 1e6:.1f} M parameters); batch {BATCH} x {SEQ}; planned for "
                  f"{RANKS} CPU ranks x 1 thread; torch {torch.__version__}")
    t0 = time.perf_counter()
    plan, profile = autopart.plan_model(model, args, devices=["cpu"] * RANKS, loss_fn=loss_fn,
                                        example_target=target, backend="distributed")
    compile_s = time.perf_counter() - t0
    print_plan(plan, console)
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in profile.timings_s.items())
    console.print(f"planning took {compile_s:.1f} s ({phases})")
    cluster = profile.cluster()
    m = plan.num_microbatches
    equal = baseline_plan(profile.costs, cluster, profile.options(), "uniform_layers",
                          kind="1f1b", num_microbatches=m)
    # a per-rank cap the equal-layers split (and the whole model on one process) exceeds:
    # halfway between the least peak the solver reaches and the equal split's predicted
    # peak; the same schedule and m, so where the cuts go and which stage recomputes are
    # all that differ
    fixed = {"schedule_kind": "1f1b", "stages_per_rank": 1, "num_microbatches": m}
    least = max(r.peak_memory_bytes for r in profile.solve(optimize="memory", **fixed).ranks)
    over = max(r.peak_memory_bytes for r in equal.ranks)
    cap = (least + over) // 2
    plans = {"autopart": plan, "equal layers": equal}
    if least < over:
        try:
            plans["autopart memory"] = profile.solve(optimize="memory", memory_cap_bytes=cap,
                                                     **fixed)
        except InfeasiblePlanError as exc:
            console.print(f"[red]no plan fits the demo's memory cap: {exc}[/red]")
    else:
        console.print(f"the equal split's predicted peak ({over / 2**20:.0f} MiB) is already "
                      f"the least the solver reaches ({least / 2**20:.0f} MiB): no memory arm")
    console.print(f"measuring on {RANKS} spawned processes (gloo, 1 thread each), "
                  f"{steps} steps per arm, arms alternated; the memory plan's peak only ...")
    with phase("run arms") as shown:  # on stderr, with the steps done
        results = run_arms("autopart.apps.showcase:demo_workload", plans, ranks=RANKS, steps=steps,
                           warmup=1, save_plan_to=out / "gpt2.plan.json", trace=["autopart"],
                           untimed=[n for n in ("autopart memory",) if n in plans],
                           on_step=shown.count)
    single = results[SINGLE]
    ideal = m * RANKS / (m + RANKS - 1)
    table = Table(title=f"step time, {RANKS} ranks x 1 thread, m = {m}, median of {steps}")
    for col in ("arm", "cuts", "schedule", "predicted s", "measured s", "spread",
                "speed-up", "of ideal"):
        table.add_column(col, justify="right")
    table.add_row("one process", "-", f"{m} microbatches", "-", f"{single.step_s:.3f}",
                  f"{single.spread:.0%}", "1.00x", "-")
    for name, p in plans.items():
        r = results[name]
        if not r.steps_s:
            continue  # measured for memory only
        speed = single.step_s / r.step_s
        table.add_row(name, str([c.position for c in p.cuts]),
                      f"{p.schedule_kind} v{p.stages_per_rank} m{p.num_microbatches}"
                      + (" recompute" if any(s.recompute for s in p.stages) else ""),
                      f"{p.predicted_step_time_us / 1e6:.3f}", f"{r.step_s:.3f}",
                      f"{r.spread:.0%}", f"{speed:.2f}x", f"{speed / ideal:.0%}")
    console.print(table)
    mem = Table(title=f"peak memory per rank (MiB), cap {cap / 2**20:.0f} MiB per rank")
    for col in ("arm", "plan", "predicted", "measured", "fits the cap"):
        mem.add_column(col, justify="right")
    mib = lambda xs: " / ".join(f"{x / 2**20:.0f}" for x in xs)  # noqa: E731
    mem.add_row("one process", f"{m} microbatches", "-", mib(single.peak_bytes),
                "yes" if max(single.peak_bytes) <= cap else "no")
    for name, p in plans.items():
        r = results[name]
        how = (f"{p.schedule_kind} m{p.num_microbatches}, cuts {[c.position for c in p.cuts]}"
               + "".join(f", stage {st.stage_index} recomputes" for st in p.stages
                         if st.recompute))
        mem.add_row(name, how, mib([x.peak_memory_bytes for x in p.ranks]), mib(r.peak_bytes),
                    "yes" if max(r.peak_bytes) <= cap else "no")
    console.print(mem)
    worst = max(abs(a - b) for a, b in zip(results["autopart"].losses, single.losses,
                                          strict=True))
    console.print(f"numerics: {len(single.losses)} AdamW steps, pipeline vs unpartitioned "
                  f"losses differ by at most {worst:.2e} (first {single.losses[0]:.6f})")
    out.mkdir(parents=True, exist_ok=True)
    measured = results["autopart"].trace
    predicted = predict(profile, plan)
    written = [out / "gpt2.plan.json", out / "stage_*.py"]
    if measured is not None:
        measured.save(out / "trace.json")
        predicted.trace.save(out / "trace_predicted.json")
        written += [out / "trace.json", out / "trace_predicted.json"]
        written.append(gantt(
            out / "timeline.png", [("predicted", predicted.trace), ("measured", measured)],
            peaks=[("predicted", [x.peak_memory_bytes for x in plan.ranks]),
                   ("measured", results["autopart"].peak_bytes)],
            title=f"demo GPT-2-like, {plan.schedule_kind} m={m} on {RANKS} ranks"))
    console.print("wrote " + ", ".join(str(p) for p in written)
                  + " (open trace.json in ui.perfetto.dev)")
    speedup = single.step_s / results["autopart"].step_s
    return {"speedup": speedup, "fraction_of_ideal": speedup / ideal,
            "over_equal_layers": results["equal layers"].step_s / results["autopart"].step_s,
            "losses_match": worst <= 1e-4, "max_loss_diff": worst,
            "memory_fits": ("autopart memory" in results
                            and max(results["autopart memory"].peak_bytes) <= cap),
            "equal_layers_fits": max(results["equal layers"].peak_bytes) <= cap,
            "compile_s": compile_s}
