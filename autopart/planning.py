"""plan_model and Profile: capture and profile once (the profiler), then solve (the solver),
with the measured costs of CPU ranks on this host (link, transfer, ranks per core)."""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError, ProfileError
from autopart.core.plan import Plan
from autopart.core.progress import phase, progress
from autopart.core.recompute_policy import CHECKPOINTED_POLICIES
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.signature import microbatch_inputs
from autopart.devices import cluster_for_devices, library_versions, resolve_devices
from autopart.options import recompute_policy_to_solve, renamed_choices
from autopart.profiler import session
from autopart.profiler.cache import cache_enabled
from autopart.profiler.collective_probe import MESSAGE_BYTES, measure_collective_overhead
from autopart.profiler.corunners import usable_cores
from autopart.profiler.links import SIZES as LINK_SIZES
from autopart.profiler.links import LinkFigures, fit_link, host_link
from autopart.profiler.selective_cost import measure_selective_overhead
from autopart.profiler.transfer_overhead import (
    MICROBATCHES,
    fit_transfer_overhead,
    run_transfer_ranks,
)
from autopart.profiler.transfer_overhead import host_figures as cached_host_figures
from autopart.runtime.description import describe
from autopart.runtime.distributed.transfer_rank import workload as transfer_workload
from autopart.runtime.host import tune_cpu_allocator
from autopart.solver import SolveOptions, find_candidates, solve
from autopart.solver.collectives import all_reduce_us
from autopart.solver.predict import predict as predict_plan
from autopart.solver.solve import auto_recompute

