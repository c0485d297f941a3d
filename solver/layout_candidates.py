"""The layouts a (tp, pp, dp, cp, ZeRO) search visits, each with its bounds, and one GPU's
share of the costs at a layout's degrees: what :mod:`autopart.solver.layout_search` screens
and solves."""

from __future__ import annotations

import math
from dataclasses import replace

from autopart.core.cluster import Cluster, DeviceSpec
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.layout import (
    ZERO_STAGES,
    check_degrees,
    check_global_batch,
    divisors,
)
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.topology import HostTopology
from autopart.solver.candidates import _per_graph, crossing_profile
from autopart.solver.context_parallel_costs import context_costs, split_tokens
from autopart.solver.data_parallel import (
    held_state_multiplier,
    layer_unit_factors,
    sharded_state_multiplier,
    state_multiplier,
)
from autopart.solver.expert_parallel_costs import expert_costs, expert_module_paths, expert_params
from autopart.solver.layout_dp import _dp_cost, _even_bucket_us, _hides_reduction
from autopart.solver.layout_options import LayoutCandidate, LayoutOptions
from autopart.solver.options import SolveOptions
from autopart.solver.tensor_parallel_costs import shard_costs

__all__ = ["layout_candidates", "pipeline_cluster", "replica_options", "sharded_costs",
           "state_options"]


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
            smallest_crossing: int, ep: int = 1, cp: int = 1,
            cp_attention: str = "all_gather") -> LayoutCandidate:
    """Bounds of one layout. With ``m`` microbatches a step is no shorter than the work
    spread over pp ranks, ``(m O + L + m C) / pp``, nor than one microbatch's forward and
    backward through every stage in turn, ``O + L / m`` (O: the per-op fixed times of one
    microbatch, L: the batch-proportional times of the replica's whole batch, C: the
    forward and backward sends over pp - 1 cuts of the smallest crossing, each charged to a
    stage's time as the pipeline cost model does), plus the dp collectives of an even share
    of the parameters (none where ZeRO-0's reduction, or ZeRO 1-3's with layer units, is
    overlapped and hides under compute; the estimate then charges one bucket of it); the
    bound is the smallest over the allowed m. At ep > 1 the experts' share is left out of
    those collectives and all-reduced over its ``dp / ep`` replicas after the flush instead
    (:func:`autopart.solver.layout_dp.without_experts`). With cp > 1 (``sharded`` is then one cp
    rank's) the dp collectives and ZeRO's shards span the dp line's dp x cp GPUs."""
    overhead_us = device.op_overhead_us
    line = dp * cp
    rows = options.batch_size / dp / sharded.batch_size
    fixed, linear = _work_us(sharded, overhead_us, options.training)
    linear *= rows
    trainable = sum(b for p, b in sharded.param_sizes.items() if p in sharded.trainable)
    # an ep rank's experts are reduced over their dp / ep replicas after the flush, apart
    # from the dense rest (solver.layout_dp.without_experts)
    experts = expert_params(sharded) & sharded.trainable if ep > 1 else frozenset()
    expert_bytes = sum(sharded.param_sizes[p] for p in experts)
    share = -(-(trainable - expert_bytes) // pp)
    dp_cost = (_dp_cost(share, line, zero, tp, layout, options.runtime)
               if options.training else None)
    expert_cost = (_dp_cost(-(-expert_bytes // pp), line // ep, 0, tp, layout, options.runtime,
                            link_gpus=tp * line)
                   if options.training and expert_bytes else None)
    _, hidden = _hides_reduction(layout, zero, line, options)
    # ZeRO 1-3's layer units overlap their reduce-scatters and gathers likewise (ZeRO 2-3's
    # per microbatch, under each layer's compute: solver.layout_dp._zero23_layers_exposed)
    hidden = hidden or (zero >= 1 and line > 1 and options.training and layout.zero_layer_units
                        and not options.runtime.collectives_share_compute)
    if hidden:  # overlapped: none of it is surely exposed; one bucket estimated
        tail = _even_bucket_us(trainable * layout.gradient_factor,
                               sum(n for p, n in sharded.param_numel.items()
                                   if p in sharded.trainable), pp, line, tp, layout,
                               options.runtime)
    link = pipeline_cluster(device, tp, 2, line, layout.topology)
    smallest = smallest_crossing if pp > 1 else 0
    sends = 2 if options.training else 1

    def send_us(m: int) -> float:
        nbytes = math.ceil(smallest * options.batch_size / dp / m / sharded.batch_size - 1e-9)
        return sends * (pp - 1) * link.transfer_us(nbytes, 0, 1) if nbytes > 0 else 0.0

    lb = est = math.inf
    for m in counts:
        dp_us = dp_cost.step_us(m) if dp_cost else 0.0
        after = expert_cost.step_us(m) if expert_cost else 0.0
        work = (m * fixed + linear + m * send_us(m)) / pp
        lb = min(lb, max(work, fixed + linear / m) + (0.0 if hidden else dp_us) + after)
        est = min(est, work * (m + pp - 1) / m + (tail if hidden else dp_us) + after)
    mult = (state_multiplier(zero, line, options.optimizer_state_bytes_per_param_byte,
                             layout.gradient_factor) if options.training else 1.0)
    frozen = sum(b for p, b in sharded.param_sizes.items() if p not in sharded.trainable)
    state = int(trainable * mult + frozen) // pp
    return LayoutCandidate(tp, pp, dp, zero, lb, state, est, ep, cp, cp_attention)


def _work_us(costs: CostGraph, overhead_us: float, training: bool) -> tuple[float, float]:
    """The per-op fixed times of one microbatch of ``costs`` and the batch-proportional rest
    at its profiled batch, µs (:func:`_bounds`), summed once per graph, fixed time per op and
    training flag (:func:`autopart.solver.candidates._per_graph`)."""
    made = _per_graph("bound sums", costs, lambda _: {})
    key = (overhead_us, training)
    if key not in made:
        fixed = linear = 0.0
        for nd in costs.nodes:
            for t in (nd.fwd_us, nd.bwd_input_us if training else 0.0,
                      nd.bwd_weight_us if training else 0.0):
                if t > 0:
                    linear += max(t - overhead_us, 0.0)
                    fixed += min(t, overhead_us)
        made[key] = (fixed, linear)
    return made[key]  # type: ignore[no-any-return]


def _smallest_crossing(costs: CostGraph) -> int:
    """The fewest bytes any cut position 1 .. n - 1 of ``costs`` sends, at its profiled batch."""
    crossing, valid = crossing_profile(costs)
    inner = [c for q, c in enumerate(crossing) if 0 < q < len(crossing) - 1 and valid[q]]
    return min(inner) if inner else 0


def layout_candidates(costs: CostGraph, device: DeviceSpec, options: SolveOptions,
                      layout: LayoutOptions, cache: dict[tuple[int | str, ...], CostGraph] | None = None
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
        for tp, attention in [(t, a) for t in ([1] if (layout.ep or 1) > 1
                                               else _tp_choices(layout))
                              for a in _cp_attention_choices(layout, t, cp)]:
            sharded = sharded_costs(costs, tp, device, layout, options.runtime, cache, 1, cp,
                                    attention)
            smallest = _smallest_crossing(sharded)
            for pp in divisors(n // tp) if n % tp == 0 else []:
                dp = n // (tp * pp)
                if layout.pp not in (None, pp) or layout.dp not in (None, dp):
                    continue
                shape_seen = True
                if batch % dp:
                    continue
                try:
                    counts = replica_options(options, layout, dp).microbatch_counts()
                except PlanError:
                    continue
                for ep in _ep_choices(layout, tp, dp, experts) if cp == 1 else [1]:
                    at_ep = (sharded if ep == 1 else
                             sharded_costs(costs, tp, device, layout, options.runtime, cache, ep))
                    zeros = ([layout.zero_stage] if layout.zero_stage is not None
                             else list(ZERO_STAGES) if dp * cp > 1 and options.training
                             else [0])
                    for zero in zeros:
                        out.append(_bounds(at_ep, tp, pp, dp, zero, counts, options, layout,
                                           device, smallest, ep, cp, attention))
    heads = layout.attention_heads or layout.num_heads
    if not out and layout.cp_attention == "ulysses" and heads is not None and not any(
            heads % (tp * cp) == 0 for cp in _cp_choices(layout) for tp in _tp_choices(layout)):
        raise PlanError(f"cp_attention='ulysses' splits the {heads} attention heads over tp x "
                        "cp GPUs, which no allowed tp and cp divide; choose cp_attention="
                        "'all_gather' or degrees whose product divides the heads")
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
                                c.ep, c.cp, c.cp_attention))
    else:
        out.sort(key=lambda c: (c.estimate_us, c.tp, c.pp, c.dp, c.zero_stage, c.ep, c.cp,
                                c.cp_attention))
    return out


def state_options(options: SolveOptions, layout: LayoutOptions, dp: int, zero: int,
                   units: bool, cp: int = 1) -> SolveOptions:
    """A replica's options (:func:`replica_options`) with the parameter state a GPU holds
    at its step's peak under ZeRO as the runtime runs it: one FSDP unit per stage
    (:func:`held_state_multiplier`), or with ``units`` (ZeRO 1-3, ``Plan.zero_layer_units``)
    the shards and the layers gathered one at a time (:func:`sharded_state_multiplier`,
    :func:`layer_unit_factors`). ZeRO shards over the dp line's dp x ``cp`` GPUs."""
    out = replica_options(options, layout, dp)
    dp *= cp
    if not options.training:
        return replace(out, state_bytes_per_param_byte=None)
    k, g = options.optimizer_state_bytes_per_param_byte, layout.gradient_factor
    if units:
        return replace(out, state_bytes_per_param_byte=sharded_state_multiplier(dp, k, g),
                       layer_unit_factors=layer_unit_factors(zero, g))
    return replace(out, state_bytes_per_param_byte=held_state_multiplier(zero, dp, k, g))


def replica_options(options: SolveOptions, layout: LayoutOptions, dp: int) -> SolveOptions:
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


def sharded_costs(costs: CostGraph, tp: int, device: DeviceSpec, layout: LayoutOptions,
             runtime: RuntimeDescription,
             cache: dict[tuple[int | str, ...], CostGraph] | None = None,
             ep: int | None = None, cp: int = 1, cp_attention: str = "all_gather"
             ) -> CostGraph:
    """One GPU's share at tp (memoised in ``cache``, one entry per (tp, ep, cp,
    cp_attention), for one request), its collectives paying ``runtime``'s fixed cost per
    collective, with sequence parallelism where ``layout`` asks for it, its experts split
    over ``ep`` (default: ``layout.ep``, 1 when searched; :func:`autopart.solver.
    expert_parallel_costs.expert_costs`) and its sequences over ``cp`` with attention as
    ``cp_attention`` runs it (:func:`autopart.solver.context_parallel_costs.context_costs`,
    on the link of a cp group: cp GPUs ``tp`` apart)."""
    ep = (layout.ep or 1) if ep is None else ep
    key = (tp, ep, cp) if cp == 1 else (tp, ep, cp, cp_attention)
    if cache is not None and key in cache:
        return cache[key]
    if cp > 1:
        heads = layout.attention_heads or layout.num_heads
        base = (costs if layout.cp_tokens_profiled
                else split_tokens(costs, cp, device.op_overhead_us))
        cp_bw, cp_lat = layout.topology.link(tp * cp)
        local = context_costs(base, cp, causal=layout.causal_attention,
                              bandwidth_bytes_per_s=cp_bw, latency_us=cp_lat,
                              collective_overhead=runtime.collective_overhead_at,
                              reduce_scatter_as_all_reduce=runtime.reduce_scatter_as_all_reduce,
                              attention=cp_attention, heads=None if heads is None else heads // tp,
                              measured=next(((f, b) for k, f, b in layout.cp_attention_factors
                                             if k == cp_attention), None))
        out = sharded_costs(local, tp, device, layout, runtime, None, ep)
    elif ep > 1:  # tp is 1: the ep group is ep adjacent GPUs of one dp line
        base = sharded_costs(costs, tp, device, layout, runtime, cache, 1)
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
        cache[key] = out
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


def _cp_attention_choices(layout: LayoutOptions, tp: int, cp: int) -> list[str]:
    """How attention may span ``cp`` GPUs at ``tp``: the fixed way, else ``"all_gather"`` and,
    where the heads are known and tp x cp divides them, ``"ulysses"`` (a fixed Ulysses whose
    heads do not divide: none)."""
    if cp == 1:
        return ["all_gather"]
    heads = layout.attention_heads or layout.num_heads
    divides = heads is not None and heads % (tp * cp) == 0
    if layout.cp_attention is not None:
        return [] if layout.cp_attention == "ulysses" and heads is not None and not divides \
            else [layout.cp_attention]
    return ["all_gather", "ulysses"] if divides else ["all_gather"]


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


def pipeline_cluster(device: DeviceSpec, tp: int, pp: int, dp: int,
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
