"""Plan tables for the terminal (rich)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from autopart.core.plan import Plan, StagePlan

__all__ = ["plan_table", "print_plan", "certificate_table", "pareto_table", "skipped_baselines_table",
           "print_certificate", "layout_table", "print_layout"]


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _short(path: str) -> str:
    """A module path cut after its first numeric part: ``transformer.h.3.mlp.c_fc`` -> ``transformer.h.3``."""
    if not path:
        return "(top level)"
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return path


def _recompute_cell(plan: Plan, st: StagePlan) -> str:
    """What a stage recomputes: ``"no"``, its policy, and under ``"op"`` how many of its
    nodes it keeps, by kind (the FX name without its counter: ``linear_3`` is a linear)."""
    if not st.recompute:
        return "no"
    if plan.recompute_policy != "op":
        return plan.recompute_policy
    kinds = Counter(re.sub(r"_\d+$", "", name) for name in st.recompute_kept)
    top = ", ".join(f"{k} {n}" for k, n in kinds.most_common(3))
    return f"op: {len(st.recompute_kept)}/{st.num_nodes} kept" + (f" ({top})" if top else "")


def plan_table(plan: Plan) -> Table:
    """One row per stage: module range, parameters, predicted fwd+bwd time per microbatch, memory."""
    table = Table(title=f"autopart plan: {plan.num_stages} stages, m={plan.num_microbatches}, "
                        f"{plan.schedule_kind}, optimize={plan.optimize}")
    for col, justify in (("stage", "right"), ("device", "left"), ("modules", "left"),
                         ("params", "right"), ("fwd+bwd ms/mb", "right"), ("comm ms/mb", "right"),
                         ("peak memory", "right"), ("recompute", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for st in plan.stages:
        first, last = st.module_range
        modules = _short(first) if first == last else f"{_short(first)} … {_short(last)}"
        table.add_row(str(st.stage_index), st.device, modules, f"{st.num_parameters / 1e6:.2f} M",
                      f"{(st.predicted_fwd_us + st.predicted_bwd_us) / 1e3:.1f}",
                      f"{st.predicted_comm_us / 1e3:.2f}", _gib(st.predicted_peak_memory_bytes),
                      _recompute_cell(plan, st))
    s = plan.solver
    table.caption = (f"predicted step {plan.predicted_step_time_us / 1e3:.1f} ms, bubble "
                     f"{plan.bubble_fraction:.1%}; solver {s.name} {s.status}, objective "
                     f"{s.objective / 1e3:.2f} ms, bound {s.bound / 1e3:.2f} ms, gap {s.gap:.2%}, "
                     f"{s.wall_s:.2f} s; costs {plan.cost_source}")
    return table


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print :func:`plan_table` (and the baselines, when the plan has any)."""
    console = console or Console(width=None if Console().is_terminal else 120)
    console.print(plan_table(plan))
    if plan.baselines:
        base = Table(title="baselines on the same costs")
        base.add_column("partitioner")
        base.add_column("step ms", justify="right")
        base.add_column("vs autopart", justify="right")
        base.add_column("peak memory", justify="right")
        base.add_column("recompute")
        for b in plan.baselines:
            base.add_row(b.name, f"{b.predicted_step_time_us / 1e3:.1f}",
                         _ratio(b.predicted_step_time_us, plan.predicted_step_time_us),
                         _gib(b.peak_memory_bytes) + ("" if b.fits else " (over cap)"),
                         "all stages" if b.recompute else "none")
        console.print(base)


def layout_table(plan: Plan) -> Table:
    """The plan's parallel axes, memory per GPU and predicted TFLOP/s per GPU.

    TFLOP/s per GPU = ``plan.model_flops`` (forward + backward of the whole model, recompute
    excluded) / step time / GPUs; "-" when the plan records no FLOP count.
    """
    table = Table(title="parallel layout (per GPU)")
    table.add_column("axis")
    table.add_column("value", justify="right")
    zero = ("none", "optimizer state", "+ gradients", "+ parameters")[plan.zero_stage]
    peak = max(r.peak_memory_bytes for r in plan.ranks)
    rows = [("tensor parallel (tp)", str(plan.tp)), ("pipeline ranks (pp)", str(len(plan.ranks))),
            ("data parallel (dp)", str(plan.dp)),
            ("expert parallel (ep, inside dp)", str(plan.ep)),
            ("context parallel (cp)", "1 (whole sequences)" if plan.cp == 1 else
             f"{plan.cp} (each sequence over {plan.cp} GPUs; " + (
                 "keys and values all-gathered)" if plan.cp_attention == "all_gather" else
                 "Ulysses: all-to-alls to heads / cp of the heads)")),
            ("ZeRO stage", f"{plan.zero_stage} ({zero})"),
            ("dp gradient reduction", "none" if plan.dp * plan.cp == 1 else
             "overlapped with the last backward" if plan.overlap_grad_reduce
             else "after the schedule"),
            ("sequence parallel", "none" if plan.tp == 1 else
             "norms and residuals on 1/tp of the tokens" if plan.sequence_parallel
             else "off (tokens whole between tp pairs)"),
            ("ZeRO gathers", "none" if plan.zero_stage == 0 or plan.dp * plan.cp == 1 else
             "one layer at a time" if plan.zero_layer_units
             else "whole parameters" if plan.zero_stage == 1 else "one stage at a time"),
            ("GPUs", str(plan.num_gpus)),
            ("global batch / microbatches per replica",
             f"{plan.batch_size} / {plan.num_microbatches}"),
            ("sharded parameters", str(len(plan.sharded_parameters))),
            ("largest memory per GPU", _gib(peak))]
    step_s = plan.predicted_step_time_us / 1e6
    tflops = (f"{plan.model_flops / step_s / plan.num_gpus / 1e12:.1f}"
              if plan.model_flops and step_s > 0 else "-")
    rows.append(("predicted TFLOP/s per GPU (model FLOPs, recompute excluded)", tflops))
    for name, value in rows:
        table.add_row(name, value)
    return table


