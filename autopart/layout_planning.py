"""plan_layout: profile a model and choose the (tp, pp, dp, ZeRO) layout of a torchrun world,
with the cost of collectives among CPU ranks measured on this host."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any

from torch import nn

from autopart.core.cluster import DeviceSpec
from autopart.core.errors import ProfileError
from autopart.core.plan import Plan
from autopart.core.progress import phase, progress
from autopart.core.topology import HostTopology
from autopart.options import CompileOptions
from autopart.planning import Profile, cpu_ranks_per_core, profile_model
from autopart.profiler.collective_probe import MESSAGE_BYTES, measure_collective_overhead
from autopart.solver.collectives import all_reduce_us
from autopart.solver.layout_search import LayoutOptions, solve_layout

__all__ = ["plan_layout", "solve_world_layout", "layout_request", "host_ranks_topology",
           "model_heads", "with_collective_overhead"]


def with_collective_overhead(profile: Profile, world: int) -> Profile:
    """``profile`` with its runtime's ``collective_overhead_points`` measured for ``world``
    CPU ranks of this host (:func:`autopart.profiler.collective_probe.
    measure_collective_overhead`: ``world`` gloo processes at the world's ranks per core,
    :func:`autopart.planning.cpu_ranks_per_core`, about 3-15 s; not cached, since the figures
    follow the host's load), the probe's own message taken off as the solver prices it on
    the profile's link; and its ``transfer_wait_points``, from the same processes: a
    pipeline's transfer waits for its receiver to be scheduled again, the more so when ranks
    share cores or other jobs load the host, which the per-transfer cost (measured once per
    machine, a core per rank) does not hold; the larger of the two is charged; and its
    ``collective_bandwidth_bytes_per_s``, the bandwidth gloo's all-reduce reaches, and its
    ``copy_bytes_per_s``, how fast the runtime copies around its collectives.
    Unchanged for GPU ranks (NCCL's ring steps carry the fixed cost), for one rank, and for
    a world of odd size. When the probe fails: a ``RuntimeWarning`` and the profile
    unchanged.

    Args:
        profile: a profile for ``cpu`` ranks (its ``host_link`` prices the probe's message).
        world: the ranks of the torchrun world.
    """
    if world < 2 or world % 2 or any(d != "cpu" for d in profile.devices):
        return profile
    cluster = profile.cluster()
    spec = cluster.devices[0]
    ring = all_reduce_us(MESSAGE_BYTES, 2, spec.link_bandwidth_bytes_per_s,
                         spec.link_latency_us)
    link = cluster.transfer_us(MESSAGE_BYTES, 0, 1)
    per_core = cpu_ranks_per_core(world)
    try:
        with phase("collectives"):
            got = measure_collective_overhead(world, ranks_per_core=per_core, ring_us=ring,
                                              link_us=link)
    except ProfileError as exc:
        warnings.warn(f"{exc}; planning with no fixed cost per collective", RuntimeWarning,
                      stacklevel=2)
        return profile
    runtime = dataclasses.replace(
        profile.runtime, collective_overhead_points=got.collective_points,
        transfer_wait_points=got.transfer_points,
        collective_bandwidth_bytes_per_s=got.bandwidth_bytes_per_s,
        copy_bytes_per_s=got.copy_bytes_per_s)
    return dataclasses.replace(profile, runtime=runtime)


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


def model_heads(model: nn.Module) -> int | None:
    """The attention heads a tp must divide: a Hugging Face config's
    ``num_attention_heads`` (GPT-2's ``n_head``), else None (not checked)."""
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    return heads if isinstance(heads, int) else None


def layout_request(options: CompileOptions, world: int, device: DeviceSpec,
                   num_heads: int | None = None,
                   collective_bandwidth_bytes_per_s: float = 0.0) -> LayoutOptions:
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
                         zero_stage=options.zero_stage, num_heads=num_heads)


def _on_ranks(plan: Plan, device: str) -> Plan:
    """``plan`` with every rank and stage on ``device`` (the search names its ranks
    ``cuda:r`` whatever they are)."""
    return dataclasses.replace(
        plan, ranks=tuple(dataclasses.replace(r, device=device) for r in plan.ranks),
        stages=tuple(dataclasses.replace(s, device=device) for s in plan.stages))


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
    ``world`` processes (:func:`with_collective_overhead`). With m open, a replica's microbatch is one of the
    profiled microbatch sizes (``LayoutOptions.microbatch_sizes``), never smaller.

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
    training = loss_fn is not None
    devices = ["cpu"] * world if device == "cpu" else [f"cuda:{r}" for r in range(world)]
    with progress():
        profile = profile_model(model, args, example_kwargs=kwargs, devices=devices,
                                num_microbatches=options.num_microbatches, training=training,
                                split_cost=options.schedule_kind in _SPLITTING,
                                loss_fn=loss_fn, example_target=example_target,
                                backend="distributed")
        profile = with_collective_overhead(profile, world)
        t0 = time.perf_counter()
        with phase("solve"):
            plan = solve_world_layout(profile, options, world, num_heads=model_heads(model),
                                      state_factor=state_factor)
    profile.timings_s["solve_s"] = time.perf_counter() - t0
    return plan, profile


def solve_world_layout(profile: Profile, options: CompileOptions, world: int, *,
                       num_heads: int | None = None, state_factor: float = 2.0) -> Plan:
    """The (tp, pp, dp, ZeRO) plan for ``world`` ranks on ``profile``'s costs (the layout half
    of :func:`plan_layout`; "profile once, solve several ways").

    Args:
        profile: a profile of the global batch on ``world`` ranks' devices.
        options: as :func:`plan_layout` reads them.
        world: the ranks.
        num_heads: the model's attention heads (a tp must divide them), or None.
        state_factor: optimizer state bytes per parameter byte.

    Raises:
        PlanError, InfeasiblePlanError: as :func:`plan_layout`.
    """
    spec = profile.cluster().devices[0]
    choices = {k: v for k, v in (("schedule_kind", options.schedule_kind),
                                 ("stages_per_rank", options.stages_per_rank),
                                 ("recompute", options.recompute),
                                 ("num_microbatches", options.num_microbatches))
               if v is not None}
    solve_options = profile.options(optimize=options.optimize or "speed",
                                    time_limit_s=options.time_limit_s,
                                    optimizer_state_bytes_per_param_byte=state_factor,
                                    **choices)
    request = layout_request(options, world, spec, num_heads,
                             profile.runtime.collective_bandwidth_bytes_per_s)
    if profile.microbatch_candidates is not None and options.num_microbatches is None:
        # a replica's microbatches no smaller than the smallest profiled one: below it the
        # two-point costs extrapolate (and can go negative)
        sizes = tuple(sorted({profile.batch_size // m for m in profile.microbatch_candidates}))
        request = dataclasses.replace(request, microbatch_sizes=sizes)
    plan = solve_layout(profile.costs, spec, solve_options, request)
    on_cpu = all(d == "cpu" for d in profile.devices)
    return _on_ranks(plan, "cpu") if on_cpu else plan
