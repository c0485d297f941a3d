"""predict_layout: the step time of a given (tp, pp, dp, ZeRO) plan on a cost graph, no search,
and its communication exposed per pipeline rank."""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopart.core.cluster import DeviceSpec
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.solver._cost_model import CostModel
from autopart.solver.layout_candidates import pipeline_cluster, sharded_costs
from autopart.solver.layout_dp import dp_exposed_us
from autopart.solver.layout_search import LayoutCandidate, LayoutOptions, evaluate_layout
from autopart.solver.options import SolveOptions
from autopart.solver.predict import tied_ranks

__all__ = ["LayoutPrediction", "predict_layout", "predict_layout_comm", "predict_layout_peaks"]


@dataclass(frozen=True)
class LayoutPrediction:
    """What the layout search charges a given plan, with its exposed communication per
    pipeline rank.

    Attributes:
        step_us: the predicted step, µs (:func:`predict_layout`).
        dp_exposed_us: per pipeline rank, the dp collectives its thread waits for, µs
            (:func:`autopart.solver.layout_dp.dp_exposed_us`: ZeRO-0's reduction after the
            flush or the overlapped buckets' tail, ZeRO 1-3's all-gathers and
            reduce-scatters). On CPU ranks, whose collectives share the compute, the step
            charges an overlapped reduction whole, but the rank waits only for its tail:
            this is the tail.
        tied_sync_us: the tied parameters' gradient all-reduce after the schedule, µs
            (:meth:`autopart.solver._cost_model.CostModel.tied_sync_us`; part of the
            pipeline's step), run by :attr:`tied_ranks`.
        tied_ranks: the pipeline ranks holding a tied parameter
            (:func:`autopart.solver.predict.tied_ranks`).
        plan: the plan as priced (its stage times on these options).
    """

    step_us: float
    dp_exposed_us: tuple[float, ...]
    tied_sync_us: float
    tied_ranks: frozenset[int]
    plan: Plan

    @property
    def exposed_comm_us(self) -> tuple[float, ...]:
        """Per pipeline rank, the communication its thread is predicted to wait for, µs:
        its dp collectives, and the tied all-reduce where it holds a tied parameter. What a
        traced step measures as :meth:`autopart.core.trace.Trace.exposed_comm_us` (pipeline
        transfers and tensor-parallel collectives are priced inside the schedule, not
        here)."""
        return tuple(dp + (self.tied_sync_us if r in self.tied_ranks else 0.0)
                     for r, dp in enumerate(self.dp_exposed_us))


def predict_layout(plan: Plan, costs: CostGraph, device: DeviceSpec, options: SolveOptions,
                   layout: LayoutOptions) -> float:
    """What :func:`autopart.solver.layout_search.evaluate_layout` predicts for ``plan``'s own
    cuts, m, schedule and degrees on ``costs`` and ``options`` (its runtime included): to
    price one plan under another cost model, e.g. the plan a core-each model chose, on CPU
    ranks that share cores (``options.runtime.ranks_per_core``).

    The pipeline of one replica is costed at the plan's cuts (``evaluate_layout``'s
    ``positions``: :func:`autopart.solver.predict.plan_at`, then the simulator's replay), and
    the dp collectives are added as the search adds them, overlapped or after the flush as
    the plan's ``overlap_grad_reduce`` says, with ZeRO's units as its ``zero_layer_units``
    says.

    Args:
        plan: a plan of the layout search (its tp, dp, zero_stage, cuts, m, schedule).
        costs: the whole model's costs it was solved on.
        device: every rank's device.
        options: the pipeline options (``batch_size``: the global batch).
        layout: the GPU count and topology (its fixed degrees are not read).

    Returns:
        The predicted step, µs.

    Raises:
        PlanError: the plan is for another graph or another GPU count.
    """
    return _priced(plan, costs, device, options, layout)[0].predicted_step_time_us


