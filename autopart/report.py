"""Plan tables for the terminal (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autopart.plan import Plan

__all__ = ["plan_table", "print_plan"]


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


def plan_table(plan: Plan) -> Table:
    """One row per stage: module range, parameters, predicted fwd+bwd time per microbatch, memory."""
    table = Table(title=f"autopart plan: {plan.num_stages} stages, m={plan.num_microbatches}, "
                        f"{plan.schedule_kind}, optimize={plan.optimize}")
    for col, justify in (("stage", "right"), ("device", "left"), ("modules", "left"),
                         ("params", "right"), ("fwd+bwd ms/mb", "right"), ("comm ms/mb", "right"),
                         ("peak memory", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for st in plan.stages:
        first, last = st.module_range
        modules = _short(first) if first == last else f"{_short(first)} … {_short(last)}"
        table.add_row(str(st.stage_index), st.device, modules, f"{st.num_parameters / 1e6:.2f} M",
                      f"{(st.predicted_fwd_us + st.predicted_bwd_us) / 1e3:.1f}",
                      f"{st.predicted_comm_us / 1e3:.2f}", _gib(st.predicted_peak_memory_bytes))
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
        for b in plan.baselines:
            base.add_row(b.name, f"{b.predicted_step_time_us / 1e3:.1f}",
                         f"{b.predicted_step_time_us / plan.predicted_step_time_us:.2f}x",
                         _gib(b.peak_memory_bytes))
        console.print(base)
