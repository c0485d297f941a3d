"""predict_layout: the step time of a given (tp, pp, dp, ZeRO) plan on a cost graph, no search."""

from __future__ import annotations

from dataclasses import replace

from autopart.core.cluster import DeviceSpec
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.solver.layout_search import LayoutCandidate, LayoutOptions, evaluate_layout
from autopart.solver.options import SolveOptions

__all__ = ["predict_layout"]


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
    if plan.graph_fingerprint != costs.fingerprint:
        raise PlanError("the plan was made for another graph; predict it on the cost graph it "
                        "was solved on")
    tp, pp, dp, zero = plan.tp, len(plan.ranks), plan.dp, plan.zero_stage
    if tp * pp * dp != layout.num_gpus:
        raise PlanError(f"the plan's tp {tp} x pp {pp} x dp {dp} is not the layout's "
                        f"{layout.num_gpus} GPUs")
    recompute = {s.recompute for s in plan.stages}
    fixed = replace(options, schedule_kind=plan.schedule_kind,
                    num_microbatches=plan.num_microbatches, microbatch_candidates=None,
                    stages_per_rank=plan.stages_per_rank,
                    recompute=recompute.pop() if len(recompute) == 1 else None)
    cand = LayoutCandidate(tp, pp, dp, zero, 0.0, 0)
    layout = replace(layout, overlap_grad_reduce=plan.overlap_grad_reduce,  # as the plan runs
                     zero_layer_units=plan.zero_layer_units)
    return evaluate_layout(costs, device, fixed, layout, cand,
                           positions=tuple(c.position for c in plan.cuts)
                           ).predicted_step_time_us
