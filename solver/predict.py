"""What the cost model predicts for a given plan: step time, per-rank peaks and its trace."""

from __future__ import annotations

from dataclasses import dataclass

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.schedule import build_schedule, forward_schedule
from autopart.core.trace import Trace, TraceEvent
from autopart.solver._costmodel import CostModel
from autopart.solver._evaluate import evaluate
from autopart.solver.options import SolveOptions
from autopart.solver.simulate import StageCosts, simulate

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    """The cost model's account of one plan, replayed action by action.

    Attributes:
        step_time_us: the simulator's step time, µs (the plan's own figure is the closed
            form; both replay the same schedule).
        peak_memory_bytes: per rank, bytes (the plan's per-rank figure).
        stage_costs: per-stage costs the replay charged (µs per microbatch, bytes).
        trace: the predicted trace: per rank, each action's compute slice and, where the
            action sends, a ``"send"`` slice right after it.
    """

    step_time_us: float
    peak_memory_bytes: tuple[int, ...]
    stage_costs: StageCosts
    trace: Trace


def predict(plan: Plan, costs: CostGraph, cluster: Cluster, options: SolveOptions) -> Prediction:
    """Replay ``plan`` on the cost model the solver used.

    Args:
        plan: a plan for ``costs``' graph and ``cluster``'s ranks.
        costs: the cost graph it was solved on.
        cluster: its devices (``cluster.num_ranks`` ranks).
        options: the options it was solved with (batch size, training, optimizer state,
            split factor: what the cost model reads).

    Returns:
        The simulated step time, per-rank peaks, per-stage costs and predicted trace.

    Raises:
        PlanError: the plan's ranks or graph do not match ``cluster`` / ``costs``.
    """
    p = cluster.num_ranks
    if len(plan.ranks) != p:
        raise PlanError(f"the plan has {len(plan.ranks)} ranks but the cluster {p}; predict "
                        "it on the cluster it was solved for")
    if plan.graph_fingerprint != costs.fingerprint:
        raise PlanError("the plan was made for another graph (fingerprint "
                        f"{plan.graph_fingerprint[:12]} vs {costs.fingerprint[:12]}); predict it "
                        "on the cost graph it was solved on")
    model = CostModel(costs, cluster, batch_size=plan.batch_size, training=options.training,
                      state_factor=options.optimizer_state_bytes_per_param_byte,
                      split_factor=options.split_backward_factor)
    positions = tuple(c.position for c in plan.cuts)
    recompute = tuple(st.recompute for st in plan.stages)
    m, v, kind = plan.num_microbatches, plan.stages_per_rank, plan.schedule_kind
    cand = evaluate(model, None, kind, p, v, m, positions, None, recompute=recompute)
    if options.training:
        sched = build_schedule(kind, p, m, v, recompute=[s for s, r in enumerate(recompute) if r])
    else:
        sched = forward_schedule(p, m, v)
    c = cand.costs
    res = simulate(sched, c, record=True)
    events = []
    for rank, s, kind_, i, start, end in res.timeline:
        send = (c.send_fwd_us[s] if kind_ == "F"
                else c.send_bwd_us[s] if kind_ in "BI" else 0.0)
        compute_end = max(start, end - send)
        events.append(TraceEvent(rank, f"{s}{kind_}{i}", start, compute_end))
        if send > 0:
            events.append(TraceEvent(rank, f"send {s}{kind_}{i}", compute_end, end))
    meta = {"schedule_kind": kind, "num_microbatches": m, "stages_per_rank": v,
            "graph_fingerprint": plan.graph_fingerprint,
            "peak_memory_bytes": list(res.peak_memory_bytes),
            "step_time_us": round(res.step_time_us, 3)}
    return Prediction(step_time_us=res.step_time_us, peak_memory_bytes=res.peak_memory_bytes,
                      stage_costs=c, trace=Trace(tuple(events), "predicted", meta))