__all__ = ["Profile", "plan_model", "profile_model", "host_figures", "measure_host_figures",
           "cpu_ranks_per_core", "ranks_per_device", "with_collective_overhead"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile(session.ModelProfile):
    """A :class:`autopart.profiler.session.ModelProfile` that solves: "profile once, solve
    several ways" (``profile.solve(schedule_kind="1f1b", ...)``)."""

    def cluster(self) -> Cluster:
        """The devices as the solver sees them, with the measured host link if any."""
        return cluster_for_devices(list(self.devices), self.host_link)

    def options(self, **choices: Any) -> SolveOptions:
        """``SolveOptions`` for this profile; ``choices`` fixes or sets the rest
        (``optimize``, ``time_limit_s``, ``schedule_kind``, ``stages_per_rank``,
        ``num_microbatches`` where the profile left m open, ...)."""
        base: dict[str, Any] = dict(
            batch_size=self.batch_size, num_microbatches=self.num_microbatches,
            microbatch_candidates=self.microbatch_candidates, training=self.training,
            library_versions=library_versions(), runtime=self.runtime)
        m = choices.get("num_microbatches")
        if m is not None:  # one m of the profiled candidates
            if self.microbatch_candidates and m not in self.microbatch_candidates:
                raise PlanError(
                    f"num_microbatches={m} is not one this profile priced: it timed the "
                    f"microbatches of m in {list(self.microbatch_candidates)} (the batch of "
                    f"{self.batch_size} split into microbatches of at least 2 rows); choose "
                    f"one of them, or profile with num_microbatches={m} fixed "
                    f"(plan_model(..., num_microbatches={m})) to time that microbatch")
            base["microbatch_candidates"] = None
        return SolveOptions(**{**base, **choices})

    def solve(self, **choices: Any) -> Plan:
        """Solve on this profile's costs for its devices; ``choices`` as in :meth:`options`.

        Raises:
            InfeasiblePlanError: nothing fits the devices' memory or the stage count.
            PlanError: contradictory choices.
        """
        return solve(self.costs, self.cluster(), self.options(**choices))


def _cut_positions(costs: CostGraph) -> tuple[int, ...]:
    """The solver's cut candidates, where the profiler may cut a graph to time it."""
    return tuple(find_candidates(costs, 3).positions)


def profile_model(model: nn.Module, example_inputs: tuple[Any, ...] = (), *,
                  example_kwargs: dict[str, Any] | None = None,
                  devices: list[str] | tuple[str, ...], num_microbatches: int | None = None,
                  training: bool = True, split_cost: bool = True, loss_fn: Any = None,
                  example_target: Any = None, cache: bool | None = None,
                  low_batch: bool = True, backend: str = "local", fuse: bool = False,
                  collectives: bool = False, selective_cost: bool = False) -> Profile:
    """Capture ``model`` and measure every node's cost on ``devices[0]``
    (:func:`autopart.profiler.session.profile_model`), for the runtime ``backend``
    (``"local"`` or ``"distributed"``, :func:`autopart.runtime.description.describe`); with
    two or more ``cpu`` ranks also the link between them and, for a runtime whose ranks are
    processes, its cost per transfer (:func:`host_figures`). Arguments as
    :class:`autopart.profiler.session.ProfileOptions` (``fuse``: price stages compiled with
    ``torch.compile``, as ``compile(..., fuse=True)`` runs them; ``selective_cost``: also
    what the selective recompute policy's checkpointing costs per node; ``collectives``: for a
    world of ``len(devices)`` CPU rank processes whose layout is searched, also the cost of
    their collectives, :func:`with_collective_overhead`); docs/design.md ("Cost model the solver
    optimises") says what each phase measures and caches.

    Raises:
        PlanError: ``num_microbatches`` does not divide the batch, no batched input, or an
            unknown backend.
        TraceError: the model cannot be captured.
        ProfileError: a node fails to run on the device.
    """
    runtime = describe(backend)
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    # measure with the allocator the CPU runtimes use; the cache key says which it was
    malloc = tune_cpu_allocator() if torch.device(devices[0]).type == "cpu" else None
    options = session.ProfileOptions(
        devices=tuple(devices), cut_positions=_cut_positions, num_microbatches=num_microbatches,
        training=training, split_cost=split_cost, selective_cost=selective_cost,
        loss_fn=loss_fn, example_target=example_target, cache=cache, low_batch=low_batch,
        runtime=runtime, cpu_malloc=malloc, fuse=fuse)
    with progress():  # one display for the model's phases and the link's
        measured = session.profile_model(model, args, dict(example_kwargs or {}), options)
        fields = {f.name: getattr(measured, f.name) for f in dataclasses.fields(measured)}
        if len(devices) > 1 and all(torch.device(d).type == "cpu" for d in devices):
            fields.update(_with_host_figures(fields, cache, training))
    shared = ranks_per_device(devices, fields["runtime"])
    if shared > fields["runtime"].ranks_per_core:
        fields["runtime"] = dataclasses.replace(fields["runtime"], ranks_per_core=shared)
    profile = Profile(**fields)
    return with_collective_overhead(profile, len(devices)) if collectives else profile


def ranks_per_device(devices: list[str] | tuple[str, ...], runtime: RuntimeDescription) -> float:
    """How many of the one-process runtime's ranks share each device
    (``RuntimeDescription.ranks_per_core``): ``ranks / distinct devices``, 1.0 for a runtime
    whose ranks are processes (each CPU rank computes on cores of its own:
    :func:`cpu_ranks_per_core` says when they share them).

    Stages on one device run one after another in effect, whatever streams or threads issue
    them: measured on one H200 (torch 2.11, ``benchmarks/gpu/README.md``), four 1F1B stages
    of a 12 x 768 GPT-2 at m = 2 took 0.152 s, the plain model's step at the same
    microbatching, while a replay with a device per rank predicted 0.102 s. The local
    runtime's ``cpu`` ranks are stages issued by the process's threads onto the same cores.

    Args:
        devices: one device string per rank (``"cuda"`` counts as ``"cuda:0"``).
        runtime: the runtime the plan is for.

    Returns:
        Ranks per distinct device (>= 1.0; 1.0 for no devices).
    """
    if runtime.ranks_are_processes or not devices:
        return 1.0
    names = {f"{dev.type}:{dev.index or 0}" for dev in map(torch.device, devices)}
    return len(devices) / len(names)


def cpu_ranks_per_core(num_ranks: int, cores: int | None = None) -> float:
    """Rank processes per CPU core when ``num_ranks`` ranks of one torchrun host run on this
    process's cores (``RuntimeDescription.ranks_per_core``): ``ranks / cores``, never below 1
    (ranks that have a core each share none).

    Args:
        num_ranks: the world's ranks on this host (``$LOCAL_WORLD_SIZE`` under torchrun,
            when it divides ``num_ranks``).
        cores: the cores they may run on (default: this process's CPU affinity,
            ``os.sched_getaffinity``, else ``os.cpu_count()``).

    Raises:
        PlanError: fewer than one rank or core.
    """
    if cores is None:
        cores = usable_cores()
    if num_ranks < 1 or cores < 1:
        raise PlanError(f"{num_ranks} ranks on {cores} cores: both must be >= 1")
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", num_ranks))
    if per_host < 1 or num_ranks % per_host:
        per_host = num_ranks
    return max(1.0, per_host / cores)


def _with_host_figures(fields: dict[str, Any], cache: bool | None,
                       training: bool) -> dict[str, Any]:
    """The profile's ``host_link`` between CPU ranks, and its runtime with the cost per
    transfer where the runtime's ranks are processes (:func:`host_figures`) and the ranks per
    core when they are more than the cores (:func:`cpu_ranks_per_core`)."""
    t0 = time.perf_counter()
    use_cache = cache_enabled() if cache is None else cache
    runtime = fields["runtime"]
    with phase("host link"):
        if runtime.transfer_steps is not None and training:
            link, overhead = host_figures(use_cache)
            runtime = dataclasses.replace(runtime, transfer_overhead_us=overhead)
        else:
            link = host_link(use_cache)
    fields["timings_s"]["link_s"] = time.perf_counter() - t0
    if runtime.ranks_are_processes:
        runtime = dataclasses.replace(
            runtime, ranks_per_core=cpu_ranks_per_core(len(fields["devices"])))
    # gloo's collectives reduce and copy on the CPU ranks' own cores, and its reduce-scatter
    # reduces the whole buffer
    runtime = dataclasses.replace(runtime, collectives_share_compute=True,
                                  reduce_scatter_as_all_reduce=True)
    return {"host_link": link, "runtime": runtime}


def with_collective_overhead(profile: Profile, world: int) -> Profile:
    """``profile`` with its runtime's ``collective_overhead_points`` measured for ``world``
    CPU ranks of this host (:func:`autopart.profiler.collective_probe.
    measure_collective_overhead`: ``world`` gloo processes at the world's ranks per core,
    :func:`cpu_ranks_per_core`, about 3-15 s; not cached, since the figures
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


def measure_host_figures(use_cache: bool = True) -> tuple[LinkFigures, float]:
    """The link between two gloo processes on this host and the distributed runtime's cost per
    transfer between them, measured in one pair of processes (about 5 s): the 1F1B plan of
    :func:`autopart.runtime.distributed.transfer_rank.workload` (negligible compute) with
    :data:`autopart.profiler.transfer_overhead.MICROBATCHES` microbatches on two ``cpu`` ranks
    is run for its median step; the cost per transfer is the one at which the cost model's
    replay of that plan, with the link measured there, takes that step
    (:func:`autopart.profiler.transfer_overhead.fit_transfer_overhead`). The plan is made
    before the processes start (profiled beside them, the tiny model's nodes measure slow).

    Returns:
        ``(link, µs per transfer)``.

    Raises:
        ProfileError: the two processes failed, or their times do not fit a link.
    """
    model, x, y, loss_fn = transfer_workload()
    profile = profile_model(model, (x,), devices=["cpu"], num_microbatches=MICROBATCHES,
                            loss_fn=loss_fn, example_target=y, cache=use_cache,
                            backend="distributed")
    options = profile.options(schedule_kind="1f1b", stages_per_rank=1)
    # the cut of a chain of equal layers does not depend on the link: the preset's will do
    plan = solve(profile.costs, cluster_for_devices(["cpu", "cpu"]), options)
    steps_entry = profile.runtime.transfer_steps
    assert steps_entry is not None
    with tempfile.TemporaryDirectory(prefix="autopart-plan-") as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        plan.save(plan_path)
        steps, one_way = run_transfer_ranks(steps_entry, plan_path)
    link = fit_link(LINK_SIZES, tuple(one_way))
    cluster = cluster_for_devices(["cpu", "cpu"], link)

    def predicted_us(per_transfer_us: float) -> float:
        runtime = dataclasses.replace(options.runtime, transfer_overhead_us=per_transfer_us)
        return predict_plan(plan, profile.costs, cluster,
                            dataclasses.replace(options, runtime=runtime)).step_time_us

    return link, fit_transfer_overhead(predicted_us, statistics.median(steps) * 1e6)


def with_selective_cost(profile: Profile, args: tuple[Any, ...],
                        kwargs: dict[str, Any] | None = None) -> Profile:
    """``profile`` with what selective checkpointing costs per node on its device
    (``RuntimeDescription.selective_us_per_node``), measured now on a piece of its captured
    graph with the example inputs ``args`` / ``kwargs`` it was profiled with
    (:func:`autopart.profiler.selective_cost.measure_selective_overhead`, about 2 s)."""
    kwargs = dict(kwargs or {})
    if profile.num_microbatches is not None:  # captured at the microbatch, as profiled
        args, kwargs = microbatch_inputs(args, kwargs, profile.num_microbatches)
    flat = profile.captured.flatten_inputs(args, kwargs)
    us = measure_selective_overhead(profile.captured, flat, profile.costs, profile.devices[0],
                                    _cut_positions(profile.costs))
    return dataclasses.replace(profile, runtime=dataclasses.replace(
        profile.runtime, selective_us_per_node=us))


def solve_auto_recompute(profile: Profile, solve_with: Callable[[Profile, str], Plan],
                         args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                         optimize: str) -> tuple[Plan, Profile]:
    """``recompute_policy="auto"`` with the selective policy's cost measured only where it
    can matter: solve with ``"full"`` (``solve_with(profile, "full")``); where that plan
    recomputes a stage, measure the cost (:func:`with_selective_cost`), solve with
    ``"op"`` and keep the better by the objective
    (:func:`autopart.solver.solve.auto_recompute`). Returns the plan and the profile it was
    solved on (with the measured cost when it was measured)."""
    solved_on = [profile]

    def solve(policy: str) -> Plan:
        if policy in CHECKPOINTED_POLICIES \
                and solved_on[0].runtime.selective_us_per_node == (0.0, 0.0):
            t0 = time.perf_counter()
            with phase("selective cost"):
                solved_on[0] = with_selective_cost(solved_on[0], args, kwargs)
            solved_on[0].timings_s["selective_cost_s"] = time.perf_counter() - t0
        return solve_with(solved_on[0], policy)

    return auto_recompute(solve, optimize), solved_on[0]


@functools.lru_cache(maxsize=1)
def host_figures(use_cache: bool = True) -> tuple[LinkFigures | None, float]:
    """This host's link between CPU ranks and the distributed runtime's cost per transfer
    (µs): cached per machine, else :func:`measure_host_figures` once per process
    (:func:`autopart.profiler.transfer_overhead.host_figures`)."""
    return cached_host_figures(lambda: measure_host_figures(use_cache), use_cache)


def plan_model(model: nn.Module, example_inputs: tuple[Any, ...] = (), *,
               example_kwargs: dict[str, Any] | None = None,
               devices: list[str] | tuple[str, ...] | None = None,
               num_stages: int | None = None, num_microbatches: int | None = None,
               optimize: str = "speed", schedule_kind: str | None = None,
               stages_per_rank: int | None = None, recompute: bool | None = None,
               training: bool = True, time_limit_s: float = 10.0, loss_fn: Any = None,
               example_target: Any = None, cache: bool | None = None,
               backend: str = "local", issue_threads: int | None = 1, fuse: bool = False,
               cuda_graphs: bool = False, **solve_options: Any) -> tuple[Plan, Profile]:
    """Profile ``model`` on ``devices`` and solve for a plan ("profile once, solve several
    ways": ``profile.solve(schedule_kind="1f1b", ...)`` re-solves on the same costs).

    Args:
        model: the model.
        example_inputs: positional inputs, tensors ``(batch, ...)``.
        example_kwargs: keyword inputs.
        devices: one device per rank; default: the visible GPUs, else ``["cpu"] * ranks``
            with ``ranks = num_stages // stages_per_rank``.
        num_stages: total stages S = ranks x stages_per_rank; fixes v when given.
        num_microbatches: m; None lets the solver choose among the batch's divisors.
        optimize: ``"speed"`` (default) or ``"memory"``.
        schedule_kind: schedule kind, or None (the solver chooses); ``schedule=`` is accepted
            as its older name.
        stages_per_rank: v, or None (the solver chooses).
        recompute: every stage, none, or None (the solver decides per stage).
        training: plan forward + backward (default) or inference.
        time_limit_s: CP-SAT limit per solve, seconds (default 10).
        loss_fn, example_target: the loss and a target for the full batch; the loss's cost
            on the last stage is measured with them (estimated without a target).
        cache: read and store the costs in the profile cache; None (default): on unless
            ``$AUTOPART_CACHE`` is ``0``/``off``.
        backend: the runtime the plan is for, ``"local"`` (default) or ``"distributed"``
            (:func:`autopart.runtime.description.describe`): whose backward split is timed,
            how it holds receive buffers, and its cost per transfer.
        issue_threads: the local runtime's issuing threads the plan is priced for (default
            1; None: one per rank, ``pipe.issue_threads``); ignored for ``"distributed"``.
        fuse: the stages will run compiled (``compile(..., fuse=True)``): the profile is
            calibrated to compiled segments' times, so the plan prices compiled stages
            (:class:`autopart.profiler.session.ProfileOptions`; default False).
        cuda_graphs: the local runtime will replay the CUDA stages as graphs
            (``compile(..., cuda_graphs=True)``): the plan charges their actions no host issue
            time (``RuntimeDescription.cuda_graphs``; default False); ignored for
            ``"distributed"``.
        **solve_options: further :class:`autopart.solver.SolveOptions` fields
            (``memory_cap_bytes``, ``optimizer_state_bytes_per_param_byte``, ...).

    Returns:
        The plan, and the profile it was solved on.

    Raises:
        PlanError: inconsistent stage, device or microbatch counts, or an unknown backend.
        TraceError, ProfileError: capture or profiling failed.
        InfeasiblePlanError: no plan fits.
    """
    solve_options = renamed_choices(solve_options)
    schedule_kind = solve_options.pop("schedule_kind", schedule_kind)
    if "recompute_policy" in solve_options:
        solve_options["recompute_policy"] = recompute_policy_to_solve(
            solve_options["recompute_policy"], fuse)
    device_names, v = _ranks_and_v(devices, num_stages, stages_per_rank)
    fixed = {k: val for k, val in (("schedule_kind", schedule_kind), ("stages_per_rank", v),
                                   ("recompute", recompute)) if val is not None}
    # the split cost matters only where the solver may still pick a kind that splits the
    # backward: zero_bubble (v = 1), zbv or dualpipev (v = 2)
    kind_fixed, v_fixed = fixed.get("schedule_kind"), fixed.get("stages_per_rank")
    may_split = any(kind_fixed in (None, kind) and v_fixed in (None, v)
                    for kind, v in (("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2)))
    with progress():  # one display for the phases of the profile and the solve
        profile = profile_model(model, example_inputs, example_kwargs=example_kwargs,
                                devices=device_names, num_microbatches=num_microbatches,
                                training=training, split_cost=may_split, loss_fn=loss_fn,
                                selective_cost=recompute is not False and solve_options.get(
                                    "recompute_policy") in CHECKPOINTED_POLICIES,
                                example_target=example_target, cache=cache, backend=backend,
                                fuse=fuse)
        if backend == "local" and (issue_threads, cuda_graphs) != (
                profile.runtime.issue_threads, profile.runtime.cuda_graphs):
            profile = dataclasses.replace(profile, runtime=dataclasses.replace(
                profile.runtime, issue_threads=issue_threads, cuda_graphs=cuda_graphs))
        t0 = time.perf_counter()
        with phase("solve"):
            if solve_options.get("recompute_policy") == "auto" and training:
                plan, profile = solve_auto_recompute(
                    profile, lambda pr, policy: pr.solve(
                        optimize=optimize, time_limit_s=time_limit_s, **fixed,
                        **{**solve_options, "recompute_policy": policy}),
                    example_inputs, example_kwargs, optimize)
            else:
                plan = profile.solve(optimize=optimize, time_limit_s=time_limit_s, **fixed,
                                     **solve_options)
    profile.timings_s["solve_s"] = time.perf_counter() - t0
    return plan, profile


def _ranks_and_v(devices: list[str] | tuple[str, ...] | None, num_stages: int | None,
                 stages_per_rank: int | None) -> tuple[list[str], int | None]:
    """Device per rank, and the stages per rank fixed by the arguments (None: solver's).

    Raises:
        PlanError: counts below 1, or a stage count that is not devices x stages_per_rank.
    """
    for name, value in (("num_stages", num_stages), ("stages_per_rank", stages_per_rank)):
        if value is not None and value < 1:
            raise PlanError(f"{name}={value} must be >= 1")
    if devices is not None:
        names = resolve_devices(devices, None)
        if num_stages is None:
            return names, stages_per_rank
        if num_stages % len(names) or (stages_per_rank is not None
                                       and num_stages != len(names) * stages_per_rank):
            raise PlanError(f"num_stages={num_stages} does not equal {len(names)} devices x "
                            f"stages_per_rank={stages_per_rank or num_stages / len(names):g}; "
                            "pass num_stages = devices x stages_per_rank")
        return names, num_stages // len(names)
    v = stages_per_rank or 1
    if num_stages is not None and num_stages % v:
        raise PlanError(f"num_stages={num_stages} is not a multiple of stages_per_rank={v}")
    ranks = None if num_stages is None else num_stages // v
    names = resolve_devices(None, ranks)
    return names, (v if num_stages is not None or stages_per_rank is not None else None)
