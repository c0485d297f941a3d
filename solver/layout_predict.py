"""predict_layout: the step time of a given (tp, pp, dp, ZeRO) plan on a cost graph, no search."""

from __future__ import annotations

from dataclasses import replace

from autopart.core.cluster import DeviceSpec
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.solver.data_parallel import state_multiplier
from autopart.solver.layout_search import (
    LayoutOptions,
    _dp_cost,
    _pipeline_cluster,
    _replica_options,
    _sharded,
)
from autopart.solver.options import SolveOptions
from autopart.solver.predict import plan_at

__all__ = ["predict_layout"]


def predict_layout(plan: Plan, costs: CostGraph, device: DeviceSpec, options: SolveOptions,
                   layout: LayoutOptions) -> float:
    """What :func:`autopart.solver.layout_search.evaluate_layout` would predict for ``plan``'s
    own cuts, m, schedule and degrees on ``costs`` and ``options`` (its runtime included):
    to price one plan under another cost model, e.g. the plan a core-each model chose, on CPU
    ranks that share cores (``options.runtime.ranks_per_core``).

    The pipeline of one replica is costed at the plan's cuts
    (:func:`autopart.solver.predict.plan_at` on one GPU's share at tp, the replica's batch,
    pp ranks linked as placed, its final replay by the simulator), then the dp collectives of
    the rank with the most parameters are added (``ranks_per_core`` times longer when the
    ranks share cores), as the search adds them.

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
    sharded = _sharded(costs, tp, device, layout)
    mult = state_multiplier(zero, dp, options.optimizer_state_bytes_per_param_byte,
                            layout.gradient_factor)
    inner = replace(_replica_options(options, layout, dp), num_microbatches=None,
                    microbatch_candidates=None,
                    state_bytes_per_param_byte=mult if options.training else None)
    pipe = plan_at(sharded, _pipeline_cluster(device, tp, pp, dp, layout.topology), inner,
                   [c.position for c in plan.cuts], kind=plan.schedule_kind,
                   num_microbatches=plan.num_microbatches,
                   stages_per_rank=plan.stages_per_rank,
                   recompute=[s.recompute for s in plan.stages])
    if not options.training:
        return pipe.predicted_step_time_us
    largest = max((nd.param_bytes for nd in sharded.nodes), default=0)
    held = max(sum(pipe.stages[s].param_bytes for s in r.stage_indices) for r in pipe.ranks)
    shared = max(1.0, options.runtime.ranks_per_core)
    return pipe.predicted_step_time_us + shared * _dp_cost(
        held, largest, dp, zero, tp, layout).step_us(plan.num_microbatches)
