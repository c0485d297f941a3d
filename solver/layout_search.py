"""solve_layout: choose tp, pp, dp, cp and the ZeRO stage around the pipeline solver, best bound
first (the layouts and their bounds: :mod:`autopart.solver.layout_candidates`)."""

from __future__ import annotations

import time
from dataclasses import replace

from autopart.core.cluster import DeviceSpec
from autopart.core.costgraph import CostGraph
from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.core.plan import ParetoPoint, Plan, ShardedParameter
from autopart.core.plan_rules import overlaps_expert_exchanges
from autopart.core.schedule import splits_backward
from autopart.solver.expert_parallel_costs import expert_params
from autopart.solver.layout_candidates import (
    layout_candidates,
    pipeline_cluster,
    sharded_costs,
    state_options,
)
from autopart.solver.layout_dp import (
    _baselines_dp_us,
    _hides_reduction,
    _stage_units,
    dp_exposed_us,
    dp_step_us,
    layer_units,
    layer_units_overlap,
)
from autopart.solver.layout_options import LayoutCandidate, LayoutOptions
from autopart.solver.options import SolveOptions
from autopart.solver.predict import plan_at
from autopart.solver.solve import auto_recompute, solve
from autopart.solver.tensor_parallel import find_tensor_parallel

__all__ = ["LayoutOptions", "LayoutCandidate", "layout_candidates", "evaluate_layout",
           "solve_layout", "dp_exposed_us", "layer_units", "hides_expert_exchanges"]


def hides_expert_exchanges(cand: LayoutCandidate, options: SolveOptions) -> bool:
    """Whether DualPipe-V's pairs at layout ``cand`` run at once, each hiding its expert
    all-to-alls under the other's compute, as the distributed runtime runs them
    (:func:`autopart.core.plan_rules.overlaps_expert_exchanges`) on ranks whose collectives
    do not share the compute's cores (``RuntimeDescription.collectives_share_compute``:
    CPU ranks run the pairs one after the other, ``DistributedPipeline.overlap_pairs``)."""
    return (overlaps_expert_exchanges("dualpipev", cand.ep, cand.tp, cand.cp,
                                      cand.zero_stage)
            and not options.runtime.collectives_share_compute)


