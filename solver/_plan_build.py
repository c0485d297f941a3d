"""The plan of a chosen candidate, its Pareto frontier and the physical lower bounds."""

from __future__ import annotations

from collections.abc import Sequence

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.plan import (
    BaselineReport,
    Cut,
    LowerBounds,
    ParetoPoint,
    Plan,
    RankPlan,
    SolverReport,
    StagePlan,
)
from autopart.core.schedule import stage_ranks
from autopart.solver._candidate import Candidate
from autopart.solver._cost_model import CostModel
from autopart.solver.candidates import CutCandidates

__all__ = ["build_plan", "lower_bounds", "pareto"]


def pareto(cands: Sequence[Candidate]) -> tuple[ParetoPoint, ...]:
    """Non-dominated (step time, largest peak) points, ascending time, fitting or not."""
    pts = sorted({(round(c.step_us, 3), c.max_peak) for c in cands})
    out: list[ParetoPoint] = []
    for t, mem in pts:
        if not out or mem < out[-1].peak_memory_bytes:
            out.append(ParetoPoint(predicted_step_time_us=t, peak_memory_bytes=mem))
    return tuple(out)


def lower_bounds(model: CostModel, plan: Plan, p: int) -> LowerBounds:
    """Physical bounds: all compute of a step spread over the ranks (their speeds counted), or
    with host times all host issue time spread over the issuing threads, whichever is
    longer (with more CPU ranks than cores, the compute spread over the ranks times
    ``ranks_per_core``, :func:`autopart.solver.simulate.core_bound_us`); and all parameter
    state spread over the ranks."""
    n = len(model.costs.nodes)
    m = plan.num_microbatches
    work = m * model.time_us(0, n, model.ratio(m))
    step_lb = work / sum(1.0 / model.speed(r) for r in range(p))
    if model.runtime.ranks_per_core > 1.0:
        step_lb = max(step_lb, model.runtime.ranks_per_core * work / p)
    if model.has_host_times:
        threads = len({model.runtime.issue_thread_of(r) for r in range(p)})
        step_lb = max(step_lb, m * model.host_time_us(0, n) / threads)
    mem_lb = -(-sum(model.state_bytes.values()) // p)
    peak = max(r.peak_memory_bytes for r in plan.ranks)
    return LowerBounds(step_time_us=round(step_lb, 3), peak_memory_bytes=mem_lb,
                       step_time_ratio=round(plan.predicted_step_time_us / step_lb, 6)
                       if step_lb > 0 else 1.0,
                       peak_memory_ratio=round(peak / mem_lb, 6) if mem_lb > 0 else 1.0)


def build_plan(costs: CostGraph, cluster: Cluster, model: CostModel, cands: CutCandidates,
               best: Candidate, optimize: str, batch_size: int, versions: dict[str, str],
               report: SolverReport, baselines: tuple[BaselineReport, ...],
               frontier: tuple[ParetoPoint, ...]) -> Plan:
    """The :class:`Plan` of the chosen candidate."""
    nodes = costs.nodes
    ratio = model.ratio(best.m)
    p = cluster.num_ranks
    cuts = tuple(Cut(position=q, after_node=nodes[q - 1].name, before_node=nodes[q].name,
                     crossing_bytes=model.scale_bytes(model.crossing[q], ratio))
                 for q in best.positions)
    bounds = [0, *best.positions, len(nodes)]
    c = best.costs
    rank_of = stage_ranks(best.kind, p, best.v)
    stages = []
    for s in range(len(bounds) - 1):
        a, z, r = bounds[s], bounds[s + 1], rank_of[s]
        paths = [nd.module_path for nd in nodes[a:z] if nd.module_path]
        stages.append(StagePlan(
            stage_index=s, rank=r, device=cluster.device_names[r],
            first_node=nodes[a].name, last_node=nodes[z - 1].name, num_nodes=z - a,
            module_range=(paths[0], paths[-1]) if paths else ("", ""),
            num_parameters=best.param_info[s][1], param_bytes=best.param_info[s][0],
            predicted_fwd_us=round(c.fwd_us[s], 3),
            predicted_bwd_us=round(c.bwd_input_us[s] + c.bwd_weight_us[s], 3),
            predicted_comm_us=round(c.send_fwd_us[s] + c.send_bwd_us[s], 3),
            predicted_peak_memory_bytes=best.stage_peaks[s], recompute=best.recompute[s],
            recompute_kept=tuple(nd.name for nd in nodes[a:z] if nd.name in model.kept_nodes)
            if best.recompute[s] else ()))
    ranks = tuple(RankPlan(rank=r, device=cluster.device_names[r],
                           stage_indices=tuple(s for s in range(len(stages)) if rank_of[s] == r),
                           peak_memory_bytes=best.peaks[r]) for r in range(p))
    return Plan(
        graph_fingerprint=costs.fingerprint, cluster_fingerprint=cluster.fingerprint(),
        cost_source=costs.source, library_versions=versions, optimize=optimize,
        batch_size=batch_size, num_microbatches=best.m, schedule_kind=best.kind, cuts=cuts,
        stages=tuple(stages), ranks=ranks, predicted_step_time_us=round(best.step_us, 3),
        bubble_fraction=round(best.bubble, 6), solver=report, baselines=baselines,
        stages_per_rank=best.v, pareto=frontier, recompute_policy=model.recompute_policy)
