"""plan_model: capture and profile a model once, then solve for a plan as many ways as wanted."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopart.core.capture import CapturedGraph, capture
from autopart.core.cluster import PRESETS, Cluster, DeviceSpec
from autopart.core.costgraph import (
    CostGraph,
    segment_scales,
    through_two_batches,
    time_on_line,
)
from autopart.core.errors import PlanError, ProfileError
from autopart.core.plan import Plan
from autopart.core.version import __version__
from autopart.loss_cost import LossCost, estimate_loss_cost, measure_loss_cost, with_loss_cost
from autopart.profiler import profile_graph
from autopart.profiler.cache import (
    cache_enabled,
    cached_profile,
    load_measure,
    machine_busy,
    profile_key,
    store_measure,
)
from autopart.profiler.calibrate import calibrate_to_segments, segment_cuts, segment_times
from autopart.profiler.corunners import available as corunners_available
from autopart.profiler.corunners import co_runners
from autopart.profiler.corunners import model_step as corunner_step
from autopart.profiler.links import SIZES as LINK_SIZES
from autopart.profiler.links import (
    LinkFigures,
    cached_host_link,
    fit_link,
    host_link,
    store_host_link,
)
from autopart.profiler.split_cost import measure_split_backward_overhead
from autopart.runtime.host import tune_cpu_allocator
from autopart.runtime.launch import on_meta as launch_on_meta
from autopart.runtime.signature import InputSignature, batch_size, microbatch_inputs
from autopart.runtime_overhead import MICROBATCHES as _OVERHEAD_M
from autopart.runtime_overhead import (
    cached_transfer_overhead,
    fit_transfer_overhead,
    run_tiny_pipeline,
    store_transfer_overhead,
)
from autopart.runtime_overhead import workload as _overhead_workload
from autopart.solver import SolveOptions, find_candidates, solve
from autopart.solver.predict import predict as predict_plan

__all__ = ["Profile", "plan_model", "profile_model", "cluster_for_devices", "resolve_devices",
           "plan_devices", "library_versions", "host_figures", "measure_host_figures"]

_CUDA_PRESETS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80gb"),
                 ("A100 80GB", "a100-80gb"), ("A100", "a100-40gb"), ("L4", "l4"))


def library_versions() -> dict[str, str]:
    """Versions a plan records: torch and autopart (the solver adds ortools)."""
    return {"torch": torch.__version__, "autopart": __version__}


def cluster_for_devices(devices: list[str], host_link: LinkFigures | None = None) -> Cluster:
    """A Cluster for runtime device strings: ``"cpu"`` takes the ``cpu`` preset; a CUDA device
    takes the preset its name matches (H100, H200, A100, L4) with the memory it reports.

    Args:
        devices: one device string per rank.
        host_link: measured link between CPU ranks (:func:`autopart.profiler.links.host_link`);
            when given, ``cpu`` devices take its latency and bandwidth instead of the preset's
            nominal 2 µs and 10 GB/s.

    Raises:
        PlanError: a device that is neither ``cpu`` nor ``cuda:N``.
    """
    specs: list[DeviceSpec] = []
    cpu = PRESETS["cpu"]
    if host_link is not None:
        cpu = dataclasses.replace(
            cpu, link_bandwidth_bytes_per_s=host_link.bandwidth_bytes_per_s,
            link_latency_us=host_link.latency_us,
            source=(f"{cpu.source}; link measured between two {host_link.backend} processes "
                    f"on this host: {host_link.latency_us:.0f} µs + "
                    f"{host_link.bandwidth_bytes_per_s / 1e9:.2f} GB/s"))
    for name in devices:
        dev = torch.device(name)
        if dev.type == "cpu":
            specs.append(cpu)
            continue
        if dev.type != "cuda":
            raise PlanError(f"device {name!r}: only 'cpu' and 'cuda:N' devices are supported")
        props = torch.cuda.get_device_properties(dev)
        preset = next((PRESETS[p] for key, p in _CUDA_PRESETS if key in props.name), PRESETS["l4"])
        specs.append(dataclasses.replace(preset, name=props.name.replace(" ", "-").lower(),
                                         memory_bytes=int(props.total_memory)))
    return Cluster(tuple(specs), tuple(devices))


def _on_this_machine(dev: torch.device) -> bool:
    """``cpu``, or a CUDA device this process can see."""
    return dev.type == "cpu" or (dev.type == "cuda" and torch.cuda.is_available()
                                 and (dev.index or 0) < torch.cuda.device_count())


def plan_devices(plan: Plan, devices: list[str] | tuple[str, ...] | None) -> list[str]:
    """The devices a plan's ranks run on in this process: ``devices`` when given, else the
    devices the plan names when every one is here (``cpu``, or a visible ``cuda:N``; four
    stages on one GPU stay on that GPU), else what :func:`resolve_devices` picks for its
    rank count (a plan made for GPUs this machine lacks runs on ``cpu``), with a warning.

    Raises:
        PlanError: as :func:`resolve_devices`.
    """
    if devices is not None:
        return resolve_devices(devices, len(plan.ranks))
    named = [r.device for r in plan.ranks]
    if all(_on_this_machine(torch.device(d)) for d in named):
        return named
    chosen = resolve_devices(None, len(plan.ranks))
    warnings.warn(f"the plan's devices {named} are not all on this machine; its ranks run on "
                  f"{chosen} (pass devices=[...] to choose)", RuntimeWarning, stacklevel=3)
    return chosen


def resolve_devices(devices: list[str] | tuple[str, ...] | None, num_ranks: int | None,
                    ) -> list[str]:
    """One device string per rank.

    Args:
        devices: the devices given, or None (the visible GPUs, else ``num_ranks`` x cpu).
        num_ranks: the rank count wanted, or None (as many as ``devices``).

    Raises:
        PlanError: nothing to go on (no GPU, no count), a count that differs from the
            devices given, or a CUDA device that is not visible.
    """
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and (num_ranks is None or num_ranks <= count):
            return [f"cuda:{i}" for i in range(num_ranks or count)]
        if num_ranks is None:
            raise PlanError("no GPU is visible, so pass num_stages=S (stages run on 'cpu') "
                            "or devices=[...]")
        return ["cpu"] * num_ranks
    names = [str(d) for d in devices]
    if not names:
        raise PlanError("devices is empty; pass at least one device, e.g. ['cuda:0', 'cuda:1']")
    if num_ranks is not None and num_ranks != len(names):
        raise PlanError(f"the plan has {num_ranks} ranks but {len(names)} devices were "
                        "given; pass one device per rank")
    for d in names:
        dev = torch.device(d)
        if dev.type == "cuda" and not _on_this_machine(dev):
            raise PlanError(f"device {d!r} is not available (visible CUDA devices: "
                            f"{torch.cuda.device_count()}); use 'cpu' or a visible GPU")
    return names


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the solver needs about one model on one set of devices, measured once.

    Attributes:
        captured: the model captured at the profiled batch (the microbatch size when
            ``num_microbatches`` was fixed, else the full batch).
        costs: per-node costs measured on ``devices[0]``.
        devices: one device string per rank.
        batch_size: the full batch, rows.
        num_microbatches: m when fixed, else None.
        microbatch_candidates: the m values the solver may choose from (None when fixed).
        training: profiled forward + backward (True) or forward only.
        split_backward_factor: a multiplicative charge on zero-bubble's I and W
            (``SolveOptions.split_backward_factor``): 1.0, as the split's cost is measured
            per node (``split_backward_us_per_node``).
        timings_s: seconds spent in ``capture_s``, ``profile_s``, ``loss_cost_s``,
            ``batch_points_s``, ``split_cost_s`` and ``link_s`` (with the runtime's cost per
            transfer, for the distributed runtime; a phase read from the cache counts the
            reading).
        from_cache: the phases read from the profile cache: ``"profile"``,
            ``"split_cost"``, and where m is left open ``"low_batch_profile"``,
            ``"high_batch_times"`` and, where more microbatches were measured
            (:func:`scaled_batch_points`), ``"scaled_batch_times"`` (empty when the cache was
            off or missed).
        host_link: the link between CPU ranks, measured when two or more ranks are ``cpu``
            (they run as gloo processes on this host), else None (device presets).
        split_backward_us_per_node: what zero-bubble's I/W split adds per node with a
            backward, per microbatch, µs, measured at the smallest microbatch the plan may
            use (0.0 when not measured: inference, one rank, or zero_bubble excluded).
        split_backward_points: ``(rows, µs per node)``: that cost measured at each
            microbatch size whose segments were timed (the two batch points and the scaled
            ones), where m is left to the solver (``SolveOptions.split_backward_points``);
            empty with m fixed, where the one figure above applies.
        transfer_overhead_us: what the distributed runtime spends on each transfer between
            ranks beside the link time, µs, measured on this host when the profile is for
            that runtime on two or more ``cpu`` ranks (:func:`host_figures`); else 0.0.
        co_runners: forked copies of the process that ran the model beside the segment
            calibration, as the host's other ranks will (:mod:`autopart.profiler.corunners`;
            0: timed alone).
    """

    captured: CapturedGraph
    costs: CostGraph
    devices: tuple[str, ...]
    batch_size: int
    num_microbatches: int | None
    microbatch_candidates: tuple[int, ...] | None
    training: bool
    split_backward_factor: float
    timings_s: dict[str, float]
    from_cache: frozenset[str] = frozenset()
    host_link: LinkFigures | None = None
    split_backward_us_per_node: float = 0.0
    transfer_overhead_us: float = 0.0
    co_runners: int = 0
    split_backward_points: tuple[tuple[int, float], ...] = ()

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
            library_versions=library_versions(), split_backward_factor=self.split_backward_factor,
            split_backward_us_per_node=self.split_backward_us_per_node,
            split_backward_points=self.split_backward_points,
            transfer_overhead_us=self.transfer_overhead_us)
        if choices.get("num_microbatches") is not None:  # one m of the profiled candidates
            base["microbatch_candidates"] = None
        return SolveOptions(**{**base, **choices})

    def solve(self, **choices: Any) -> Plan:
        """Solve on this profile's costs for its devices; ``choices`` as in :meth:`options`.

        Raises:
            InfeasiblePlanError: nothing fits the devices' memory or the stage count.
            PlanError: contradictory choices.
        """
        return solve(self.costs, self.cluster(), self.options(**choices))


