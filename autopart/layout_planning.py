"""plan_layout: profile a model and choose the (tp, pp, dp, ZeRO) layout of a torchrun world,
with the cost of collectives among CPU ranks measured on this host."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from torch import nn

from autopart.codegen.attention_graph import attention_heads, attention_kinds
from autopart.core.cluster import DeviceSpec
from autopart.core.context import context_inputs, sequence_length
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.progress import phase, progress
from autopart.core.recompute_policy import CHECKPOINTED_POLICIES
from autopart.core.topology import HostTopology
from autopart.options import CompileOptions
from autopart.planning import Profile, profile_model, solve_auto_recompute
from autopart.profiler.context_attention import measure_context_attention
from autopart.solver.layout_search import LayoutOptions, solve_layout

__all__ = ["context_request", "plan_layout", "solve_world_layout", "layout_request",
           "host_ranks_topology", "model_heads"]


#: Schedule kinds whose backward is split (I / W): the profile times the split only where
#: the search may pick one of them.
_SPLITTING = (None, "zero_bubble", "zbv", "dualpipev")


def host_ranks_topology(num_ranks: int, device: DeviceSpec,
                        ranks_per_host: int | None = None,
                        collective_bandwidth_bytes_per_s: float = 0.0) -> HostTopology:
    """The host of a torchrun launch as the layout search sees it: ``ranks_per_host`` ranks
    (default all ``num_ranks``: one host) joined by ``device``'s own link, inside and
    between hosts. For ``cpu`` ranks that link is the one measured between two gloo
    processes on this host (:func:`autopart.planning.host_figures`, cached per machine,
    reaching the solver through :meth:`autopart.planning.Profile.cluster`): it prices the
    pipeline's sends. tp and dp collectives are priced as ring collectives at
    ``collective_bandwidth_bytes_per_s`` where it was measured (the runtime's
    ``RuntimeDescription.collective_bandwidth_bytes_per_s``, as the efficiency
    ``collective_efficiency`` = it over the link's, at most 1), else at the link's own.
    What a collective costs beyond its ring steps (ranks arriving late, waiting ranks woken
    on shared cores) is the runtime's ``collective_overhead_points``
    (:func:`with_collective_overhead`).

    Args:
        num_ranks: the world size.
        device: the ranks' device spec (its ``link_*`` figures).
        ranks_per_host: ranks on one host, dividing ``num_ranks``; default ``num_ranks``.
        collective_bandwidth_bytes_per_s: the collectives' measured bus bandwidth, bytes/s
            (default 0.0: none measured).
    """
    per_host = ranks_per_host or num_ranks
    bw, lat = device.link_bandwidth_bytes_per_s, device.link_latency_us
    efficiency = (min(1.0, collective_bandwidth_bytes_per_s / bw)
                  if collective_bandwidth_bytes_per_s > 0 else 1.0)
    return HostTopology(f"{per_host}x{device.name}", per_host, bw, bw, lat, lat,
                        collective_efficiency=efficiency,
                        source=f"{device.name} ranks of one torchrun host; link: {device.source}")


def model_experts(model: nn.Module) -> int | None:
    """The experts per MoE layer an ep must divide: a Hugging Face config's
    ``num_local_experts`` (Mixtral), ``num_experts`` (Qwen-MoE, OLMoE) or
    ``n_routed_experts`` (DeepSeek), else None."""
    config = getattr(model, "config", None)
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_heads(model: nn.Module) -> int | None:
    """The attention heads a tp must divide: a Hugging Face config's
    ``num_attention_heads`` (GPT-2's ``n_head``), else None (not checked)."""
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def layout_request(options: CompileOptions, world: int, device: DeviceSpec,
                   num_heads: int | None = None,
                   collective_bandwidth_bytes_per_s: float = 0.0, *,
                   num_experts: int | None = None) -> LayoutOptions:
    """The layout search's request for ``world`` ranks of one host: ``options``' tp, dp and
    ZeRO stage fixed where given, the rest searched; collectives at
    ``collective_bandwidth_bytes_per_s`` where measured (:func:`host_ranks_topology`).

    Raises:
        PlanError: a tp that does not divide the ranks or the heads, a bad ZeRO stage, or
            fixed degrees whose product is not ``world``.
    """
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_host < 1 or world % per_host:
        per_host = world
    topology = host_ranks_topology(world, device, per_host, collective_bandwidth_bytes_per_s)
    return LayoutOptions(num_gpus=world, topology=topology, tp=options.tp, dp=options.dp,
                         zero_stage=options.zero_stage, num_heads=num_heads,
                         overlap_grad_reduce=options.overlap_grad_reduce,
                         zero_layer_units=options.zero_layer_units and not options.fuse,
                         sequence_parallel=options.sequence_parallel, ep=options.ep,
                         num_experts=num_experts, cp=options.cp,
                         cp_attention=options.cp_attention)


def plan_layout(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                world: int, device: str, options: CompileOptions, loss_fn: Any = None,
                example_target: Any = None, state_factor: float = 2.0,
                ) -> tuple[Plan, Profile]:
    """Profile ``model`` for the distributed runtime and choose its (tp, pp, dp, ZeRO)
    layout and pipeline plan for ``world`` ranks (:func:`solve_layout`).

    The example inputs are the global batch (what every rank passes; each replica runs
    ``batch / dp`` rows). Costs are measured on ``device`` as :func:`autopart.plan_model`
    measures them; with ``cpu`` ranks the link between them is measured (cached per
    machine) and prices the pipeline's sends and the tp / dp collectives
    (:func:`host_ranks_topology`), and each collective's fixed cost is measured in
    ``world`` processes (:func:`autopart.planning.with_collective_overhead`). With m open, a
    replica's microbatch is one of the profiled microbatch sizes
    (``LayoutOptions.microbatch_sizes``), never smaller.

    Args:
        model, args, kwargs: the model and its example inputs (global batch).
        world: ranks to lay out (tp x pp x dp).
        device: every rank's device kind, ``"cpu"`` or ``"cuda"``.
        options: ``tp``, ``dp``, ``zero_stage`` (None: searched), ``num_microbatches``,
            ``schedule_kind``, ``stages_per_rank``, ``recompute``, ``optimize``,
            ``time_limit_s`` as :func:`autopart.compile` takes them.
        loss_fn, example_target: the loss and a target of the global batch.
        state_factor: optimizer state bytes per parameter byte.

    Returns:
        The plan (tp, dp, zero_stage set; its ranks the pp ranks on ``device``) and the
        profile it was solved on.

    Raises:
        PlanError: inconsistent degrees, batch or choices (naming the values and the fix).
        InfeasiblePlanError: no layout fits the memory.
        TraceError, ProfileError: capture or profiling failed.
    """
    if options.cp is None:  # searched on whole sequences, split per cp rank by the search
        max_cp = _max_cp(model, args, kwargs)
        plan, profile = _plan_layout(model, args, kwargs, world=world, device=device,
                                     options=options, loss_fn=loss_fn,
                                     example_target=example_target,
                                     state_factor=state_factor, max_cp=max_cp)
        if plan.cp == 1:
            return plan, profile
        # the stages run one cp rank's tokens: profile them there and solve at that cp
        options = dataclasses.replace(options, cp=plan.cp, cp_attention=plan.cp_attention)
    return _plan_layout(model, args, kwargs, world=world, device=device, options=options,
                        loss_fn=loss_fn, example_target=example_target,
                        state_factor=state_factor)


def _max_cp(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The largest cp the inputs allow (S / 2), or None where context parallelism cannot take
    the model or its inputs (no ``position_ids``, positions given, a sequence of odd length:
    :func:`autopart.core.context.context_inputs`'s refusals)."""
    try:
        context_inputs(model, 2, args, kwargs)
        return sequence_length(args, kwargs) // 2
    except PlanError:
        return None


def _plan_layout(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 world: int, device: str, options: CompileOptions, loss_fn: Any,
                 example_target: Any, state_factor: float, max_cp: int | None = None,
                 ) -> tuple[Plan, Profile]:
    """:func:`plan_layout` at ``options.cp`` (None: searched up to ``max_cp`` on whole
    sequences)."""
    cp = options.cp or 1
    if world % cp:
        raise PlanError(f"cp={cp} does not divide the {world} ranks; launch a multiple of cp "
                        "ranks or choose another cp")
    # with cp > 1 the profile is of one cp rank's S / cp tokens, as the stages run
    args, kwargs, example_target = context_inputs(model, cp, args, kwargs, example_target)
    devices = ["cpu"] * world if device == "cpu" else [f"cuda:{r}" for r in range(world)]
    with progress():
        profile = profile_model(model, args, example_kwargs=kwargs, devices=devices,
                                num_microbatches=options.num_microbatches,
                                training=loss_fn is not None,
                                split_cost=options.schedule_kind in _SPLITTING,
                                loss_fn=loss_fn, example_target=example_target,
                                backend="distributed", collectives=True,
                                selective_cost=options.recompute is not False
                                and options.solve_recompute_policy() in CHECKPOINTED_POLICIES)
        t0 = time.perf_counter()
        heads, experts = model_heads(model), model_experts(model)
        with phase("solve"):
            if options.solve_recompute_policy() == "auto" and loss_fn is not None:
                plan, profile = solve_auto_recompute(
                    profile, lambda pr, policy: solve_world_layout(
                        pr, dataclasses.replace(options, recompute_policy=policy), world,
                        num_heads=heads, num_experts=experts, state_factor=state_factor,
                        max_cp=max_cp),
                    args, kwargs, options.optimize or "speed")
            else:
                plan = solve_world_layout(profile, options, world, num_heads=heads,
                                          num_experts=experts, state_factor=state_factor,
                                          max_cp=max_cp)
    profile.timings_s["solve_s"] = time.perf_counter() - t0
    return plan, profile


def context_request(request: LayoutOptions, profile: Profile, cp: int,
                    cp_attention: str | None = None) -> LayoutOptions:
    """``request`` for a fixed ``cp`` >= 2 on ``profile``, a profile of one cp rank's S / cp
    tokens (as :func:`plan_layout` makes it): the model's attention kind and heads read from
    its graph and, on a measured profile, the runtime's attention timed against the model's
    on the profiled device for ``cp_attention`` (None: each form whose heads divide), which
    the solver prices in place of its block count
    (:func:`autopart.profiler.context_attention.measure_context_attention`, about 1 s each).

    Raises:
        PlanError: the graph's attention cannot run context-parallel.
    """
    kinds = attention_kinds(profile.captured)
    heads = attention_heads(profile.captured)
    factors = []
    if profile.costs.source.startswith("measured"):
        for kind in (cp_attention,) if cp_attention else ("all_gather", "ulysses"):
            if kind == "ulysses" and (heads is None or heads % cp):
                continue
            with phase(f"timing {kind} attention at cp {cp}"):
                forward, backward = measure_context_attention(profile.captured, cp, kind,
                                                              device=profile.devices[0])
            factors.append((kind, forward, backward))
    return dataclasses.replace(request, cp_tokens_profiled=True,
                               causal_attention=all(kinds.values()), attention_heads=heads,
                               cp_attention_factors=tuple(factors))


def solve_world_layout(profile: Profile, options: CompileOptions, world: int, *,
                       num_heads: int | None = None, num_experts: int | None = None,
                       state_factor: float = 2.0, max_cp: int | None = None) -> Plan:
    """The (tp, pp, dp, ZeRO) plan for ``world`` ranks on ``profile``'s costs (the layout half
    of :func:`plan_layout`; "profile once, solve several ways").

    Args:
        profile: a profile of the global batch on ``world`` ranks' devices.
        options: as :func:`plan_layout` reads them.
        world: the ranks.
        num_heads: the model's attention heads (a tp must divide them), or None.
        num_experts: the experts per MoE layer (an ep must divide them), or None.
        state_factor: optimizer state bytes per parameter byte.
        max_cp: with ``options.cp`` None (searched; ``profile`` of whole sequences), the
            largest cp the sequence allows (S / 2), or None: cp stays 1.

    Raises:
        PlanError, InfeasiblePlanError: as :func:`plan_layout`.
    """
    choices = {k: v for k, v in (("schedule_kind", options.schedule_kind),
                                 ("stages_per_rank", options.stages_per_rank),
                                 ("recompute", options.recompute),
                                 ("recompute_policy", options.solve_recompute_policy()),
                                 ("num_microbatches", options.num_microbatches))
               if v is not None}
    solve_options = profile.options(optimize=options.optimize or "speed",
                                    time_limit_s=options.time_limit_s,
                                    optimizer_state_bytes_per_param_byte=state_factor,
                                    **choices)
    spec = profile.cluster().devices[0]
    request = layout_request(options, world, spec, num_heads,
                             profile.runtime.collective_bandwidth_bytes_per_s,
                             num_experts=num_experts)
    if (options.cp or 1) > 1:  # the profile is of one cp rank's tokens (plan_layout)
        request = context_request(request, profile, options.cp or 1, options.cp_attention)
    elif options.cp is None:  # whole sequences: the search splits them where cp can run
        causal = True
        try:
            causal = all(attention_kinds(profile.captured).values())
        except PlanError:
            max_cp = None
        request = dataclasses.replace(request, cp=None, max_cp=max_cp, causal_attention=causal,
                                      attention_heads=attention_heads(profile.captured))
    if profile.microbatch_candidates is not None and options.num_microbatches is None:
        # a replica's microbatches no smaller than the smallest profiled one: below it the
        # two-point costs extrapolate (and can go negative)
        sizes = tuple(sorted({profile.batch_size // m for m in profile.microbatch_candidates}))
        request = dataclasses.replace(request, microbatch_sizes=sizes)
    plan = solve_layout(profile.costs, spec, solve_options, request)
    if any(d != "cpu" for d in profile.devices):
        return plan
    # the search names its ranks cuda:r whatever they are
    return dataclasses.replace(
        plan, ranks=tuple(dataclasses.replace(r, device="cpu") for r in plan.ranks),
        stages=tuple(dataclasses.replace(s, device="cpu") for s in plan.stages))
