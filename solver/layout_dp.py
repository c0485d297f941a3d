"""The data-parallel collectives of a layout's plan, as the runtime runs them: ZeRO-0's
all-reduce after the flush or overlapped with each stage's last backward, ZeRO 1-3's FSDP2
gathers and reduce-scatters per stage or per layer unit, and what of them a step exposes."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

from autopart.core.costgraph import CostGraph, NodeCost, layer_of_path
from autopart.core.layout import grad_bucket_elements
from autopart.core.plan import Plan
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.schedule import splits_backward
from autopart.solver._closed_form import closed_form_step_us
from autopart.solver.data_parallel import (
    DataParallelCost,
    UnitSegment,
    data_parallel_cost,
    fsdp_collective_us,
    gradient_all_reduce_us,
    layer_units_exposed_us,
    overlapped_reduction_us,
)
from autopart.solver.expert_parallel_costs import expert_params
from autopart.solver.layout_options import LayoutOptions
from autopart.solver.options import SolveOptions
from autopart.solver.stage_costs import StageCosts

__all__ = ["dp_exposed_us", "dp_step_us", "layer_units", "layer_units_overlap", "without_experts"]


def _dp_cost(param_bytes: int, dp: int, zero: int, tp: int, layout: LayoutOptions,
             runtime: RuntimeDescription, units: int = 1,
             link_gpus: int | None = None) -> DataParallelCost:
    """The dp collectives of one rank; each pays the runtime's fixed cost per collective
    after no work (they follow one another after the flush), per FSDP unit at ZeRO 1-3, and
    the copies around them; on the link of ``link_gpus`` GPUs (default ``tp x dp``)."""
    bw, lat = layout.topology.link(tp * dp if link_gpus is None else link_gpus)
    return data_parallel_cost(param_bytes, dp=dp, zero_stage=zero,
                              bandwidth_bytes_per_s=bw, latency_us=lat,
                              gradient_factor=layout.gradient_factor,
                              overhead_us=runtime.collective_overhead_at(0.0),
                              copy_bytes_per_s=runtime.copy_bytes_per_s, units=units,
                              reduce_scatter_as_all_reduce=runtime.reduce_scatter_as_all_reduce)


def layer_units(plan: Plan, costs: CostGraph, per_layer: bool | None = None
                ) -> tuple[int, ...]:
    """Per pipeline rank of ``plan``, the FSDP units its stages run under
    ``plan.zero_layer_units`` (or ``per_layer`` where given): in each stage, one per layer
    its parameters belong to (:func:`autopart.core.costgraph.layer_of_path`) and one for the
    rest (the root), as ``codegen.fsdp_units.group_layers`` groups them where it can; 1 per
    stage without layer units.

    Args:
        plan: a plan of the layout search, solved on ``costs`` (its stages' node counts
            index ``costs.nodes``).
        costs: the cost graph the plan was solved on (tp's share).
        per_layer: count per layer (default: as the plan says).
    """
    units = [0] * len(plan.ranks)
    for st, n in zip(plan.stages, _stage_units(plan, costs, per_layer), strict=True):
        units[st.rank] += n
    return tuple(units)


def _stage_nodes(plan: Plan, costs: CostGraph) -> list[tuple[NodeCost, ...]]:
    """Per stage of ``plan``, its nodes of ``costs`` (the stages' node counts in order)."""
    bounds = list(itertools.accumulate((st.num_nodes for st in plan.stages), initial=0))
    return [costs.nodes[a:z] for a, z in itertools.pairwise(bounds)]


def _stage_units(plan: Plan, costs: CostGraph, per_layer: bool | None) -> tuple[int, ...]:
    """:func:`layer_units` per stage."""
    per_layer = plan.zero_layer_units if per_layer is None else per_layer
    return tuple(max(1, len({layer_of_path(p) for nd in nodes for p in nd.params
                             if p in costs.trainable} if per_layer else set()))
                 for nodes in _stage_nodes(plan, costs))


def without_experts(plan: Plan, costs: CostGraph | None, degrees: tuple[int, int, int, bool],
                    layout: LayoutOptions, runtime: RuntimeDescription, ep: int | None = None
                    ) -> tuple[Plan, CostGraph | None, tuple[float, ...]]:
    """``plan`` and ``costs`` with the expert weights left out of what the dp collectives
    carry (out of each stage's parameters, and out of ``costs.trainable``, which ZeRO's
    layer units read), and per pipeline rank the all-reduce of their gradients after the
    flush, µs.

    An ep rank's experts are its own: ZeRO leaves them whole and the dense gradients' dp
    average leaves them out; their gradients are averaged over the ``dp / ep`` replicas
    holding the same experts (``autopart/runtime/distributed/_grads.py``'s ``ExpertGrads``,
    Megatron-Core's expert data parallel), after the flush and before the dense reduction,
    and not at all where ``ep = dp``. Priced as ZeRO-0's all-reduce of that many bytes
    (:func:`_dp_cost`: ring, fixed cost, the three copies) on the dp line's link,
    ``runtime.ranks_per_core`` times longer where CPU ranks outnumber the cores. ``plan``
    itself and no time at ep 1 or without ``costs``.

    Args:
        plan: a training plan of the layout search solved on ``costs``.
        costs: the cost graph the plan was solved on (one ep rank's share), or None.
        degrees: ``(tp, dp x cp, ZeRO stage, overlapped ZeRO-0 reduction)``; ep > 1 runs
            only at cp = 1, so the expert replicas are ``dp / ep``.
        layout, runtime: the link and the collectives' costs.
        ep: the ep degree (default ``plan.ep``; the layout search prices a replica's plan
            before it carries its layout's degrees).
    """
    ep = plan.ep if ep is None else ep
    dense, held = _split_experts(plan, costs, ep)
    if costs is not None and any(held):
        costs = replace(costs, trainable=costs.trainable - _experts_of(costs, ep))
    return dense, costs, tuple(_expert_reduce_us(b, degrees, layout, runtime, ep) for b in held)


def _split_experts(plan: Plan, costs: CostGraph | None, ep: int
                   ) -> tuple[Plan, tuple[int, ...]]:
    """``plan`` with its stages' expert weights left out of their parameters, and the
    expert bytes each pipeline rank holds, at ep (:func:`without_experts`)."""
    if ep == 1 or costs is None:
        return plan, (0,) * len(plan.ranks)
    experts = _experts_of(costs, ep)
    held = [0] * len(plan.ranks)
    stages = []
    for st, nodes in zip(plan.stages, _stage_nodes(plan, costs), strict=True):
        mine = dict.fromkeys(p for nd in nodes for p in nd.params if p in experts)
        nbytes = sum(costs.param_sizes[p] for p in mine)
        numel = sum(costs.param_numel[p] for p in mine)
        held[st.rank] += nbytes
        stages.append(replace(st, param_bytes=max(st.param_bytes - nbytes, 0),
                              num_parameters=max(st.num_parameters - numel, 0)))
    return replace(plan, stages=tuple(stages)), tuple(held)


def _experts_of(costs: CostGraph, ep: int) -> frozenset[str]:
    """The trainable expert weights of ``costs`` that ep splits (none at ep 1)."""
    return expert_params(costs) & costs.trainable if ep > 1 else frozenset()


def _expert_reduce_us(nbytes: float, degrees: tuple[int, int, int, bool],
                      layout: LayoutOptions, runtime: RuntimeDescription, ep: int) -> float:
    """One rank's all-reduce of ``nbytes`` of expert weights' gradients over the ``dp / ep``
    replicas holding them, once a step after the flush, µs (:func:`without_experts`)."""
    tp, line, _, _ = degrees
    shared = max(1.0, runtime.ranks_per_core)
    return shared * _dp_cost(int(nbytes), line // ep, 0, tp, layout, runtime,
                             link_gpus=tp * line).per_step_us


def layer_units_overlap(zero: int, per_layer: bool, runtime: RuntimeDescription) -> bool:
    """Whether ZeRO ``zero``'s collectives are priced by what they leave exposed under each
    layer unit's compute, every microbatch (:func:`_zero23_layers_exposed`): ZeRO 2-3 with
    layer units on a runtime whose collectives run beside compute (GPUs)."""
    return zero in (2, 3) and per_layer and not runtime.collectives_share_compute


def _bucket_us(dp: int, tp: int, layout: LayoutOptions,
               runtime: RuntimeDescription) -> Callable[[float], float]:
    """One ZeRO-0 bucket's all-reduce over dp on the layout's link, µs by gradient bytes
    (:func:`gradient_all_reduce_us` with the runtime's fixed cost and copy rate)."""
    bw, lat = layout.topology.link(tp * dp)
    overhead, copy = runtime.collective_overhead_at(0.0), runtime.copy_bytes_per_s
    return lambda nbytes: gradient_all_reduce_us(nbytes, dp, bw, lat, overhead, copy)


def _hides_reduction(layout: LayoutOptions, zero: int, dp: int,
                     options: SolveOptions) -> tuple[bool, bool]:
    """Whether a layout's plan overlaps ZeRO-0's gradient all-reduce (the plan's
    ``overlap_grad_reduce``), and whether that hides any of it (not where the runtime's
    collectives run on the ranks' own compute: CPU ranks)."""
    overlap = layout.overlap_grad_reduce and zero == 0 and dp > 1 and options.training
    return overlap, overlap and not options.runtime.collectives_share_compute


def _even_bucket_us(grad_bytes: float, elements: int, pp: int, dp: int, tp: int,
                    layout: LayoutOptions, runtime: RuntimeDescription) -> float:
    """The last bucket of an even share of ``elements`` gradient elements (``grad_bytes``
    in all) over pp ranks, µs: what the rank whose last backward ends the step leaves
    exposed at least, whatever the partition."""
    per_element = grad_bytes / elements if elements else 0.0
    return _bucket_us(dp, tp, layout, runtime)(
        min(-(-elements // pp), grad_bucket_elements(dp)) * per_element)


def dp_exposed_us(plan: Plan, layout: LayoutOptions, runtime: RuntimeDescription,
                  costs: CostGraph | None = None) -> tuple[float, ...]:
    """Per pipeline rank of ``plan`` (a training plan of the layout search), how long its
    thread waits on its dp collectives, µs: ZeRO 0-1's run after its schedule's last action
    and the step grows by the largest; ZeRO 2-3's run inside every microbatch's forward and
    backward (``m`` times its stages' share here) and the step grows by :func:`dp_step_us`.

    ZeRO-0 with ``plan.overlap_grad_reduce`` on a runtime whose collectives do not share the
    ranks' compute: the tail of the buckets launched during each stage's last backward
    (:func:`autopart.solver.data_parallel.overlapped_reduction_us` on the plan's stage
    times). Otherwise the whole of them after the flush (:func:`data_parallel_cost` of the
    rank's parameters, over its m microbatches for ZeRO 2-3), ``runtime.ranks_per_core``
    times longer where CPU ranks outnumber the cores (every rank runs them at once). With
    ``costs`` (the tp share the plan was solved on) and ``plan.zero_layer_units``, ZeRO
    1-3's collectives run per layer unit (:func:`layer_units`); without, per stage. ZeRO 2-3
    with layer units on a runtime whose collectives do not share the ranks' compute: what
    the prefetched gathers and the reduce-scatters leave exposed in each microbatch
    (:func:`_zero23_layers_exposed`). At ep > 1 (with ``costs``) the experts' gradients are
    left out of all that and averaged over their own replicas after the flush
    (:func:`without_experts`).
    """
    units = _stage_units(plan, costs, None) if costs is not None else None
    degrees = (plan.tp, plan.dp * plan.cp, plan.zero_stage, plan.overlap_grad_reduce)
    dense, costs, after = without_experts(plan, costs, degrees, layout, runtime)
    exposed = _dp_exposed(dense, degrees, layout, runtime, units,
                          plan.zero_layer_units and units is not None, costs)
    return tuple(e + a for e, a in zip(exposed, after, strict=True))


def _dp_exposed(plan: Plan, degrees: tuple[int, int, int, bool], layout: LayoutOptions,
                runtime: RuntimeDescription, units: tuple[int, ...] | None = None,
                per_layer: bool = False, costs: CostGraph | None = None
                ) -> tuple[float, ...]:
    """:func:`dp_exposed_us` of a replica's pipeline plan at ``(tp, dp, zero, overlap)``,
    ZeRO 1-3's collectives run by ``units[s]`` FSDP units in stage s (None: one per stage),
    per layer (``per_layer``) or not; ``costs``: the cost graph the plan was solved on
    (needed for ZeRO 2-3's layer units on a runtime whose collectives run beside compute;
    without it they are priced whole). ZeRO 2-3: per rank, ``m`` times its stages'
    :func:`_microbatch_extras`."""
    tp, dp, zero, overlap = degrees
    if dp == 1:
        return (0.0,) * len(plan.ranks)
    extras = _microbatch_extras(plan, degrees, layout, runtime, units, per_layer, costs)
    if extras is not None:
        per_rank = [0.0] * len(plan.ranks)
        for st, (fwd, bwd) in zip(plan.stages, extras, strict=True):
            per_rank[st.rank] += plan.num_microbatches * (fwd + bwd)
        return tuple(per_rank)
    if zero == 1 and per_layer and units and not runtime.collectives_share_compute:
        return _zero1_layers_exposed(plan, units, tp, dp, layout, runtime)
    if overlap and not runtime.collectives_share_compute:
        grad_bytes = [int(st.param_bytes * layout.gradient_factor) for st in plan.stages]
        return overlapped_reduction_us(
            grad_bytes, [st.num_parameters for st in plan.stages],
            [st.rank for st in plan.stages], [st.predicted_bwd_us for st in plan.stages],
            _bucket_us(dp, tp, layout, runtime),
            split_backward=splits_backward(plan.schedule_kind, False),
            bucket_elements=grad_bucket_elements(dp))
    shared = max(1.0, runtime.ranks_per_core)
    return tuple(shared * _dp_cost(sum(plan.stages[s].param_bytes for s in r.stage_indices),
                                   dp, zero, tp, layout, runtime,
                                   sum(units[s] for s in r.stage_indices) if units
                                   else len(r.stage_indices)).step_us(plan.num_microbatches)
                 for r in plan.ranks)


def dp_step_us(plan: Plan, degrees: tuple[int, int, int, bool], layout: LayoutOptions,
               runtime: RuntimeDescription, units: tuple[int, ...] | None = None,
               per_layer: bool = False, costs: CostGraph | None = None,
               ep: int | None = None) -> float:
    """What a replica's pipeline plan's dp collectives add to its step, µs.

    ZeRO 0-1: the largest rank's collectives after its schedule's last action
    (:func:`dp_exposed_us`). ZeRO 2-3, whose collectives run inside every microbatch's
    forward and backward: the schedule's step with each stage's ``F`` and ``B`` that much
    longer, less its step without (:func:`_replayed_us`), so the fill and drain of a
    pipeline whose every action waits count too, and a stage's collectives can fill its
    bubble. At ep > 1 (with ``costs``), the experts' reduction after the flush instead of
    their share of the above (:func:`without_experts`), on the rank that holds the most.

    Args:
        plan: a training plan of the layout search (its stages' times, ranks, schedule).
        degrees: ``(tp, dp x cp, ZeRO stage, overlapped ZeRO-0 reduction)``.
        layout: the GPU count and topology (the dp link).
        runtime: the runtime's collective costs (fixed cost, copy rate, ranks per core).
        units: per stage, the FSDP units its ZeRO 1-3 collectives run by (None: one each).
        per_layer: the units are layers (``Plan.zero_layer_units``).
        costs: the cost graph the plan was solved on (tp's share); needed to price ZeRO
            2-3's layer units on a runtime whose collectives run beside compute, which
            without it are priced whole.

    Returns:
        µs added to the step, >= 0 (0.0 at dp 1).
    """
    plan, costs, after = without_experts(plan, costs, degrees, layout, runtime, ep)
    extras = _microbatch_extras(plan, degrees, layout, runtime, units, per_layer, costs)
    if extras is None:
        exposed = _dp_exposed(plan, degrees, layout, runtime, units, per_layer, costs)
        return max((e + a for e, a in zip(exposed, after, strict=True)), default=0.0)
    return _replayed_us(plan, extras) + max(after, default=0.0)


def _microbatch_extras(plan: Plan, degrees: tuple[int, int, int, bool], layout: LayoutOptions,
                       runtime: RuntimeDescription, units: tuple[int, ...] | None,
                       per_layer: bool, costs: CostGraph | None
                       ) -> list[tuple[float, float]] | None:
    """Per stage of ``plan``, what ZeRO 2-3's collectives add to one of its forwards and one
    of its backwards, µs; None below ZeRO 2 (nothing runs per microbatch). With layer units
    on a runtime whose collectives run beside compute, what the prefetched gathers and the
    reduce-scatters leave exposed (:func:`_zero23_layers_exposed`); otherwise the whole of
    them (:func:`data_parallel_cost`'s all-gather in the forward, the rest in the backward,
    per ``units[s]`` FSDP units), ``runtime.ranks_per_core`` times longer where CPU ranks
    outnumber the cores."""
    tp, dp, zero, _ = degrees
    if zero not in (2, 3) or dp == 1:
        return None
    if layer_units_overlap(zero, per_layer, runtime) and costs is not None:
        return _zero23_layers_exposed(plan, costs, tp, dp, zero, layout, runtime)
    shared = max(1.0, runtime.ranks_per_core)
    out = []
    for s, st in enumerate(plan.stages):
        cost = _dp_cost(st.param_bytes, dp, zero, tp, layout, runtime, units[s] if units else 1)
        out.append((shared * cost.forward_us,
                    shared * (cost.per_microbatch_us - cost.forward_us)))
    return out


def _replayed_us(plan: Plan, extras: list[tuple[float, float]]) -> float:
    """How much longer ``plan``'s schedule runs with ``extras[s] = (forward, backward)`` µs
    added to every ``F`` and ``B`` of stage s, µs, by the schedule's closed form
    (:func:`autopart.solver._closed_form.closed_form_step_us`) on the plan's stage times
    with and without them (a split backward's ``I`` and ``W`` taken as halves, the extra on
    ``I``; the sends as the plan's per-stage figure, half each way). The closed form, not
    the simulator's replay: the layout search prices every layout's plan this way, and a
    replay of 10^5-10^6 actions per layout would not stay within its time."""
    split = splits_backward(plan.schedule_kind, False)
    fwd = [st.predicted_fwd_us for st in plan.stages]
    grad = [st.predicted_bwd_us / (2 if split and not st.recompute else 1) for st in plan.stages]
    weight = [st.predicted_bwd_us - g for st, g in zip(plan.stages, grad, strict=True)]
    send = [st.predicted_comm_us / 2 for st in plan.stages]
    zeros = [0] * len(plan.stages)

    def stage_costs(scale: float) -> StageCosts:
        return StageCosts([f + scale * e for f, (e, _) in zip(fwd, extras, strict=True)],
                          [g + scale * e for g, (_, e) in zip(grad, extras, strict=True)],
                          weight, send, send, zeros, zeros, zeros)

    def step(c: StageCosts) -> float:
        return closed_form_step_us(plan.schedule_kind, len(plan.ranks), plan.num_microbatches,
                                   plan.stages_per_rank, c)

    return max(0.0, step(stage_costs(1.0)) - step(stage_costs(0.0)))


def _zero1_layers_exposed(plan: Plan, units: tuple[int, ...], tp: int, dp: int,
                          layout: LayoutOptions, runtime: RuntimeDescription
                          ) -> tuple[float, ...]:
    """ZeRO-1 with layer units on a runtime whose collectives run beside compute, per rank:
    the reduce-scatters launched as each layer's gradients become final in its stage's last
    backward (the tail model of ZeRO-0's buckets, :func:`overlapped_reduction_us`, with a
    unit's reduce-scatter for a bucket: Megatron-LM's distributed optimizer with
    ``--overlap-grad-reduce``), after the all-gather of the step's first unit (stage 0's,
    the stage's parameters over its units), which the first forward waits for; every later
    unit's all-gather is prefetched under the forward before it (``--overlap-param-gather``;
    assumed hidden)."""
    bw, lat = layout.topology.link(tp * dp)
    link = (dp, bw, lat, runtime.collective_overhead_at(0.0), runtime.copy_bytes_per_s)
    grad_bytes = [int(st.param_bytes * layout.gradient_factor) for st in plan.stages]
    per_unit = max(-(-st.num_parameters // n) for st, n in zip(plan.stages, units, strict=True))
    tails = overlapped_reduction_us(
        grad_bytes, [st.num_parameters for st in plan.stages],
        [st.rank for st in plan.stages], [st.predicted_bwd_us for st in plan.stages],
        lambda nbytes: fsdp_collective_us(nbytes, *link), split_backward=False,
        bucket_elements=max(1, per_unit))
    first = fsdp_collective_us(plan.stages[0].param_bytes / units[0], *link)
    return tuple(first + t for t in tails)


def _stage_unit_work(plan: Plan, costs: CostGraph, gradient_factor: float
                     ) -> list[tuple[list[UnitSegment], list[int], list[int], int | None]]:
    """Per stage of ``plan``: its ops' runs by FSDP unit (:class:`UnitSegment`, times the
    stage's predicted forward and backward shared out by the ops' profiled times), each
    unit's parameter and gradient bytes, and the root unit's index (None: no parameter
    outside the stage's layers). A unit is a layer (:func:`layer_of_path` of an op's module
    path, of a parameter's name) or the root (the rest), as ``codegen.fsdp_units`` groups
    the stage's graph."""
    out = []
    for st, nodes in zip(plan.stages, _stage_nodes(plan, costs), strict=True):
        index: dict[str | None, int] = {}
        runs: list[list[float]] = []  # [unit, fwd, bwd] per run, profiled µs
        for nd in nodes:
            u = index.setdefault(layer_of_path(nd.module_path), len(index))
            if runs and runs[-1][0] == u:
                runs[-1][1] += nd.fwd_us
                runs[-1][2] += nd.bwd_input_us + nd.bwd_weight_us
            else:
                runs.append([u, nd.fwd_us, nd.bwd_input_us + nd.bwd_weight_us])
        held: dict[int, int] = {}
        for p in dict.fromkeys(p for nd in nodes for p in nd.params if p in costs.trainable):
            u = index.setdefault(layer_of_path(p), len(index))
            held[u] = held.get(u, 0) + costs.param_sizes[p]
        nbytes = [held.get(u, 0) for u in range(len(index))]
        fwd = sum(r[1] for r in runs) or 1.0
        bwd = sum(r[2] for r in runs) or 1.0
        segments = [UnitSegment(int(u), f / fwd * st.predicted_fwd_us,
                                b / bwd * st.predicted_bwd_us) for u, f, b in runs]
        root = index.get(None)
        out.append((segments, nbytes, [int(b * gradient_factor) for b in nbytes],
                    root if root is not None and nbytes[root] > 0 else None))
    return out


def _zero23_layers_exposed(plan: Plan, costs: CostGraph, tp: int, dp: int, zero: int,
                           layout: LayoutOptions, runtime: RuntimeDescription
                           ) -> list[tuple[float, float]]:
    """ZeRO 2-3 with layer units on a runtime whose collectives run beside compute, per
    stage: what one microbatch's forward and backward leave exposed
    (:func:`layer_units_exposed_us`: the gathers prefetched one unit ahead, the
    reduce-scatters launched at each unit's post-backward, the backward's end waiting for
    the last)."""
    bw, lat = layout.topology.link(tp * dp)
    link = (dp, bw, lat, runtime.collective_overhead_at(0.0), runtime.copy_bytes_per_s)
    return [layer_units_exposed_us(
                segments, [fsdp_collective_us(b, *link) if b else 0.0 for b in params],
                [fsdp_collective_us(b, *link) if b else 0.0 for b in grads],
                zero_stage=zero, root=root)
            for segments, params, grads, root in _stage_unit_work(plan, costs,
                                                                  layout.gradient_factor)]


def _baselines_dp_us(plan: Plan, degrees: tuple[int, int, int, bool], layout: LayoutOptions,
                     runtime: RuntimeDescription, costs: CostGraph | None = None,
                     ep: int = 1) -> float:
    """A lower bound on what any partition of ``plan``'s layout pays for its dp collectives,
    µs: those of an even parameter split over the pp ranks (any partition's fullest rank
    holds at least that); overlapped, one bucket of it, which the rank whose last backward
    ends the step cannot hide. With ``costs`` (the graph ``plan`` was solved on) and ep > 1,
    the experts' reduction of an even share of them too (:func:`without_experts`)."""
    tp, dp, zero, overlap = degrees
    plan, held = _split_experts(plan, costs, ep)
    experts = (_expert_reduce_us(sum(held) / len(plan.ranks), degrees, layout, runtime, ep)
               if any(held) else 0.0)
    total = sum(st.param_bytes for st in plan.stages)
    share = -(-total // len(plan.ranks))
    if overlap and not runtime.collectives_share_compute:
        return experts + _even_bucket_us(total * layout.gradient_factor,
                                          sum(st.num_parameters for st in plan.stages),
                                          len(plan.ranks), dp, tp, layout, runtime)
    return experts + (max(1.0, runtime.ranks_per_core)
                      * _dp_cost(share, dp, zero, tp, layout, runtime).step_us(plan.num_microbatches))