def evaluate_layout(costs: CostGraph, device: DeviceSpec, options: SolveOptions,
                    layout: LayoutOptions, cand: LayoutCandidate,
                    cache: dict[tuple[int | str, ...], CostGraph] | None = None,
                    positions: tuple[int, ...] | None = None,
                    recompute: tuple[bool, ...] | None = None) -> Plan:
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
    the plan's. ZeRO's collectives run per layer unit where ``layout.zero_layer_units`` says
    so, but not under a schedule that splits the backward (one unit per stage there): unless
    the options fix the schedule, the schedules that run whole backwards are searched with
    the layer units and those that split with one unit per stage
    (``SolveOptions.split_backward``), and the better plan, dp collectives included, kept.

    Args:
        costs, device, options, layout: as for :func:`solve_layout`.
        cand: the layout (its tp, pp, dp, ZeRO stage).
        cache: :func:`sharded_costs`'s memo, or None.
        positions: cut positions (node indices, ``pp x v - 1``) to cost as given instead of
            searching (:func:`autopart.solver.predict.plan_at`: a hand plan's prediction);
            ``options`` then fixes ``schedule_kind`` and ``num_microbatches`` (per replica).
        recompute: with ``positions``, whether each stage recomputes (a plan's own flags);
            default: ``options.recompute`` for every stage (None: none).

    Raises:
        InfeasiblePlanError: nothing fits this layout.
        PlanError: ``positions`` without a fixed schedule kind and m, or not fitting the ranks.
    """
    tp, pp, dp, zero, cp = cand.tp, cand.pp, cand.dp, cand.zero_stage, cand.cp
    line = dp * cp  # the GPUs that reduce gradients together and share ZeRO's shards
    sharded = sharded_costs(costs, tp, device, layout, options.runtime, cache, cand.ep, cp,
                            cand.cp_attention)
    if sharded.expert_exchanges and not hides_expert_exchanges(cand, options):
        # DualPipe-V's pairs run one after the other at this layout: nothing hides the
        # all-to-alls (one copy per sharded graph: the solver's tables are kept per graph
        # object, solver.candidates._per_graph)
        quiet = ("no exchanges", cand.tp, cand.ep, cp, cand.cp_attention)
        if cache is None or quiet not in cache:
            sharded = replace(sharded, expert_exchanges=())
            if cache is not None:
                cache[quiet] = sharded
        else:
            sharded = cache[quiet]
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
    inner = replace(state_options(options, layout, dp, zero, units, cp),
                    whole_state_params=whole)
    cluster = pipeline_cluster(device, tp, pp, line, layout.topology)
    overlap, _ = _hides_reduction(layout, zero, line, options)
    degrees = (tp, line, zero, overlap)
    # with two searches (below): the chosen one's dp collectives, and both frontiers
    searched: tuple[float, float] | None = None
    points: list[ParetoPoint] = []
    if positions is None and units and options.schedule_kind is None:
        # a split backward runs one unit per stage (the runtime gathers the stage from its I
        # to its last W): the schedules that run whole backwards searched with the layer
        # units, those that split with one unit per stage, the better kept; the second
        # refines half as many subproblems (with all of them a 1T GPT's search on 1024
        # H100s took 52.6 s, with half each 20.8 s but the 76B row of megatron_table lost
        # its interleaved plan, 222.5 -> 209.6 TFLOP/s per GPU; so 33.4 s and kept)
        half = -(-options.max_cpsat_solves // 2)
        whole_units = replace(state_options(options, layout, dp, zero, False, cp),
                              whole_state_params=whole, max_cpsat_solves=half)
        priced: list[tuple[tuple[float, ...], bool, Plan, tuple[float, float]]] = []
        refusal: PlanError | None = None
        for per_layer, opts in ((True, replace(inner, split_backward=False)),
                                (False, replace(whole_units, split_backward=True))):
            try:
                found = solve(sharded, cluster, opts)
            except PlanError as exc:  # nothing fits, or no m suits these schedules
                if refusal is None or isinstance(exc, InfeasiblePlanError):
                    refusal = exc
                continue
            dp_us = _dp_extra(found, sharded, per_layer, degrees, layout, options, cand.ep)
            points += _shifted(found.pareto, dp_us[0])
            priced.append((_key(replace(found, predicted_step_time_us=(
                found.predicted_step_time_us + dp_us[0])), options.optimize),
                per_layer, found, dp_us))
        if not priced:
            assert refusal is not None
            raise refusal
        _, units, plan, searched = min(priced, key=lambda t: t[0])
    elif positions is None:
        plan = solve(sharded, cluster, inner)
    elif options.schedule_kind is None or options.num_microbatches is None:
        raise PlanError("evaluate_layout(positions=...) costs a fixed plan: set the options' "
                        f"schedule_kind ({options.schedule_kind!r}) and num_microbatches "
                        f"({options.num_microbatches!r}) too")
    else:
        plan = plan_at(sharded, cluster, inner, positions, kind=options.schedule_kind,
                       num_microbatches=options.num_microbatches,
                       stages_per_rank=options.stages_per_rank or 1,
                       recompute=bool(options.recompute) if recompute is None else recompute)
    extra, even = searched or _dp_extra(plan, sharded, units, degrees, layout, options,
                                        cand.ep)
    split = find_tensor_parallel(costs) if tp > 1 else None
    sharded_params = tuple(ShardedParameter(name, style)
                           for name, style in sorted(split.params.items())) if split else ()
    forward = (sum(nd.flops for nd in costs.nodes) * options.batch_size / costs.batch_size
               * (cp if layout.cp_tokens_profiled else 1))
    step = plan.predicted_step_time_us + extra
    baselines = tuple(replace(b, predicted_step_time_us=round(b.predicted_step_time_us + even, 3))
                      for b in plan.baselines)
    own = ParetoPoint(round(step, 3), max(r.peak_memory_bytes for r in plan.ranks))
    pareto = tuple(sorted({own, *(points or _shifted(plan.pareto, extra))},
                          key=lambda p: (p.predicted_step_time_us, p.peak_memory_bytes)))
    pareto = tuple(p for p in pareto if not any(
        q != p and q.predicted_step_time_us <= p.predicted_step_time_us
        and q.peak_memory_bytes <= p.peak_memory_bytes for q in pareto))
    return replace(
        plan, batch_size=options.batch_size, tp=tp, dp=dp, zero_stage=zero,
        baselines=baselines, pareto=pareto, sharded_parameters=sharded_params,
        overlap_grad_reduce=overlap, zero_layer_units=units,
        sequence_parallel=layout.sequence_parallel and tp > 1, ep=cand.ep, cp=cp,
        cp_attention=cand.cp_attention,
        predicted_step_time_us=round(step, 3),
        bubble_fraction=round(plan.bubble_fraction * plan.predicted_step_time_us / step, 6)
        if step > 0 else plan.bubble_fraction,
        cluster_fingerprint=f"{layout.num_gpus}x{device.name}/{layout.topology.name}",
        model_flops=int(round((3 if options.training else 1) * forward)))


def _first_clause(message: str, limit: int = 200) -> str:
    """A layout's refusal for the search's own message: its first clause (up to the first
    ``"; "``), cut at a word if still longer than ``limit`` characters."""
    clause = message.split("; ", 1)[0]
    if len(clause) <= limit:
        return clause
    return clause[:limit].rsplit(" ", 1)[0] + " ..."


def _shifted(points: tuple[ParetoPoint, ...], added_us: float) -> list[ParetoPoint]:
    """A replica's time-memory frontier with ``added_us`` µs of dp collectives on each step."""
    return [ParetoPoint(round(p.predicted_step_time_us + added_us, 3), p.peak_memory_bytes)
            for p in points]


def _dp_extra(plan: Plan, sharded: CostGraph, units: bool, degrees: tuple[int, int, int, bool],
              layout: LayoutOptions, options: SolveOptions, ep: int = 1) -> tuple[float, float]:
    """What the dp collectives add to a replica's pipeline ``plan`` (solved on ``sharded``,
    ZeRO's collectives per layer unit or not: ``units``) at ``degrees`` = (tp, dp x cp,
    ZeRO stage, overlapped ZeRO-0 reduction), µs: to its step (:func:`dp_step_us`: ZeRO
    0-1's after the schedule, ZeRO 2-3's inside every microbatch's actions), and to its
    baselines' (an even share's, or the plan's own
    where ZeRO 2-3's layer units hide theirs under the compute); at ``ep`` > 1 the experts'
    gradients reduced apart (:func:`autopart.solver.layout_dp.without_experts`: the replica's
    plan does not carry its layout's ep yet). ``(0, 0)`` without training or data
    parallelism."""
    if not options.training or degrees[1] == 1:
        return 0.0, 0.0
    zero = degrees[2]
    extra = dp_step_us(plan, degrees, layout, options.runtime,
                       _stage_units(plan, sharded, units), units, sharded, ep)
    # ZeRO 2-3's layer units hide their collectives under each unit's compute, which
    # depends on the cuts: the baselines (same layout, same runtime) take the plan's
    even = (extra if layer_units_overlap(zero, units, options.runtime)
            else _baselines_dp_us(plan, degrees, layout, options.runtime, sharded, ep))
    return extra, even


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
    degrees = (plan.tp, len(plan.ranks), plan.dp, plan.zero_stage, plan.cp,
               plan.cp_attention != "all_gather")
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
    ``"op"``; the better plan by the objective is returned
    (:func:`autopart.solver.solve.auto_recompute`).
    """
    if options.recompute_policy == "auto":
        return auto_recompute(lambda policy: solve_layout(
            costs, device, replace(options, recompute_policy=policy), layout), options.optimize)
    t0 = time.perf_counter()
    cache: dict[tuple[int | str, ...], CostGraph] = {}
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
                            f"ZeRO-{cand.zero_stage}: {_first_clause(str(exc))}")
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
