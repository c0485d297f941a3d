"""solve_layout: choose tp, pp, dp and the ZeRO stage around the pipeline solver, best bound first."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from autopart.core.cluster import Cluster, DeviceSpec
from autopart.core.costgraph import CostGraph
from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.core.layout import (
    ZERO_STAGES,
    check_degrees,
    check_global_batch,
    divisors,
)
from autopart.core.plan import ParetoPoint, Plan, ShardedParameter
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.schedule import splits_backward
from autopart.core.topology import HostTopology
from autopart.solver.candidates import crossing_profile
from autopart.solver.context_parallel_costs import context_costs, split_tokens
from autopart.solver.data_parallel import (
    held_state_multiplier,
    layer_unit_factors,
    sharded_state_multiplier,
    state_multiplier,
)
from autopart.solver.expert_parallel_costs import (
    expert_costs,
    expert_module_paths,
    expert_params,
)
from autopart.solver.layout_dp import (
    _baselines_dp_us,
    _dp_cost,
    _dp_exposed,
    _even_bucket_us,
    _hides_reduction,
    _stage_units,
    dp_exposed_us,
    layer_units,
)
from autopart.solver.layout_options import LayoutCandidate, LayoutOptions
from autopart.solver.options import SolveOptions
from autopart.solver.predict import plan_at
from autopart.solver.solve import auto_recompute, solve
from autopart.solver.tensor_parallel import find_tensor_parallel
from autopart.solver.tensor_parallel_costs import shard_costs

__all__ = ["LayoutOptions", "LayoutCandidate", "layout_candidates", "evaluate_layout",
           "solve_layout", "dp_exposed_us", "layer_units"]


def _tp_choices(layout: LayoutOptions) -> list[int]:
    if layout.tp is not None:
        return [layout.tp]
    out = []
    for tp in divisors(layout.topology.gpus_per_host):
        if layout.num_gpus % tp == 0 and (layout.num_heads is None or layout.num_heads % tp == 0):
            out.append(tp)
    return out


def _bounds(sharded: CostGraph, tp: int, pp: int, dp: int, zero: int, counts: tuple[int, ...],
            options: SolveOptions, layout: LayoutOptions, device: DeviceSpec,
            smallest_crossing: int, ep: int = 1, cp: int = 1) -> LayoutCandidate:
    """Bounds of one layout. With ``m`` microbatches a step is no shorter than the work
    spread over pp ranks, ``(m O + L + m C) / pp``, nor than one microbatch's forward and
    backward through every stage in turn, ``O + L / m`` (O: the per-op fixed times of one
    microbatch, L: the batch-proportional times of the replica's whole batch, C: the
    forward and backward sends over pp - 1 cuts of the smallest crossing, each charged to a
    stage's time as the pipeline cost model does), plus the dp collectives of an even share
    of the parameters (none where ZeRO-0's reduction, or ZeRO-1's with layer units, is
    overlapped and hides under compute; the estimate then charges one bucket of it); the
    bound is the smallest over the allowed m. With cp > 1 (``sharded`` is then one cp
    rank's) the dp collectives and ZeRO's shards span the dp line's dp x cp GPUs."""
    overhead_us = device.op_overhead_us
    line = dp * cp
    rows = options.batch_size / dp / sharded.batch_size
    fixed = linear = 0.0
    for nd in sharded.nodes:
        for t in (nd.fwd_us, nd.bwd_input_us if options.training else 0.0,
                  nd.bwd_weight_us if options.training else 0.0):
            if t > 0:
                linear += max(t - overhead_us, 0.0) * rows
                fixed += min(t, overhead_us)
    trainable = sum(b for p, b in sharded.param_sizes.items() if p in sharded.trainable)
    share = -(-trainable // pp)
    dp_cost = (_dp_cost(share, line, zero, tp, layout, options.runtime)
               if options.training else None)
    _, hidden = _hides_reduction(layout, zero, line, options)
    # ZeRO-1's layer units overlap their reduce-scatters and gathers likewise
    hidden = hidden or (zero == 1 and line > 1 and options.training and layout.zero_layer_units
                        and not options.runtime.collectives_share_compute)
    if hidden:  # overlapped: none of it is surely exposed; one bucket estimated
        tail = _even_bucket_us(trainable * layout.gradient_factor,
                               sum(n for p, n in sharded.param_numel.items()
                                   if p in sharded.trainable), pp, line, tp, layout,
                               options.runtime)
    link = _pipeline_cluster(device, tp, 2, line, layout.topology)
    smallest = smallest_crossing if pp > 1 else 0
    sends = 2 if options.training else 1

    def send_us(m: int) -> float:
        nbytes = math.ceil(smallest * options.batch_size / dp / m / sharded.batch_size - 1e-9)
        return sends * (pp - 1) * link.transfer_us(nbytes, 0, 1) if nbytes > 0 else 0.0

    lb = est = math.inf
    for m in counts:
        dp_us = dp_cost.step_us(m) if dp_cost else 0.0
        work = (m * fixed + linear + m * send_us(m)) / pp
        lb = min(lb, max(work, fixed + linear / m) + (0.0 if hidden else dp_us))
        est = min(est, work * (m + pp - 1) / m + (tail if hidden else dp_us))
    mult = (state_multiplier(zero, line, options.optimizer_state_bytes_per_param_byte,
                             layout.gradient_factor) if options.training else 1.0)
    frozen = sum(b for p, b in sharded.param_sizes.items() if p not in sharded.trainable)
    state = int(trainable * mult + frozen) // pp
    return LayoutCandidate(tp, pp, dp, zero, lb, state, est, ep, cp)


def _smallest_crossing(costs: CostGraph) -> int:
    """The fewest bytes any cut position 1 .. n - 1 of ``costs`` sends, at its profiled batch."""
    crossing, valid = crossing_profile(costs)
    inner = [c for q, c in enumerate(crossing) if 0 < q < len(crossing) - 1 and valid[q]]
    return min(inner) if inner else 0


def layout_candidates(costs: CostGraph, device: DeviceSpec, options: SolveOptions,
                      layout: LayoutOptions, cache: dict[tuple[int, ...], CostGraph] | None = None
                      ) -> list[LayoutCandidate]:
    """Every layout the request allows, with bounds, most promising first (speed: by
    ``estimate_us``; memory: by state bound, then estimate), ties broken by (tp, pp, dp, zero).

    Raises:
        PlanError: the fixed degrees admit no layout (tp x pp x dp is not the GPU count, the
            batch does not split over dp, a fixed m does not split a replica's batch); the
            message names the values and the nearest valid ones.
    """
    batch = options.batch_size
    if layout.dp is not None:
        check_global_batch(batch, layout.dp, options.num_microbatches)
    out: list[LayoutCandidate] = []
    shape_seen = False
    experts = bool(expert_module_paths(costs))
    for cp in _cp_choices(layout):
        n = layout.num_gpus // cp  # tp x pp x dp of one cp rank's share
        if layout.tp is not None and n % layout.tp:
            check_degrees(layout.tp, layout.pp or 1, layout.dp or 1, n)
        for tp in [1] if (layout.ep or 1) > 1 else _tp_choices(layout):
            sharded = _sharded(costs, tp, device, layout, options.runtime, cache, 1, cp)
            smallest = _smallest_crossing(sharded)
            for pp in divisors(n // tp) if n % tp == 0 else []:
                dp = n // (tp * pp)
                if layout.pp not in (None, pp) or layout.dp not in (None, dp):
                    continue
                shape_seen = True
                if batch % dp:
                    continue
                try:
                    counts = _replica_options(options, layout, dp).microbatch_counts()
                except PlanError:
                    continue
                for ep in _ep_choices(layout, tp, dp, experts) if cp == 1 else [1]:
                    at_ep = (sharded if ep == 1 else
                             _sharded(costs, tp, device, layout, options.runtime, cache, ep))
                    zeros = ([layout.zero_stage] if layout.zero_stage is not None
                             else list(ZERO_STAGES) if dp * cp > 1 and options.training
                             else [0])
                    for zero in zeros:
                        out.append(_bounds(at_ep, tp, pp, dp, zero, counts, options, layout,
                                           device, smallest, ep, cp))
    n = layout.num_gpus // (layout.cp or 1)
    if not shape_seen:
        check_degrees(layout.tp or 1, layout.pp or 1, layout.dp or 1, n)
    if not out:
        dps = sorted({n // (tp * pp) for tp in _tp_choices(layout) for pp in divisors(n // tp)
                      if n % tp == 0})
        raise PlanError(f"global batch {batch} (m={options.num_microbatches}) splits over none "
                        f"of the data-parallel degrees the request allows ({dps}); choose a "
                        "batch that a dp among them divides, or fix dp")
    if options.optimize == "memory":
        out.sort(key=lambda c: (c.state_lb_bytes, c.estimate_us, c.tp, c.pp, c.dp, c.zero_stage,
                                c.ep, c.cp))
    else:
        out.sort(key=lambda c: (c.estimate_us, c.tp, c.pp, c.dp, c.zero_stage, c.ep, c.cp))
    return out


def _state_options(options: SolveOptions, layout: LayoutOptions, dp: int, zero: int,
                   units: bool, cp: int = 1) -> SolveOptions:
    """A replica's options (:func:`_replica_options`) with the parameter state a GPU holds
    at its step's peak under ZeRO as the runtime runs it: one FSDP unit per stage
    (:func:`held_state_multiplier`), or with ``units`` (ZeRO 1-3, ``Plan.zero_layer_units``)
    the shards and the layers gathered one at a time (:func:`sharded_state_multiplier`,
    :func:`layer_unit_factors`). ZeRO shards over the dp line's dp x ``cp`` GPUs."""
    out = _replica_options(options, layout, dp)
    dp *= cp
    if not options.training:
        return replace(out, state_bytes_per_param_byte=None)
    k, g = options.optimizer_state_bytes_per_param_byte, layout.gradient_factor
    if units:
        return replace(out, state_bytes_per_param_byte=sharded_state_multiplier(dp, k, g),
                       layer_unit_factors=layer_unit_factors(zero, g))
    return replace(out, state_bytes_per_param_byte=held_state_multiplier(zero, dp, k, g))


def _replica_options(options: SolveOptions, layout: LayoutOptions, dp: int) -> SolveOptions:
    """``options`` for one replica: its batch, and the microbatch counts of
    ``layout.microbatch_sizes`` (PlanError when none divides the replica's batch)."""
    per = options.batch_size // dp
    out = replace(options, batch_size=per, hint=None)
    if layout.microbatch_sizes is not None and options.num_microbatches is None:
        counts = tuple(sorted({per // s for s in layout.microbatch_sizes if per % s == 0}))
        if not counts:
            raise PlanError(f"no microbatch size in {layout.microbatch_sizes} divides the "
                            f"replica batch {per}")
        out = replace(out, microbatch_candidates=counts)
    return out


def _sharded(costs: CostGraph, tp: int, device: DeviceSpec, layout: LayoutOptions,
             runtime: RuntimeDescription,
             cache: dict[tuple[int, ...], CostGraph] | None = None,
             ep: int | None = None, cp: int = 1) -> CostGraph:
    """One GPU's share at tp (memoised in ``cache``, one entry per (tp, ep, cp), for one
    request), its collectives paying ``runtime``'s fixed cost per collective, with sequence
    parallelism where ``layout`` asks for it, its experts split over ``ep`` (default:
    ``layout.ep``, 1 when searched; :func:`autopart.solver.expert_parallel_costs.
    expert_costs`) and its sequences over ``cp`` (:func:`autopart.solver.
    context_parallel_costs.context_costs`, on the link of a cp group: cp GPUs ``tp``
    apart)."""
    ep = (layout.ep or 1) if ep is None else ep
    if cache is not None and (tp, ep, cp) in cache:
        return cache[(tp, ep, cp)]
    if cp > 1:
        base = costs if layout.cp_tokens_profiled else split_tokens(costs, cp)
        cp_bw, cp_lat = layout.topology.link(tp * cp)
        local = context_costs(base, cp, causal=layout.causal_attention,
                              bandwidth_bytes_per_s=cp_bw, latency_us=cp_lat,
                              collective_overhead=runtime.collective_overhead_at,
                              reduce_scatter_as_all_reduce=runtime.reduce_scatter_as_all_reduce)
        out = _sharded(local, tp, device, layout, runtime, None, ep)
    elif ep > 1:  # tp is 1: the ep group is ep adjacent GPUs of one dp line
        base = _sharded(costs, tp, device, layout, runtime, cache, 1)
        ep_bw, ep_lat = layout.topology.link(ep)
        out = expert_costs(base, ep, bandwidth_bytes_per_s=ep_bw, latency_us=ep_lat,
                           collective_overhead=runtime.collective_overhead_at)
    else:
        bw, lat = layout.topology.link(tp)
        out = shard_costs(costs, tp, bandwidth_bytes_per_s=bw, latency_us=lat,
                          op_overhead_us=device.op_overhead_us,
                          collective_overhead=runtime.collective_overhead_at,
                          copy_bytes_per_s=runtime.copy_bytes_per_s,
                          sequence_parallel=layout.sequence_parallel,
                          reduce_scatter_as_all_reduce=runtime.reduce_scatter_as_all_reduce)
    if cache is not None:
        cache[(tp, ep, cp)] = out
    return out


def _cp_choices(layout: LayoutOptions) -> list[int]:
    """The cp degrees the search tries: the fixed one, else 1 and every divisor of the GPU
    count that divides ``layout.max_cp`` (none beyond 1 when it is unknown)."""
    if layout.cp is not None:
        if layout.num_gpus % layout.cp:
            raise PlanError(f"cp={layout.cp} does not divide the {layout.num_gpus} GPUs; choose "
                            "a divisor")
        return [layout.cp]
    if (layout.ep or 1) > 1 or not layout.max_cp:
        return [1]
    return [c for c in divisors(layout.num_gpus) if layout.max_cp % c == 0]


def _ep_choices(layout: LayoutOptions, tp: int, dp: int, experts: bool) -> list[int]:
    """The ep degrees a (tp, dp) layout is tried with: the fixed one where it fits, else 1
    and, for a model with experts at tp 1, every divisor of dp that divides
    ``layout.num_experts``."""
    if layout.ep is not None:
        return [layout.ep] if dp % layout.ep == 0 else []
    out = [1]
    if experts and tp == 1 and layout.num_experts:
        out += [e for e in divisors(dp) if e > 1 and layout.num_experts % e == 0]
    return out


def _pipeline_cluster(device: DeviceSpec, tp: int, pp: int, dp: int,
                      topo: HostTopology) -> Cluster:
    """pp ranks; neighbours sit ``tp x dp`` GPUs apart: inside a host or across. Across hosts
    each of the tp GPUs sends its 1/tp slice over its own adapter (Megatron's scatter/gather
    of activations between stages, SC'21 section 4.1): tp times one adapter's bandwidth."""
    if tp * dp < topo.gpus_per_host:
        bw, lat = topo.intra_host_bandwidth_bytes_per_s, topo.intra_host_latency_us
    else:
        bw, lat = topo.inter_host_bandwidth_bytes_per_s * tp, topo.inter_host_latency_us
    spec = replace(device, link_bandwidth_bytes_per_s=bw, link_latency_us=lat)
    return Cluster.uniform(spec, [f"cuda:{r}" for r in range(pp)])


def evaluate_layout(costs: CostGraph, device: DeviceSpec, options: SolveOptions,
                    layout: LayoutOptions, cand: LayoutCandidate,
                    cache: dict[tuple[int, ...], CostGraph] | None = None,
                    positions: tuple[int, ...] | None = None) -> Plan:
    """The pipeline solver's best plan for one layout, with tp, dp and ZeRO costs added.

    The pipeline solver sees one GPU's share of the model (:func:`shard_costs` at tp), the
    replica's batch (``batch_size / dp``), pp ranks linked as placed, and the parameter state
    a GPU holds at its step's peak under ZeRO as the runtime runs it
    (:func:`held_state_multiplier`), so each rank's peak is state + activations + working
    sets. The dp collectives are then added to the step. ZeRO-0 with
    ``layout.overlap_grad_reduce`` (the default) on a runtime whose collectives do not share
    the ranks' compute: what the buckets launched during each stage's last backward leave
    after the schedule's end (:func:`autopart.solver.data_parallel.overlapped_reduction_us`),
    the baselines one bucket of an even share (a lower bound on theirs); the plan then says
    ``overlap_grad_reduce``. Otherwise (ZeRO 1-3, the SC'21 pricing, or CPU ranks, where the
    overlapped reduction costs its whole time, measured): those of the rank with the most
    parameters, after the flush (with more CPU ranks than cores, ``runtime.ranks_per_core``
    times longer: every rank runs them at once), the baselines those of an even parameter
    split over the pp ranks (a lower bound on theirs). The time-memory frontier's points get
    the plan's.

    Args:
        costs, device, options, layout: as for :func:`solve_layout`.
        cand: the layout (its tp, pp, dp, ZeRO stage).
        cache: :func:`_sharded`'s memo, or None.
        positions: cut positions (node indices, ``pp x v - 1``) to cost as given instead of
            searching (:func:`autopart.solver.predict.plan_at`: a hand plan's prediction);
            ``options`` then fixes ``schedule_kind`` and ``num_microbatches`` (per replica).

    Raises:
        InfeasiblePlanError: nothing fits this layout.
        PlanError: ``positions`` without a fixed schedule kind and m, or not fitting the ranks.
    """
    tp, pp, dp, zero, cp = cand.tp, cand.pp, cand.dp, cand.zero_stage, cand.cp
    line = dp * cp  # the GPUs that reduce gradients together and share ZeRO's shards
    sharded = _sharded(costs, tp, device, layout, options.runtime, cache, cand.ep, cp)
    # ZeRO-1's layer units hold what one unit per stage holds and gain only by overlapping
    # their collectives with compute, which CPU ranks' collectives do not (measured,
    # benchmarks/overlap_cpu): a search there keeps one unit per stage (a given plan is
    # priced as it runs)
    units = (layout.zero_layer_units and zero >= 1 and line > 1 and options.training
             and not (zero == 1 and options.runtime.collectives_share_compute
                      and positions is None)
             and not (options.schedule_kind is not None
                      and splits_backward(options.schedule_kind, False)))
    # an ep rank's experts are left whole by ZeRO (fully_shard's ignored_params)
    whole = expert_params(sharded) if cand.ep > 1 else frozenset()
    inner = replace(_state_options(options, layout, dp, zero, units, cp),
                    whole_state_params=whole)
    cluster = _pipeline_cluster(device, tp, pp, line, layout.topology)
    if positions is None:
        plan = solve(sharded, cluster, inner)
        if units and splits_backward(plan.schedule_kind, False):
            # a split backward runs one unit per stage (the runtime gathers the stage from
            # its I to its last W): price that instead
            units = False
            plan = solve(sharded, cluster, replace(_state_options(options, layout, dp, zero,
                                                                  False, cp),
                                                   whole_state_params=whole))
    elif options.schedule_kind is None or options.num_microbatches is None:
        raise PlanError("evaluate_layout(positions=...) costs a fixed plan: set the options' "
                        f"schedule_kind ({options.schedule_kind!r}) and num_microbatches "
                        f"({options.num_microbatches!r}) too")
    else:
        plan = plan_at(sharded, cluster, inner, positions, kind=options.schedule_kind,
                       num_microbatches=options.num_microbatches,
                       stages_per_rank=options.stages_per_rank or 1,
                       recompute=bool(options.recompute))
    extra = even = 0.0
    overlap, _ = _hides_reduction(layout, zero, line, options)
    if options.training and line > 1:
        degrees = (tp, line, zero, overlap)
        extra = max(_dp_exposed(plan, degrees, layout, options.runtime,
                                _stage_units(plan, sharded, units), units))
        even = _baselines_dp_us(plan, degrees, layout, options.runtime)
    split = find_tensor_parallel(costs) if tp > 1 else None
    sharded_params = tuple(ShardedParameter(name, style)
                           for name, style in sorted(split.params.items())) if split else ()
    forward = (sum(nd.flops for nd in costs.nodes) * options.batch_size / costs.batch_size
               * (cp if layout.cp_tokens_profiled else 1))
    step = plan.predicted_step_time_us + extra
    baselines = tuple(replace(b, predicted_step_time_us=round(b.predicted_step_time_us + even, 3))
                      for b in plan.baselines)
    own = ParetoPoint(round(step, 3), max(r.peak_memory_bytes for r in plan.ranks))
    pareto = tuple(sorted({own, *(ParetoPoint(round(p.predicted_step_time_us + extra, 3),
                                              p.peak_memory_bytes)
                                   for p in plan.pareto)},
                          key=lambda p: (p.predicted_step_time_us, p.peak_memory_bytes)))
    pareto = tuple(p for p in pareto if not any(
        q != p and q.predicted_step_time_us <= p.predicted_step_time_us
        and q.peak_memory_bytes <= p.peak_memory_bytes for q in pareto))
    return replace(
        plan, batch_size=options.batch_size, tp=tp, dp=dp, zero_stage=zero,
        baselines=baselines, pareto=pareto, sharded_parameters=sharded_params,
        overlap_grad_reduce=overlap, zero_layer_units=units,
        sequence_parallel=layout.sequence_parallel and tp > 1, ep=cand.ep, cp=cp,
        predicted_step_time_us=round(step, 3),
        bubble_fraction=round(plan.bubble_fraction * plan.predicted_step_time_us / step, 6)
        if step > 0 else plan.bubble_fraction,
        cluster_fingerprint=f"{layout.num_gpus}x{device.name}/{layout.topology.name}",
        model_flops=int(round((3 if options.training else 1) * forward)))


def _screen_options(options: SolveOptions) -> SolveOptions:
    """The cheap pipeline search a layout is screened with: the exact DP seeds only, one
    simulator replay, no baselines, and one schedule kind (1F1B, v = 1) unless the request
    fixes them."""
    if options.schedule_kind is None and options.training and options.num_stages is None:
        return replace(options, max_cpsat_solves=0, max_simulated=1, schedule_kind="1f1b",
                       stages_per_rank=1, baselines=False, explain_infeasible=False)
    return replace(options, max_cpsat_solves=0, max_simulated=1, baselines=False,
                   explain_infeasible=False)


def _key(plan: Plan, optimize: str) -> tuple[float, ...]:
    """Sort key: speed = (step, peak, tp, pp, dp, zero); memory = (peak, step, ...)."""
    peak = max(r.peak_memory_bytes for r in plan.ranks)
    degrees = (plan.tp, len(plan.ranks), plan.dp, plan.zero_stage, plan.cp)
    if optimize == "memory":
        return (peak, plan.predicted_step_time_us, *degrees)
    return (plan.predicted_step_time_us, peak, *degrees)


def _better(a: Plan, b: Plan | None, optimize: str) -> bool:
    return b is None or _key(a, optimize) < _key(b, optimize)


def solve_layout(costs: CostGraph, device: DeviceSpec, options: SolveOptions,
                 layout: LayoutOptions) -> Plan:
    """Choose tp, pp, dp and the ZeRO stage, and the pipeline plan inside them.

    Layouts (:func:`layout_candidates`) are visited most promising first (by their
    estimate); one whose bound cannot beat the best plan found is skipped (speed: its
    step-time bound is no smaller than the best step time; memory: its state bound is no
    smaller than the best peak), the others get a screening pipeline solve
    (:func:`evaluate_layout` with :func:`_screen_options`: exact DP seeds, one replay, 1F1B
    unless the request fixes the schedule) until ``layout.max_layouts`` were screened. The
    ``layout.refine`` best screened layouts are then solved with ``options`` as given but
    for CP-SAT's deterministic time (``layout.cpsat_budget`` per layout), and the best of
    every plan seen is returned. Deterministic:
    equal inputs give equal plans but for ``solver.wall_s``. The plan's ``solver.objective`` is
    its step time and ``solver.bound`` the smallest step-time bound of any layout whose
    parameter state fits (no plan of any layout is faster), ``solver.gap`` their relative
    distance; ``solver.name`` starts with ``"layout-search+"``.

    Args:
        costs: the whole model's costs (one replica, unsharded), at ``costs.batch_size`` rows.
        device: every GPU.
        options: the pipeline options; ``batch_size`` is the global batch over all replicas,
            ``memory_cap_bytes`` (or ``device.memory_bytes``) the cap per GPU.
        layout: the GPU count, topology and any fixed degrees.

    Returns:
        The best plan, its tp, dp, zero_stage, sharded_parameters and model_flops set; times
        and memory per GPU.

    Raises:
        PlanError: the fixed degrees are inconsistent (see :func:`layout_candidates`).
        InfeasiblePlanError: no layout fits the memory cap; the message names the smallest
            parameter state per GPU any layout needs and the cap.

    ``options.recompute_policy="auto"`` is decided for the whole search, not per layout (a
    screening ranked by one policy would leave the other's best layout unrefined): the
    search runs with ``"full"``, and where its plan recomputes a stage once more with
    ``"selective"``; the better plan by the objective is returned
    (:func:`autopart.solver.solve.auto_recompute`).
    """
    if options.recompute_policy == "auto":
        return auto_recompute(lambda policy: solve_layout(
            costs, device, replace(options, recompute_policy=policy), layout), options.optimize)
    t0 = time.perf_counter()
    cache: dict[tuple[int, ...], CostGraph] = {}
    cands = layout_candidates(costs, device, options, layout, cache)
    cap = options.memory_cap_bytes or device.memory_bytes
    screen = _screen_options(options)
    screened: list[tuple[Plan, LayoutCandidate]] = []
    unscreened: list[LayoutCandidate] = []
    failures: list[str] = []
    best: Plan | None = None
    for cand in cands:
        if cand.state_lb_bytes > cap:
            failures.append(f"tp {cand.tp} x pp {cand.pp} x dp {cand.dp} ZeRO-{cand.zero_stage}"
                            f"{f' ep {cand.ep}' if cand.ep > 1 else ''}"
                            f"{f' cp {cand.cp}' if cand.cp > 1 else ''}"
                            f": >= {cand.state_lb_bytes} bytes of state per GPU")
            continue
        if best is not None:
            if options.optimize == "memory":
                pruned = cand.state_lb_bytes >= max(r.peak_memory_bytes for r in best.ranks)
            else:
                pruned = cand.step_lb_us >= best.predicted_step_time_us
            if pruned:
                continue
            if len(screened) >= layout.max_layouts:
                unscreened.append(cand)
                continue
        try:
            plan = evaluate_layout(costs, device, screen, layout, cand, cache)
        except InfeasiblePlanError as exc:
            failures.append(f"tp {cand.tp} x pp {cand.pp} x dp {cand.dp} "
                            f"ZeRO-{cand.zero_stage}: {str(exc)[:160]}")
            continue
        screened.append((plan, cand))
        if _better(plan, best, options.optimize):
            best = plan
    ranked = sorted(screened, key=lambda pc: _key(pc[0], options.optimize))
    # this search says what fits; each refined layout's CP-SAT work within its budget
    per_solve = layout.cpsat_budget / max(1, options.max_cpsat_solves)
    full = replace(options, explain_infeasible=False,
                   deterministic_time=min(options.deterministic_time, per_solve))
    for _, cand in ranked[:layout.refine]:
        try:
            plan = evaluate_layout(costs, device, full, layout, cand, cache)
        except InfeasiblePlanError:
            continue
        if _better(plan, best, options.optimize):
            best = plan
    if best is None:
        smallest = min(c.state_lb_bytes for c in cands)
        raise InfeasiblePlanError(
            f"no (tp, pp, dp, ZeRO) layout of {layout.num_gpus} GPUs fits {cap} bytes per GPU: "
            f"the smallest parameter state any needs is {smallest} bytes; "
            f"{'; '.join(failures[:3])}. Use more GPUs, a higher ZeRO stage, or recompute")
    wall = time.perf_counter() - t0
    bound = min([c.step_lb_us for c in cands if c.state_lb_bytes <= cap]
                + [best.predicted_step_time_us])
    objective = best.predicted_step_time_us
    report = replace(best.solver, name=f"layout-search+{best.solver.name}",
                     objective=round(objective, 3), bound=round(bound, 3),
                     gap=round((objective - bound) / objective, 6) if objective > 0 else 0.0,
                     wall_s=round(wall, 3))
    return replace(best, solver=report)
