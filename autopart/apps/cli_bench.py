"""``autopart bench``: the benchmark report for a user's own model on N local ranks."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import typer

from autopart.core.errors import UsageError

__all__ = ["bench", "write_report"]


def _config(items: list[str], batch: int, seq: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--config {item!r}: expected KEY=VALUE, e.g. n_layer=4")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return {**out, "batch": batch, "seq": seq}


def bench(model: str = typer.Argument(..., help="hf:<transformers causal-LM class> or "
                                      "file.py:function returning (model, inputs, target, loss_fn)"),
          config: list[str] = typer.Option([], "--config", help="KEY=VALUE config override "
                                           "(hf: models)"),
          batch_size: int = typer.Option(8, min=1, help="batch size (hf: models)"),
          seq_len: int = typer.Option(128, min=1, help="sequence length (hf: models)"),
          ranks: int = typer.Option(2, min=2, help="local processes (gloo on CPU)"),
          steps: int = typer.Option(5, min=1, help="timed steps per arm"),
          num_microbatches: int = typer.Option(None, min=1, help="m (default: the solver's)"),
          schedule: str = typer.Option(None, help="schedule kind (default: the solver's): "
                                       "gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, "
                                       "dualpipev"),
          out: Path = typer.Option(Path("autopart-bench"), help="report folder")) -> None:
    """Plan MODEL for --ranks ranks, run the plan, the unpartitioned model and the baselines
    (equal layers; DeepSpeed's parameter balance) on real processes, and write a report."""
    import torch
    from rich.console import Console

    import autopart
    from autopart.apps.bench import SINGLE, load_workload, run_arms
    from autopart.core.progress import phase
    from autopart.solver.predict import baseline_plan
    from autopart.trace import predict

    console = Console()
    if model.startswith("hf:"):
        spec, cfg = model, _config(config, batch_size, seq_len)
    else:
        where, sep, func = model.rpartition(":")
        if not sep:
            raise UsageError(f"MODEL {model!r}: valid forms are hf:<class> or file.py:function")
        spec, cfg = (f"{Path(where).resolve()}:{func}" if where.endswith(".py") else model), {}
    torch.set_num_threads(1)
    net, args, target, loss_fn = load_workload(spec, dict(cfg))
    t0 = time.perf_counter()
    plan, profile = autopart.plan_model(net, args, devices=["cpu"] * ranks, loss_fn=loss_fn,
                                        example_target=target, num_microbatches=num_microbatches,
                                        schedule_kind=schedule, backend="distributed")
    plan_s = time.perf_counter() - t0
    cluster = profile.cluster()
    plans = {"autopart": plan}
    for name in ("uniform_layers", "deepspeed_parameters"):
        try:
            plans[name] = baseline_plan(profile.costs, cluster, profile.options(), name,
                                        kind="1f1b", num_microbatches=plan.num_microbatches)
        except autopart.PlanError as exc:
            console.print(f"baseline {name} skipped: {exc}")
    console.print(f"planned in {plan_s:.1f} s; running {len(plans) + 1} arms x {steps} steps on "
                  f"{ranks} processes ...")
    with phase("run arms") as shown:  # on stderr, with the steps done
        results = run_arms(spec, plans, ranks=ranks, steps=steps, config=cfg,
                           save_plan_to=out / "plan.json", on_step=shown.count)
    predicted = predict(profile, plan)
    path = write_report(out, model, plans, results, predicted, single_name=SINGLE,
                        facts={"ranks": ranks, "steps": steps, "plan_s": round(plan_s, 1),
                               "torch": torch.__version__, "python": platform.python_version(),
                               "machine": f"{platform.machine()}, {os.cpu_count()} cores"})
    console.print(path.read_text())
    console.print(f"wrote {path} and its figures in {out}/")


def write_report(out: Path, title: str, plans: dict[str, Any], results: dict[str, Any],
                 predicted: Any, *, single_name: str, facts: dict[str, Any]) -> Path:
    """``report.md`` + ``timeline.png`` (predicted vs measured, the first plan) +
    ``stages.png`` (per-stage busy time and per-rank peak memory, predicted vs measured);
    the report also holds the first plan's exposed communication per rank, predicted (its
    predicted trace) against the traced step's (:func:`autopart.apps.bench.exposed_comm_rows`).
    """
    from autopart.apps.bench import exposed_comm_rows
    from autopart.apps.figures import gantt, stage_bars

    out.mkdir(parents=True, exist_ok=True)
    single = results[single_name]
    first = next(iter(plans))
    plan = plans[first]
    m, p = plan.num_microbatches, len(plan.ranks)
    ideal = m * p / (m + p - 1)
    lines = [f"# autopart bench: {title}", "",
             f"{facts['machine']}; Python {facts['python']}, torch {facts['torch']}; "
             f"{p} gloo ranks x 1 thread; m = {m}; median of {facts['steps']} steps, arms "
             f"alternated; planning {facts['plan_s']} s.", "",
             "| arm | cuts | schedule | predicted s | measured s | spread | speed-up | of ideal "
             "| peak MiB per rank (pred / meas) |", "|---|---|---|---:|---:|---:|---:|---:|---|",
             f"| one process | - | {m} microbatches | - | {single.step_s:.3f} | "
             f"{single.spread:.0%} | 1.00x | - | - / {single.peak_bytes[0] / 2**20:.0f} |"]
    for name, pl in plans.items():
        r = results[name]
        speed = single.step_s / r.step_s
        peaks = ", ".join(f"{a.peak_memory_bytes / 2**20:.0f} / {b / 2**20:.0f}"
                          for a, b in zip(pl.ranks, r.peak_bytes, strict=True))
        lines.append(f"| {name} | {[c.position for c in pl.cuts]} | {pl.schedule_kind} "
                     f"v{pl.stages_per_rank} | {pl.predicted_step_time_us / 1e6:.3f} | "
                     f"{r.step_s:.3f} | {r.spread:.0%} | {speed:.2f}x | {speed / ideal:.0%} | "
                     f"{peaks} |")
    measured = results[first].trace
    exposed = exposed_comm_rows([predicted.trace.exposed_comm_us(r) for r in range(p)], measured)
    if exposed:
        lines += ["", f"Exposed communication per rank ({first}; the time each rank waits on a "
                  "collective: the tied sums and dp reductions after the schedule), predicted "
                  "vs the traced step:", "", *exposed]
    lines += ["", "![timeline](timeline.png)", "", "![stages](stages.png)", ""]
    if measured is not None:
        gantt(out / "timeline.png", [("predicted", predicted.trace), ("measured", measured)],
              peaks=[("predicted", [r.peak_memory_bytes for r in plan.ranks]),
                     ("measured", results[first].peak_bytes)], title=f"{title}: {first}")
        stage_bars(out / "stages.png", plan, predicted, measured, plans, results)
    path = out / "report.md"
    from autopart.core.jsonio import write_text_atomic

    write_text_atomic(path, "\n".join(lines))
    return path