def predict_layout_peaks(plan: Plan, costs: CostGraph, device: DeviceSpec,
                         options: SolveOptions, layout: LayoutOptions) -> tuple[int, ...]:
    """:func:`predict_layout`'s per-rank peaks: what the layout search charges each pipeline
    rank of ``plan`` (one GPU of its tp group), bytes, at the plan's own cuts, m, schedule,
    degrees and ZeRO units, on ``costs``.

    Args:
        plan, costs, device, options, layout: as for :func:`predict_layout`.

    Raises:
        PlanError: as :func:`predict_layout`.
    """
    return tuple(r.peak_memory_bytes for r in _priced(plan, costs, device, options, layout)[0].ranks)


def predict_layout_comm(plan: Plan, costs: CostGraph, device: DeviceSpec,
                        options: SolveOptions, layout: LayoutOptions) -> LayoutPrediction:
    """:func:`predict_layout`, with the communication each pipeline rank is predicted to
    wait for (:attr:`LayoutPrediction.exposed_comm_us`): the same pricing, read per rank.

    Args:
        plan, costs, device, options, layout: as for :func:`predict_layout`.

    Raises:
        PlanError: as :func:`predict_layout`.
    """
    priced, layout = _priced(plan, costs, device, options, layout)
    tp, pp, dp = plan.tp, len(plan.ranks), plan.dp * plan.cp  # the dp line: dp x cp GPUs
    sharded = sharded_costs(costs, tp, device, layout, options.runtime, ep=plan.ep, cp=plan.cp,
                            cp_attention=plan.cp_attention)
    runtime = options.runtime
    if runtime.collectives_share_compute and priced.overlap_grad_reduce:
        # the step prices the overlapped reduction as run after the flush (it slows the
        # compute it runs beside by as much); what the rank waits for is still the tail
        runtime = replace(runtime, collectives_share_compute=False)
    exposed = (dp_exposed_us(priced, layout, runtime, sharded)
               if options.training and dp > 1 else (0.0,) * pp)
    model = CostModel.for_options(sharded, pipeline_cluster(device, tp, pp, dp,
                                                             layout.topology),
                                  replace(options, recompute_policy=plan.recompute_policy))
    sync = model.tied_sync_us(tuple(c.position for c in plan.cuts), pp,
                              [st.rank for st in plan.stages])
    return LayoutPrediction(priced.predicted_step_time_us, tuple(exposed), sync,
                            tied_ranks(plan, sharded) if sync > 0 else frozenset(), priced)


def _priced(plan: Plan, costs: CostGraph, device: DeviceSpec, options: SolveOptions,
            layout: LayoutOptions) -> tuple[Plan, LayoutOptions]:
    """``plan`` priced by ``evaluate_layout`` at its own cuts, and the layout options it was
    priced with (the plan's overlap and units)."""
    if plan.graph_fingerprint != costs.fingerprint:
        raise PlanError("the plan was made for another graph; predict it on the cost graph it "
                        "was solved on")
    tp, pp, dp, zero = plan.tp, len(plan.ranks), plan.dp, plan.zero_stage
    if tp * pp * dp * plan.cp != layout.num_gpus:
        raise PlanError(f"the plan's tp {tp} x pp {pp} x dp {dp} x cp {plan.cp} is not the "
                        f"layout's {layout.num_gpus} GPUs")
    recompute = {s.recompute for s in plan.stages}
    fixed = replace(options, schedule_kind=plan.schedule_kind,
                    num_microbatches=plan.num_microbatches, microbatch_candidates=None,
                    stages_per_rank=plan.stages_per_rank,
                    recompute=recompute.pop() if len(recompute) == 1 else None,
                    recompute_policy=plan.recompute_policy)
    cand = LayoutCandidate(tp, pp, dp, zero, 0.0, 0, ep=plan.ep, cp=plan.cp,
                           cp_attention=plan.cp_attention)
    layout = replace(layout, overlap_grad_reduce=plan.overlap_grad_reduce,  # as the plan runs
                     zero_layer_units=plan.zero_layer_units,
                     sequence_parallel=plan.sequence_parallel, cp=plan.cp,
                     cp_attention=plan.cp_attention)
    priced = evaluate_layout(costs, device, fixed, layout, cand,
                             positions=tuple(c.position for c in plan.cuts),
                             recompute=tuple(s.recompute for s in plan.stages))
    return priced, layout