def profile_model(model: nn.Module, example_inputs: tuple[Any, ...] = (), *,
                  example_kwargs: dict[str, Any] | None = None,
                  devices: list[str] | tuple[str, ...], num_microbatches: int | None = None,
                  training: bool = True, split_cost: bool = True, loss_fn: Any = None,
                  example_target: Any = None, cache: bool | None = None,
                  low_batch: bool = True, runtime: str = "local") -> Profile:
    """Capture ``model`` and measure every node's cost on ``devices[0]``.

    With ``num_microbatches`` the model is captured and profiled at the microbatch size, so
    the same capture serves code generation. Otherwise it is captured at the full batch and
    the solver picks m among the divisors that leave microbatches of at least 2 rows
    (export specialises size-1 dimensions, which can change the graph). With ``split_cost``
    (and training on more than one rank) what zero-bubble's I/W split adds per node is
    measured too, as ``runtime`` (``"local"``, default, or ``"distributed"``) splits a
    backward (:func:`autopart.profiler.split_cost.measure_split_backward_overhead`): at the
    microbatch profiled when m is fixed, else at each microbatch size whose segments are
    timed (the two batch points and the scaled ones below; ``split_backward_points``), as
    the cost grows with the rows. With ``loss_fn``
    (training) the loss's own cost is added to the graph's last node: measured on
    ``example_target`` (the full batch's target) when given, else estimated as a
    cross-entropy over the outputs, timed on ``devices[0]`` (untimed for a ``meta`` model;
    :func:`autopart.loss_cost.estimate_loss_cost`). With two or more ``cpu`` ranks (gloo
    processes on this host) the link between them is timed once per process and cached per machine
    (:func:`autopart.profiler.links.host_link`, about 3 s), so sends cost what they cost here
    (the preset's nominal figures, with a warning, when it cannot be timed). For the
    ``"distributed"`` runtime on two or more ``cpu`` ranks, the runtime's own cost per transfer
    between ranks is measured with the link, in the same two processes, once per machine and
    cached too (:func:`host_figures`, about 5 s with the link).

    When m is left to the solver and ``low_batch`` (default True), node times come from two
    more profiles: the model captured and profiled at the smallest microbatch the solver may
    choose and at the one of m = twice the rank count (or, for few candidates, m = the rank
    count), each rescaled segment by segment: the graph is cut at candidates into 8
    segments of nearly equal profiled time, run in sequence as the runtimes run stages, and
    each segment's nodes are scaled to add up to its forward and backward
    (:func:`autopart.profiler.calibrate.segment_times`); one factor for the whole graph
    left the fidelity benchmark's GPT-2 head 15 % over and its blocks 3-8 % under at 2
    rows. The loss is measured at those two microbatches instead of the full batch (whose
    logits may not fit any cache: the demo's 16k-vocabulary loss cost 14x more per row at
    the full batch). Each node's time at a microbatch is then read off the line through its two points
    (:func:`autopart.core.costgraph.through_two_batches`; ``timings_s["batch_points_s"]``),
    except at the other candidates of at least twice the rank count microbatches
    (:func:`scaled_batch_points`), whose segments are timed the same way: there each
    segment's nodes take the measured-over-line factor (``CostGraph.batch_scales``).
    The full batch's profile keeps the bytes. A graph that differs at those batches keeps the
    one profile, scaled.
    With ``num_microbatches`` fixed, for the ``"distributed"`` runtime on two or more ranks
    (and ``low_batch``), the microbatch's profile is calibrated the same way, segment by
    segment, beside the co-runners, and cached apart: a torchrun launch with a fixed m has
    no other calibration.

    With ``cache`` (default: on unless ``$AUTOPART_CACHE`` is ``0``/``off``) the costs and the
    split's per-node cost are read from the profile cache (:mod:`autopart.profiler.cache`,
    ``$AUTOPART_CACHE_DIR``, else ``~/.cache/autopart``) when they were measured before for
    the same graph fingerprint, device (a CPU's model and thread count, a GPU's name),
    input shapes, dtype and library versions, and stored there otherwise. So a second
    launch of the same job solves on the same costs and gets the same plan; measured op
    times move by several per cent between launches, enough to change cuts and schedule.

    Raises:
        PlanError: ``num_microbatches`` does not divide the batch, or no batched input.
        TraceError: the model cannot be captured.
        ProfileError: a node fails to run on the device.
    """
    kwargs = dict(example_kwargs or {})
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    batch = batch_size(args, kwargs)
    if num_microbatches is not None:
        if num_microbatches < 1 or batch % num_microbatches:
            raise PlanError(f"num_microbatches={num_microbatches} must be >= 1 and divide the batch of "
                            f"{batch}; choose one of "
                            f"{[d for d in range(1, batch + 1) if batch % d == 0]}")
        args, kwargs = microbatch_inputs(args, kwargs, num_microbatches)
        candidates = None
    else:
        candidates = tuple(m for m in range(1, batch + 1)
                           if batch % m == 0 and (batch // m >= 2 or batch == 1))
    # measure with the allocator the CPU runtimes use; the cache key says which it was
    malloc = tune_cpu_allocator() if torch.device(devices[0]).type == "cpu" else None
    captured = capture(model, args, kwargs)
    timings["capture_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    flat = captured.flatten_inputs(args, kwargs)
    use_cache = cache_enabled() if cache is None else cache
    # the distributed runtime's CPU ranks on this host compute at once: calibrate beside
    # that many copies of this process running the model (autopart.profiler.corunners)
    neighbours = (min(len(devices) - 1, (os.cpu_count() or 1) - 1)
                  if runtime == "distributed" and training and len(devices) > 1
                  and all(torch.device(d).type == "cpu" for d in devices)
                  and corunners_available() else 0)
    # m fixed, several ranks of the distributed runtime: the microbatch's profile is
    # calibrated segment by segment as the two-point path calibrates its profiles
    calibrate_fixed = (num_microbatches is not None and low_batch and training
                       and runtime == "distributed" and len(devices) > 1)
    method = _PROFILE_METHOD + (",cpu-malloc=kept" if malloc else "")
    key = profile_key(captured.fingerprint, devices[0], flat, dtype=_dtype_name(model),
                      training=training, method=method + (
                          _calibration_suffix(neighbours) if calibrate_fixed else ""))
    hits: set[str] = set()

    def measure() -> CostGraph:
        measured = profile_graph(captured, flat, device=devices[0], training=training)
        if not calibrate_fixed:
            return measured
        try:
            return _segment_calibrated(measured, captured, flat, devices[0], neighbours)
        except PlanError:  # a segment the stage builder cannot cut: the per-node profile
            return measured  # (as the two-point path falls back to one profile)

    costs = _cached_or_measured(key, measure, use_cache, hits, "profile")
    timings["profile_s"] = time.perf_counter() - t0

    measured_loss = (training and loss_fn is not None and example_target is not None
                     and not launch_on_meta(model))

    def loss_at(cap: CapturedGraph, m: int | None) -> LossCost | None:
        """The loss's cost at the batch ``cap`` was captured at (``m`` microbatches)."""
        if not (training and loss_fn is not None):
            return None
        if not measured_loss:  # timed as a cross-entropy on a materialised model
            return estimate_loss_cost(cap, None if launch_on_meta(model) else devices[0])
        target = example_target if m is None else InputSignature.split_target(
            example_target, m)[0]
        return measure_loss_cost(cap, loss_fn, target, devices[0])

    points = batch_points(batch, candidates, len(devices)) if low_batch else None
    two_point: CostGraph | None = None
    smallest: tuple[CapturedGraph, list[Any], CostGraph] | None = None
    scaled: tuple[int, ...] = ()
    captures: dict[int, tuple[CapturedGraph, list[Any]]] = {}  # by m, as the points made them
    if points is not None:
        # node and loss times from two smaller microbatches; the full batch keeps the bytes
        t0 = time.perf_counter()
        scaled = scaled_batch_points(batch, candidates, len(devices), points)
        with contextlib.suppress(PlanError):  # a batch-dependent graph: one point, scaled
            two_point, smallest = _two_point_costs(
                model, args, kwargs, points, batch, costs, loss_at, devices[0], training, key,
                use_cache, hits, method, neighbours, measured_loss, scaled, captures)
        timings["batch_points_s"] = time.perf_counter() - t0
    if two_point is not None:
        costs = two_point
    elif training and loss_fn is not None:
        t0 = time.perf_counter()
        loss = _cached_loss(key, f"@m{num_microbatches}{_loss_tag(measured_loss)}",
                            lambda: loss_at(captured, num_microbatches),
                            _loss_source(devices[0], measured_loss), use_cache)
        assert loss is not None
        costs = with_loss_cost(costs, loss)
        timings["loss_cost_s"] = time.perf_counter() - t0
    split_us = 0.0
    split_points: tuple[tuple[int, float], ...] = ()
    if split_cost and training and len(devices) > 1:
        t0 = time.perf_counter()
        split_name = _SPLIT_OVERHEAD + ("" if runtime == "local" else f":{runtime}")
        if smallest is None or points is None:  # m fixed (or one point): the profiled graph
            split_us = _split_cost_cached(key, split_name, lambda: (captured, flat, costs),
                                          devices[0], runtime, use_cache, hits) or 0.0
        else:  # at each microbatch size the segments were timed at, smallest first
            got = []
            for m in sorted({*points, *scaled}, reverse=True):
                us = _split_cost_cached(
                    key, f"{split_name}@{batch // m}",
                    functools.partial(_split_piece, model, args, kwargs, m, batch, smallest,
                                      captures), devices[0], runtime, use_cache, hits)
                if us is not None:
                    got.append((batch // m, us))
            split_points = tuple(got)
            split_us = got[0][1] if got else 0.0
        timings["split_cost_s"] = time.perf_counter() - t0
    link, overhead = None, 0.0
    if len(devices) > 1 and all(torch.device(d).type == "cpu" for d in devices):
        t0 = time.perf_counter()
        if runtime == "distributed" and training:
            link, overhead = host_figures(use_cache)
        else:
            link = host_link(use_cache)
        timings["link_s"] = time.perf_counter() - t0
    return Profile(captured, costs, tuple(devices), batch, num_microbatches, candidates, training,
                   1.0, timings, frozenset(hits), link, split_us, overhead, neighbours,
                   split_points)


def measure_host_figures(use_cache: bool = True) -> tuple[LinkFigures, float]:
    """The link between two gloo processes on this host and the distributed runtime's cost per
    transfer between them, measured in one pair of processes
    (:func:`autopart.runtime_overhead.run_tiny_pipeline`, about 5 s): the link as
    :func:`autopart.profiler.links.measure_host_link` times it, then the 1F1B plan of
    :func:`autopart.runtime_overhead.workload` (negligible compute) with 16 microbatches on
    two ``cpu`` ranks, run for its median step; the cost per transfer is the one at which the
    cost model's replay of that plan, with that link, takes that step
    (:func:`autopart.runtime_overhead.fit_transfer_overhead`). The plan is made before the
    processes start (profiled beside them, the tiny model's nodes measured up to twice as
    slow and the fit came out 0.2-0.3 ms low); ``use_cache``: with the profile cache or
    without.

    Returns:
        ``(link, µs per transfer)``.

    Raises:
        ProfileError: the two processes failed, or their times do not fit a link.
    """
    model, x, y, loss_fn = _overhead_workload()
    profile = profile_model(model, (x,), devices=["cpu"], num_microbatches=_OVERHEAD_M,
                            loss_fn=loss_fn, example_target=y, cache=use_cache)
    options = profile.options(schedule_kind="1f1b", stages_per_rank=1,
                              receive_buffers_per_microbatch=True)
    # the cut of a chain of equal layers does not depend on the link: the preset's will do
    plan = solve(profile.costs, cluster_for_devices(["cpu", "cpu"]), options)
    with tempfile.TemporaryDirectory(prefix="autopart-plan-") as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        plan.save(plan_path)
        steps, one_way = run_tiny_pipeline(plan_path)
    link = fit_link(LINK_SIZES, tuple(one_way))
    cluster = cluster_for_devices(["cpu", "cpu"], link)
    overhead = fit_transfer_overhead(lambda a: predict_plan(
        plan, profile.costs, cluster,
        dataclasses.replace(options, transfer_overhead_us=a)).step_time_us,
        statistics.median(steps) * 1e6)
    return link, overhead


@functools.lru_cache(maxsize=1)
def host_figures(use_cache: bool = True) -> tuple[LinkFigures | None, float]:
    """This host's link between CPU ranks and the distributed runtime's cost per transfer
    (µs), for profiles of that runtime: read from the profile cache per machine
    (:func:`autopart.profiler.links.cached_host_link`,
    :func:`autopart.runtime_overhead.cached_transfer_overhead`) where both are there, else
    measured together once per process (:func:`measure_host_figures`) and stored; a
    figure already cached is kept. Measured while the machine is oversubscribed
    (:func:`autopart.profiler.cache.machine_busy`), they are used but not stored. When they
    cannot be measured: a ``RuntimeWarning``, the link timed alone
    (:func:`autopart.profiler.links.host_link`) and no cost per transfer."""
    link = cached_host_link() if use_cache else None
    overhead = cached_transfer_overhead() if use_cache else None
    if link is not None and overhead is not None:
        return link, overhead
    busy = machine_busy()
    try:
        link_now, overhead_now = measure_host_figures(use_cache)
    except ProfileError as exc:
        warnings.warn(f"{exc}; planning with no per-transfer cost of the runtime",
                      RuntimeWarning, stacklevel=2)
        return (link if link is not None else host_link(use_cache)), overhead or 0.0
    if use_cache and busy is None and machine_busy() is None:
        if link is None:
            store_host_link(link_now)
        if overhead is None:
            store_transfer_overhead(overhead_now)
    return (link if link is not None else link_now,
            overhead if overhead is not None else overhead_now)


#: What ``profile_model`` measures with; part of the cache key, so a change re-profiles.
_PROFILE_METHOD = ("measured:profile_graph(warmup=1,repeats=3,long_call_us=50000,"
                   "long=min-of-2-after-warm,backward-peak)")


def _cached_or_measured(key: dict[str, Any], measure: Any, use_cache: bool, hits: set[str],
                        phase: str) -> CostGraph:
    """``measure()``'s CostGraph, read from (and stored in) the profile cache under ``key``
    when ``use_cache``; ``phase`` goes into ``hits`` when it was read."""
    if not use_cache:
        return measure()
    costs, hit = cached_profile(key, measure)
    if hit:
        hits.add(phase)
    return costs


def _two_point_costs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     points: tuple[int, int], batch: int, unlossed: CostGraph,
                     loss_at: Any, device: str, training: bool, key: dict[str, Any],
                     use_cache: bool, hits: set[str], method: str, neighbours: int = 0,
                     measured_loss: bool = True, scaled: tuple[int, ...] = (),
                     captures: dict[int, tuple[CapturedGraph, list[Any]]] | None = None,
                     ) -> tuple[CostGraph, tuple[CapturedGraph, list[Any], CostGraph]]:
    """The full batch's costs with node and loss times from two smaller batches (see
    :func:`profile_model`): at the smallest microbatch (``points[0]`` microbatches) a
    profile calibrated to its whole graph, cached like a profile; at the larger one
    (``points[1]``) the full batch's node shares calibrated to that graph's whole forward
    and backward, cached as numbers on the full batch's profile. The loss (``loss_at(captured,
    m)``, None without one) is measured at both microbatches: the line through them gives
    its time at the full batch, and its bytes there are the larger microbatch's, scaled.
    With ``neighbours``, the segments are timed while that many copies of this process run
    the model at the same microbatch (:func:`autopart.profiler.corunners.co_runners`), as
    the other ranks of the host will; such figures are cached apart. (The loss is timed
    alone: right after the fork its 1-4 ms calls measured 70-130 % slower, more than the
    20 % the fidelity GPT-2's pipeline showed.)
    ``measured_loss``: ``loss_at`` measures the user's loss (else it times the cross-entropy
    stand-in, whose figures are cached under their own names, :func:`_loss_tag`).
    ``scaled``: more microbatch counts (:func:`scaled_batch_points`) whose segments are timed
    as the larger point's are, beside the same co-runners, each giving the line a
    :class:`~autopart.core.costgraph.BatchScale` (cached as numbers on the full batch's
    profile too); the loss stays on its line there.
    ``captures``: filled with ``m -> (capture, flat inputs)`` for each microbatch count
    captured here (the split's cost is timed on them, :func:`_split_piece`).

    Returns:
        The costs, and the smallest microbatch's capture, flat inputs and profile.

    Raises:
        PlanError: a graph captured at another batch differs (node count, names, ops).
    """
    m_low, m_high = points
    low_args, low_kwargs = microbatch_inputs(args, kwargs, m_low)
    low_captured = capture(model, low_args, low_kwargs)
    low_flat = low_captured.flatten_inputs(low_args, low_kwargs)
    made = captures if captures is not None else {}
    made[m_low] = (low_captured, low_flat)

    calibration = _calibration_suffix(neighbours)
    loss_tag = _loss_tag(measured_loss)

    def measure_low() -> CostGraph:
        low = profile_graph(low_captured, low_flat, device=device, training=training)
        return _segment_calibrated(low, low_captured, low_flat, device, neighbours)

    low_key = profile_key(low_captured.fingerprint, device, low_flat, dtype=_dtype_name(model),
                          training=training, method=method + calibration)
    low = _cached_or_measured(low_key, measure_low, use_cache, hits, "low_batch_profile")
    b_low, b_high = batch // m_low, batch // m_high
    loss_low = _cached_loss(key, f"@{b_low}{calibration}{loss_tag}",
                            lambda: loss_at(low_captured, m_low),
                            _loss_source(device, measured_loss), use_cache)
    cuts = _calibration_cuts(unlossed)
    fields = ("loss_fwd_us", "loss_bwd_us", "loss_saved_bytes", "loss_transient_bytes",
              *(f"segment{k}_{f}" for k in range(len(cuts) + 1) for f in ("fwd_us", "bwd_us")))
    names = [f"{f}@{b_high}{calibration}{loss_tag if f.startswith('loss_') else ''}"
             for f in fields]
    cached = [load_measure(key, n) for n in names] if use_cache else [None] * len(names)
    if all(v is not None for v in cached):
        values = [float(v) for v in cached if v is not None]
        hits.add("high_batch_times")
    else:
        high_captured, times = _segments_at(model, args, kwargs, m_high, device, cuts,
                                            neighbours, captures=made)
        assert times is not None
        loss_high = loss_at(high_captured, m_high)
        values = ([0.0] * 4 if loss_high is None else [
            loss_high.fwd_us, loss_high.bwd_us, float(loss_high.saved_bytes),
            float(loss_high.transient_bytes)]) + [t for pair in times for t in pair]
        if use_cache:
            for n, v in zip(names, values, strict=True):
                store_measure(key, n, v)
    seg = values[4:]
    high = dataclasses.replace(calibrate_to_segments(unlossed, cuts, list(zip(
        seg[0::2], seg[1::2], strict=True))), batch_size=b_high)
    if loss_low is not None:
        loss_high = LossCost(values[0], values[1], int(values[2]), int(values[3]),
                             loss_low.source)

        def at_full(t_low: float, t_high: float) -> float:
            return time_on_line(t_low, t_high, b_low, b_high, batch)

        scale = batch / b_high
        loss_full = LossCost(at_full(loss_low.fwd_us, loss_high.fwd_us),
                             at_full(loss_low.bwd_us, loss_high.bwd_us),
                             math.ceil(loss_high.saved_bytes * scale),
                             math.ceil(loss_high.transient_bytes * scale), loss_low.source)
        unlossed = with_loss_cost(unlossed, loss_full)
        low = with_loss_cost(low, loss_low)
        high = with_loss_cost(high, loss_high)
    line = through_two_batches(unlossed, low, high)
    scales = []
    for m in scaled:
        rows = batch // m
        names = [f"segment{k}_{f}@{rows}{calibration}" for k in range(len(cuts) + 1)
                 for f in ("fwd_us", "bwd_us")]
        got = [load_measure(key, n) for n in names] if use_cache else [None] * len(names)
        if all(v is not None for v in got):
            seg = [float(v) for v in got if v is not None]
            hits.add("scaled_batch_times")
        else:
            try:
                _, m_times = _segments_at(model, args, kwargs, m, device, cuts, neighbours,
                                          same_as=low_captured, captures=made)
            except PlanError:  # a segment the stage builder cannot cut there: the line
                continue
            if m_times is None:
                continue  # a batch-dependent graph at this size: the line there
            seg = [t for pair in m_times for t in pair]
            if use_cache:
                for n, v in zip(names, seg, strict=True):
                    store_measure(key, n, v)
        loss_m = ((0.0, 0.0) if loss_low is None else (
            time_on_line(loss_low.fwd_us, values[0], b_low, b_high, rows),
            time_on_line(loss_low.bwd_us, values[1], b_low, b_high, rows)))
        scales.append(segment_scales(line, rows, cuts, list(zip(seg[0::2], seg[1::2], strict=True)),
                                     loss_m))
    return (dataclasses.replace(line, batch_scales=tuple(scales)),
            (low_captured, low_flat, low))


def _segments_at(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], m: int,
                 device: str, cuts: tuple[int, ...], neighbours: int,
                 same_as: CapturedGraph | None = None,
                 captures: dict[int, tuple[CapturedGraph, list[Any]]] | None = None,
                 ) -> tuple[CapturedGraph, list[tuple[float, float]] | None]:
    """The model captured at ``m`` microbatches and its segments (cut at ``cuts``) timed
    there beside ``neighbours`` co-runners (:func:`segment_times`); None for the times when
    ``same_as`` is given and the capture's ops differ from it. ``captures`` (when given)
    keeps ``m -> (capture, flat inputs)``.

    Raises:
        PlanError: a segment cannot be cut at that batch.
    """
    m_args, m_kwargs = microbatch_inputs(args, kwargs, m)
    captured = capture(model, m_args, m_kwargs)
    flat = captured.flatten_inputs(m_args, m_kwargs)
    if captures is not None:  # kept even where the ops differ: no second capture to find out
        captures[m] = (captured, flat)
    if same_as is not None and _ops(captured) != _ops(same_as):
        return captured, None
    with co_runners(corunner_step(captured, flat), neighbours):
        return captured, segment_times(captured, flat, device, cuts)


def _ops(captured: CapturedGraph) -> list[tuple[str, str]]:
    """The op nodes of a capture, as ``(name, target)`` in order: what pairs two captures'
    times node by node."""
    return [(n.name, str(n.target)) for n in captured.graph_module.graph.nodes
            if n.op == "call_function"]


def _calibration_suffix(neighbours: int) -> str:
    """What a segment calibration beside ``neighbours`` co-runners adds to a cache key."""
    return _CALIBRATION + (f",co-runners={neighbours}" if neighbours else "")


def _segment_calibrated(costs: CostGraph, captured: CapturedGraph, flat: list[Any],
                        device: str, neighbours: int) -> CostGraph:
    """``costs`` (``captured``'s profile on ``flat``) with each calibration segment's nodes
    scaled to the segment's forward and backward timed in sequence
    (:func:`autopart.profiler.calibrate.segment_times`), beside ``neighbours`` copies of this
    process running the same graph (:func:`autopart.profiler.corunners.co_runners`)."""
    cuts = _calibration_cuts(costs)
    with co_runners(corunner_step(captured, flat), neighbours):
        times = segment_times(captured, flat, device, cuts)
    return calibrate_to_segments(costs, cuts, times)


def _loss_source(device: str, measured: bool) -> str:
    """The :class:`LossCost` source of a loss timed on ``device``: the user's loss
    (``measured``) or the cross-entropy stand-in (:func:`estimate_loss_cost`)."""
    dev = torch.device(device)
    return f"measured:{dev}" if measured else f"estimated:cross-entropy:{dev}"


def _loss_tag(measured: bool) -> str:
    """What a loss timed as the cross-entropy stand-in adds to its figures' cache names, so
    that they never stand in for the user's loss measured later, nor the other way round."""
    return "" if measured else ",loss=estimated-cross-entropy"


def _cached_loss(key: dict[str, Any], suffix: str, measure: Any, source: str,
                 use_cache: bool) -> LossCost | None:
    """``measure()``'s :class:`LossCost` (None: no loss), a timed one (measured, or the
    estimate's stand-in) read from (and stored in) the profile cache as numbers
    ``loss_<field><suffix>`` on ``key``'s profile, so a second launch plans on the loss cost
    of the first (re-measured, it moved the plan's predicted step by 1 % and its cuts
    between two launches). ``source`` labels a cached one."""
    fields = ("fwd_us", "bwd_us", "saved_bytes", "transient_bytes")
    names = [f"loss_{f}{suffix}" for f in fields]
    cached = [load_measure(key, n) for n in names] if use_cache else [None]
    if all(v is not None for v in cached):
        fwd, bwd, saved, transient = (float(v) for v in cached if v is not None)
        return LossCost(fwd, bwd, int(saved), int(transient), source)
    loss = measure()
    if loss is not None and use_cache and loss.source != "estimated":
        for n, v in zip(names, (loss.fwd_us, loss.bwd_us, loss.saved_bytes,
                                loss.transient_bytes), strict=True):
            store_measure(key, n, v)
    return loss


def _calibration_cuts(costs: CostGraph) -> tuple[int, ...]:
    """Where a profile is cut for its calibration: up to :data:`_CALIBRATION_SEGMENTS`
    segments of nearly equal profiled time, at cut candidates
    (:func:`autopart.profiler.calibrate.segment_cuts`)."""
    return segment_cuts(costs, find_candidates(costs, 3).positions, _CALIBRATION_SEGMENTS)


#: Segments a profile is calibrated in: their times in sequence, as stages run, set the
#: shares of the profile's nodes in each (see profile_model).
_CALIBRATION_SEGMENTS = 8

#: How the two batch points are measured on top of ``_PROFILE_METHOD`` (cache key).
_CALIBRATION = ",segment-calibrated-v2"


def batch_points(batch: int, candidates: tuple[int, ...] | None,
                  num_ranks: int) -> tuple[int, int] | None:
    """The two microbatch counts profiled beside the full batch: the largest candidate
    (smallest microbatch) and the smallest candidate >= ``2 x num_ranks`` (where pipelines
    usually run: the microbatch at m = ranks is the line's extrapolation), or failing that
    >= ``num_ranks``; None when m is fixed or the two microbatches are not both smaller
    than the batch and different."""
    if not candidates:
        return None
    m_low = max(candidates)
    for least in (2 * max(num_ranks, 1), max(num_ranks, 2)):
        m_high = min((m for m in candidates if m >= least), default=m_low)
        if batch // m_low < batch // m_high < batch:
            return m_low, m_high
    return None


def scaled_batch_points(batch: int, candidates: tuple[int, ...] | None, num_ranks: int,
                        points: tuple[int, int], *, most: int = 4) -> tuple[int, ...]:
    """The microbatch counts measured segment by segment beside the two batch points
    (:func:`batch_points`), so that the solver reads measured times there instead of the
    line's: the candidates of at least twice the ranks' microbatches (where pipelines run, as
    :func:`batch_points` chooses its larger point), other than the two points, at most
    ``most`` (default 4) of them, the ones nearest the larger point in ``log m``; ascending.
    Empty when m is fixed. (Each costs a capture and a timed forward and backward: the demo's
    planning took 5.6 s longer with its m = 2 = the ranks measured too.)"""
    if not candidates:
        return ()
    m_high = points[1]
    extra = [m for m in candidates if m >= 2 * max(num_ranks, 1) and m not in points
             and batch // m < batch]
    extra.sort(key=lambda m: (abs(math.log(m / m_high)), m))
    return tuple(sorted(extra[:most]))


#: The split's per-node cost's name in the cache, with the revision of its measurement.
_SPLIT_OVERHEAD = "split_backward_us_per_node:flushed-mad-v6"


def _split_cost_cached(key: dict[str, Any], name: str,
                       piece: Callable[[], tuple[CapturedGraph, list[Any], CostGraph] | None],
                       device: str, runtime: str, use_cache: bool,
                       hits: set[str]) -> float | None:
    """The split's per-node cost, µs, read from the profile cache as the number ``name`` on
    ``key``'s profile, or else measured on what ``piece()`` returns (capture, flat inputs,
    profile; called only on a miss, since making it may capture the model) with
    :func:`autopart.profiler.split_cost.measure_split_backward_overhead` and stored; None
    where ``piece()`` gives None. ``"split_cost"`` goes into ``hits`` when read."""
    cached = load_measure(key, name) if use_cache else None
    if cached is not None:
        hits.add("split_cost")
        return float(cached)
    made = piece()
    if made is None:
        return None
    us = measure_split_backward_overhead(*made, device, find_candidates(made[2], 3).positions,
                                         runtime=runtime)
    if use_cache:
        store_measure(key, name, us)
    return float(us)


def _split_piece(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], m: int,
                 batch: int, smallest: tuple[CapturedGraph, list[Any], CostGraph],
                 captures: dict[int, tuple[CapturedGraph, list[Any]]],
                 ) -> tuple[CapturedGraph, list[Any], CostGraph] | None:
    """What the split's cost is timed on at ``m`` microbatches: the capture there (made by
    the batch points, in ``captures``, else made now) with the smallest microbatch's profile,
    its saved bytes scaled to the rows (the piece's cuts follow the profile's time shares, the
    cache flush its bytes); None where the graph's ops differ from the smallest's.

    Raises:
        TraceError: the model cannot be captured at that batch (it was at the others)."""
    low_captured, _, low_costs = smallest
    if m not in captures:
        m_args, m_kwargs = microbatch_inputs(args, kwargs, m)
        cap = capture(model, m_args, m_kwargs)
        captures[m] = (cap, cap.flatten_inputs(m_args, m_kwargs))
    cap, flat = captures[m]
    if cap is not low_captured and _ops(cap) != _ops(low_captured):
        return None
    k = (batch // m) / low_costs.batch_size
    costs = dataclasses.replace(low_costs, nodes=tuple(
        dataclasses.replace(nd, saved_bytes=math.ceil(nd.saved_bytes * k))
        for nd in low_costs.nodes))
    return cap, flat, costs


def _dtype_name(model: nn.Module) -> str:
    """The dtype of the model's first floating-point parameter (``"float32"`` if none)."""
    return next((str(p.dtype).removeprefix("torch.") for p in model.parameters()
                 if p.is_floating_point()), "float32")


def plan_model(model: nn.Module, example_inputs: tuple[Any, ...] = (), *,
               example_kwargs: dict[str, Any] | None = None,
               devices: list[str] | tuple[str, ...] | None = None,
               num_stages: int | None = None, num_microbatches: int | None = None,
               optimize: str = "speed", schedule: str | None = None,
               stages_per_rank: int | None = None, recompute: bool | None = None,
               training: bool = True, time_limit_s: float = 10.0, loss_fn: Any = None,
               example_target: Any = None, cache: bool | None = None,
               runtime: str = "local", **solve_options: Any) -> tuple[Plan, Profile]:
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
        schedule: schedule kind, or None (the solver chooses).
        stages_per_rank: v, or None (the solver chooses).
        recompute: every stage, none, or None (the solver decides per stage).
        training: plan forward + backward (default) or inference.
        time_limit_s: CP-SAT limit per solve, seconds (default 10).
        loss_fn, example_target: the loss and a target for the full batch; the loss's cost
            on the last stage is measured with them (estimated without a target), see
            :func:`profile_model`.
        cache: read and store the costs in the profile cache (:func:`profile_model`);
            None (default): on unless ``$AUTOPART_CACHE`` is ``0``/``off``.
        runtime: the runtime the plan is for, ``"local"`` (default) or ``"distributed"``:
            whose backward split is timed (:func:`profile_model`), and with
            ``"distributed"`` ``receive_buffers_per_microbatch`` defaults to True (torch's
            stages receive into one buffer per microbatch).
        **solve_options: further :class:`autopart.solver.SolveOptions` fields
            (``memory_cap_bytes``, ``optimizer_state_bytes_per_param_byte``, ...).

    Returns:
        The plan, and the profile it was solved on.

    Raises:
        PlanError: inconsistent stage, device or microbatch counts.
        TraceError, ProfileError: capture or profiling failed.
        InfeasiblePlanError: no plan fits.
    """
    device_names, v = _ranks_and_v(devices, num_stages, stages_per_rank)
    fixed = {k: val for k, val in (("schedule_kind", schedule), ("stages_per_rank", v),
                                   ("recompute", recompute)) if val is not None}
    # the split cost matters only where the solver may still pick zero_bubble (v = 1)
    may_split = (fixed.get("stages_per_rank", 1) == 1
                 and fixed.get("schedule_kind", "zero_bubble") == "zero_bubble")
    if runtime == "distributed":
        solve_options.setdefault("receive_buffers_per_microbatch", True)
    profile = profile_model(model, example_inputs, example_kwargs=example_kwargs,
                            devices=device_names, num_microbatches=num_microbatches,
                            training=training, split_cost=may_split, loss_fn=loss_fn,
                            example_target=example_target, cache=cache, runtime=runtime)
    t0 = time.perf_counter()
    plan = profile.solve(optimize=optimize, time_limit_s=time_limit_s, **fixed, **solve_options)
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
