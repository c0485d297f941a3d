"""What the cost model predicts for a given plan: step time, per-rank peaks and its trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.plan import Plan, SolverReport
from autopart.core.schedule import build_schedule, forward_schedule
from autopart.core.trace import Trace, TraceEvent
from autopart.solver._candidate import evaluate
from autopart.solver._cost_model import CostModel
from autopart.solver._plan_build import build_plan
from autopart.solver.baselines import baseline_partitions
from autopart.solver.options import SolveOptions
from autopart.solver.simulate import StageCosts, simulate
from autopart.solver.simulate_memory import device_peaks

__all__ = ["Prediction", "predict", "plan_at", "baseline_plan", "tied_ranks"]


@dataclass(frozen=True)
class Prediction:
    """The cost model's account of one plan, replayed action by action.

    Attributes:
        step_time_us: the simulator's step time, µs (the plan's own figure is the closed
            form; both replay the same schedule).
        peak_memory_bytes: per rank, bytes (the plan's per-rank figure).
        stage_costs: per-stage costs the replay charged (µs per microbatch, bytes).
        trace: the predicted trace: per rank, each action's compute slice and, where the
            action sends, a ``"send"`` slice right after it; where tied parameters' gradients
            are summed after the schedule, a ``"reduce"`` slice closing every rank's step,
            and on the ranks holding them that all-reduce on the comm lane (``"reduce
            grads"``) and exposed on the compute lane (``"exposed reduce grads"``), as a
            measured trace names them (:meth:`autopart.core.trace.Trace.exposed_comm_us`).
        host_bound_us: the busiest issuing thread's host time, µs, which the step never
            undercuts (0.0 when the profile has no host times;
            :func:`autopart.solver.simulate.host_bound_us`). The trace's slices do not show
            that wait.
        device_peak_bytes: per device that several of the one-process runtime's ranks name
            (stages of the local runtime on one GPU), the most those ranks hold at once on
            the replayed times, bytes (:func:`autopart.solver.simulate_memory.device_peaks`; at
            most the sum of their ``peak_memory_bytes``); a device with one rank is absent
            (its rank's peak is the device's).
    """

    step_time_us: float
    peak_memory_bytes: tuple[int, ...]
    stage_costs: StageCosts
    trace: Trace
    host_bound_us: float = 0.0
    device_peak_bytes: dict[str, int] = field(default_factory=dict)


def predict(plan: Plan, costs: CostGraph, cluster: Cluster, options: SolveOptions) -> Prediction:
    """Replay ``plan`` on the cost model the solver used.

    Args:
        plan: a plan for ``costs``' graph and ``cluster``'s ranks.
        costs: the cost graph it was solved on.
        cluster: its devices (``cluster.num_ranks`` ranks).
        options: the options it was solved with (batch size, training, optimizer state,
            the runtime's costs: what the cost model reads).

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
    model = CostModel.for_options(costs, cluster,
                                  replace(options, recompute_policy=plan.recompute_policy),
                                  batch_size=plan.batch_size,
                                  kept_nodes=plan.recompute_kept_nodes)
    positions = tuple(c.position for c in plan.cuts)
    recompute = tuple(st.recompute for st in plan.stages)
    m, v, kind = plan.num_microbatches, plan.stages_per_rank, plan.schedule_kind
    cand = evaluate(model, None, kind, p, v, m, positions, None, recompute=recompute)
    if options.training:
        sched = build_schedule(kind, p, m, v, recompute=[s for s, r in enumerate(recompute) if r])
    else:
        sched = forward_schedule(p, m, v, kind=kind)
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
    step = res.step_time_us + cand.sync_us
    if cand.sync_us > 0:  # the tied parameters' all-reduce closes the step on every rank
        ends = {r: max((e.end_us for e in events if e.rank == r), default=0.0)
                for r in range(p)}
        events += [TraceEvent(r, "reduce", res.step_time_us, step) for r in range(p)]
        for k in sorted(tied_ranks(plan, costs)):  # ... and runs on the ranks holding them,
            # each waiting in it from its own last action (for the others to arrive) on
            events += [TraceEvent(k, "reduce grads", ends[k], step, "comm"),
                       TraceEvent(k, "exposed reduce grads", ends[k], step)]
    meta = {"schedule_kind": kind, "num_microbatches": m, "stages_per_rank": v,
            "graph_fingerprint": plan.graph_fingerprint,
            "peak_memory_bytes": list(res.peak_memory_bytes),
            "step_time_us": round(step, 3)}
    if c.has_host:
        meta["host_bound_us"] = round(res.host_bound_us, 3)
    on: dict[str, list[int]] = {}
    for r in plan.ranks:
        on.setdefault(r.device, []).append(r.rank)
    shared = ({d: g for d, g in on.items() if len(g) > 1}
              if not options.runtime.ranks_are_processes else {})  # a process each: its own
    by_device = dict(zip(shared, device_peaks(sched, c, res.timeline, list(shared.values())),
                         strict=True))
    if by_device:
        meta["device_peak_bytes"] = by_device
    return Prediction(step_time_us=step, peak_memory_bytes=res.peak_memory_bytes,
                      stage_costs=c, trace=Trace(tuple(events), "predicted", meta),
                      host_bound_us=res.host_bound_us, device_peak_bytes=by_device)


def tied_ranks(plan: Plan, costs: CostGraph) -> frozenset[int]:
    """The ranks of ``plan`` that hold a trainable parameter stages of another rank read too
    (GPT-2's tied ``wte`` and head): they all-reduce its gradient after the schedule
    (:meth:`autopart.solver._cost_model.CostModel.tied_sync_us` prices that all-reduce).

    Args:
        plan: a plan solved on ``costs`` (its stages' node counts index ``costs.nodes``).
        costs: the cost graph.
    """
    readers: dict[str, set[int]] = {}
    start = 0
    for st in plan.stages:
        for nd in costs.nodes[start:start + st.num_nodes]:
            for name in nd.params:
                if name in costs.trainable:
                    readers.setdefault(name, set()).add(st.rank)
        start += st.num_nodes
    return frozenset(r for ranks in readers.values() if len(ranks) > 1 for r in ranks)


def plan_at(costs: CostGraph, cluster: Cluster, options: SolveOptions,
            positions: tuple[int, ...] | list[int], *, kind: str, num_microbatches: int,
            stages_per_rank: int = 1, recompute: bool | Sequence[bool] = False,
            name: str = "manual") -> Plan:
    """The plan of given cuts, costed like the solver's own (no search): to run a baseline
    partition or a hand split under the same runtime and compare predictions.

    Args:
        costs, cluster, options: as for :func:`autopart.solver.solve` (``options`` gives the
            batch size, training, optimizer state and the runtime's costs).
        positions: cut positions (node indices), ``ranks x stages_per_rank - 1`` of them.
        kind, num_microbatches, stages_per_rank: the schedule.
        recompute: every stage recomputes its forward (True), none does (False, the
            default), or one flag per stage.
        name: the solver name recorded in ``plan.solver`` (status ``"FIXED"``).

    Raises:
        PlanError: a position count that does not match the stages, or positions out of order.
    """
    p, v = cluster.num_ranks, stages_per_rank
    positions = tuple(positions)
    if len(positions) != p * v - 1 or list(positions) != sorted(set(positions)):
        raise PlanError(f"{len(positions)} cut positions {list(positions)} for {p} ranks x "
                        f"{v} stages per rank: give {p * v - 1} ascending, distinct positions")
    if options.recompute_policy == "auto":
        options = replace(options, recompute_policy="full")
    model = CostModel.for_options(costs, cluster, options)
    cand = evaluate(model, None, kind, p, v, num_microbatches, positions, None,
                    recompute=recompute if isinstance(recompute, bool) else tuple(recompute)
                    ).simulated()
    report = SolverReport("FIXED", cand.step_us, cand.step_us, 0.0, 0.0, name=name)
    return build_plan(costs, cluster, model, None, cand, options.optimize, options.batch_size,  # type: ignore[arg-type]
                      dict(options.library_versions), report, (), ())


def baseline_plan(costs: CostGraph, cluster: Cluster, options: SolveOptions, baseline: str, *,
                  kind: str, num_microbatches: int, recompute: bool = False) -> Plan:
    """:func:`plan_at` the cuts a baseline partitioner makes onto ``cluster``'s ranks
    (``"uniform_layers"``: equal layers per stage, the usual hand split;
    ``"deepspeed_parameters"``, ``"pippy_equal_size"``, ``"torchgpipe_balance_by_time"``).

    Raises:
        PlanError: an unknown baseline name, or one that does not apply to this graph.
    """
    cuts = dict(baseline_partitions(costs, cluster.num_ranks))
    if baseline not in cuts:
        raise PlanError(f"baseline {baseline!r} does not apply to this graph onto "
                        f"{cluster.num_ranks} ranks; choose one of {sorted(cuts)}")
    return plan_at(costs, cluster, options, cuts[baseline], kind=kind,
                   num_microbatches=num_microbatches, recompute=recompute, name=baseline)