def print_layout(plan: Plan, console: Console | None = None) -> None:
    """Print :func:`layout_table`."""
    console = console or Console(width=None if Console().is_terminal else 120)
    console.print(layout_table(plan))


def _ratio(value: float, reference: float) -> str:
    """``value / reference`` as ``1.25x``; ``-`` when the reference is 0 (e.g. a hand-written plan)."""
    return f"{value / reference:.2f}x" if reference > 0 else "-"


def _field(obj: Any, name: str) -> Any:
    """``obj.name`` or ``obj[name]`` (Pareto points may be dataclasses or plain dicts)."""
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def certificate_table(plan: Plan) -> Table:
    """The solver's certificate: every field of ``plan.solver`` (status, objective, bound, gap, …)
    and, when the plan has them, its physical lower bounds and its ratio to them.

    Objective and bound are shown as recorded (µs for a step-time objective), the gap as a
    percentage, the wall time in seconds; fields added to the solver report later are listed
    under their own names.
    """
    table = Table(title="solver certificate")
    table.add_column("field")
    table.add_column("value", justify="right")
    for f in dataclasses.fields(plan.solver):
        value = getattr(plan.solver, f.name)
        if f.name == "gap" and isinstance(value, float):
            text = f"{value:.2%}"
        elif f.name == "wall_s" and isinstance(value, float):
            text = f"{value:.2f} s"
        elif isinstance(value, float):
            text = f"{value:,.3f}"
        else:
            text = str(value)
        table.add_row(f.name, text)
    table.add_row("predicted step", f"{plan.predicted_step_time_us / 1e3:.2f} ms")
    table.add_row("largest rank peak", _gib(max((r.peak_memory_bytes for r in plan.ranks), default=0)))
    bounds = getattr(plan, "lower_bounds", None)
    if bounds is not None:
        table.add_row("step-time lower bound", f"{_field(bounds, 'step_time_us') / 1e3:.2f} ms "
                      f"(plan {_field(bounds, 'step_time_ratio'):.2f}x)")
        table.add_row("memory floor", f"{_gib(_field(bounds, 'peak_memory_bytes'))} "
                      f"(plan {_field(bounds, 'peak_memory_ratio'):.2f}x)")
    return table


def pareto_table(plan: Plan) -> Table | None:
    """The time-vs-memory Pareto frontier the search saw (``plan.pareto``), or None when absent."""
    points = tuple(getattr(plan, "pareto", ()) or ())
    if not points:
        return None
    table = Table(title="time vs memory frontier seen by the search")
    table.add_column("step ms", justify="right")
    table.add_column("largest rank peak", justify="right")
    for pt in sorted(points, key=lambda p: (_field(p, "predicted_step_time_us"),
                                            _field(p, "peak_memory_bytes"))):
        table.add_row(f"{_field(pt, 'predicted_step_time_us') / 1e3:.2f}",
                      _gib(_field(pt, "peak_memory_bytes")))
    return table


def skipped_baselines_table(skipped: Sequence[tuple[str, str]]) -> Table:
    """Baselines that could not partition this graph, ``(name, reason)`` rows."""
    table = Table(title="baselines not applicable")
    table.add_column("partitioner")
    table.add_column("why", overflow="fold")
    for name, reason in skipped:
        table.add_row(name, reason)
    return table


def print_certificate(plan: Plan, console: Console | None = None) -> None:
    """Print :func:`certificate_table` and, when the plan has one, :func:`pareto_table`."""
    console = console or Console(width=None if Console().is_terminal else 120)
    console.print(certificate_table(plan))
    frontier = pareto_table(plan)
    if frontier is not None:
        console.print(frontier)
