"""profile_model: measure one model on one set of devices, once, as the solver needs it."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from autopart.core.capture import CapturedGraph, capture
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.progress import phase
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.signature import batch_size, microbatch_inputs
from autopart.profiler import profile_state as _profile_state
from autopart.profiler._state import kept_state
from autopart.profiler.batch_points import (
    batch_points,
    calibration_suffix,
    same_ops,
    scaled_batch_points,
    segment_calibrated,
    two_point_costs,
)
from autopart.profiler.corunners import available as corunners_available
from autopart.profiler.corunners import model_step as corunner_step
from autopart.profiler.corunners import time_sharing_factor, usable_cores
from autopart.profiler.loss_cost import (
    with_loss_cost,
)
from autopart.profiler.profile_state import (
    PROFILE_METHOD,
    SELECTIVE_OVERHEAD,
    SPLIT_OVERHEAD,
    TIME_SHARING,
    ModelProfile,
    ProfileOptions,
    Session,
)
from autopart.profiler.selective_cost import measure_selective_overhead
from autopart.profiler.split_cost import SplitEngine, measure_split_backward_overhead

__all__ = ["ProfileOptions", "ModelProfile", "profile_model", "PROFILE_METHOD"]


def profile_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  options: ProfileOptions) -> ModelProfile:
    """Capture ``model`` on ``(args, kwargs)`` (the full batch) and measure every node's cost
    on ``options.devices[0]``; with the loss's cost, the two batch points where m is open,
    and the runtime's split cost (what each phase times and caches: docs/design.md, "Cost
    model the solver optimises").

    Raises:
        PlanError: ``num_microbatches`` does not divide the batch, or no batched input.
        TraceError: the model cannot be captured.
        ProfileError: a node fails to run on the device.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    batch = batch_size(args, kwargs)
    m_fixed = options.num_microbatches
    if m_fixed is not None:
        if m_fixed < 1 or batch % m_fixed:
            raise PlanError(f"num_microbatches={m_fixed} must be >= 1 and divide the batch of "
                            f"{batch}; choose one of "
                            f"{[d for d in range(1, batch + 1) if batch % d == 0]}")
        args, kwargs = microbatch_inputs(args, kwargs, m_fixed)
        candidates = None
    else:
        candidates = tuple(m for m in range(1, batch + 1)
                           if batch % m == 0 and (batch // m >= 2 or batch == 1))
    session = Session(model, args, kwargs, options, batch)
    with phase("capture"):
        captured = capture(model, args, kwargs)
    timings["capture_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    flat = captured.flatten_inputs(args, kwargs)
    ranks = len(options.devices)
    points = batch_points(batch, candidates, ranks) if options.low_batch else None
    # m fixed, several ranks that are processes or a CUDA device (whose host issue times are
    # scaled to the segments' as well): the microbatch's profile is calibrated segment by
    # segment as the two-point path calibrates its profiles; and always when the stages run
    # compiled, unless the batch points (calibrated) replace it
    on_cuda = torch.device(session.device).type == "cuda"
    calibrate_fixed = (m_fixed is not None and options.low_batch and options.training
                       and (options.runtime.ranks_are_processes or on_cuda) and ranks > 1)
    calibrate = calibrate_fixed or (options.fuse and (m_fixed is not None or points is None))
    session.key = session.profile_key(captured, flat, session.method + (
        calibration_suffix(session.neighbours, options.fuse) if calibrate else ""))

    def measure() -> CostGraph:
        measured = session.profile(captured, flat)
        if not calibrate:
            return measured
        try:
            with phase("calibration"):
                return segment_calibrated(session, measured, captured, flat)
        except PlanError as exc:  # a segment the stage builder cannot cut: the per-node
            _warn_uncompiled(options.fuse, exc)  # profile (as the two-point path falls back)
            return measured

    with phase("profile") as shown:
        costs = session.cached_costs(session.key, measure, "profile")
        if "profile" in session.hits:
            shown.note("from cache")
    timings["profile_s"] = time.perf_counter() - t0

    smallest: tuple[CapturedGraph, list[Any], CostGraph] | None = None
    scaled: tuple[int, ...] = ()
    two_point: CostGraph | None = None
    if points is not None:
        # node and loss times from two smaller microbatches; the full batch keeps the bytes
        t0 = time.perf_counter()
        scaled = scaled_batch_points(batch, candidates, ranks, points)
        try:
            with phase("calibration"):
                two_point, smallest = two_point_costs(session, points, costs, scaled)
        except PlanError as exc:  # a batch-dependent graph: one point, scaled
            _warn_uncompiled(options.fuse, exc)
        timings["batch_points_s"] = time.perf_counter() - t0
    if two_point is not None:
        costs = two_point
    elif options.training and options.loss_fn is not None:
        t0 = time.perf_counter()
        with phase("loss cost"):
            loss = session.cached_loss(f"@m{m_fixed}", captured, m_fixed)
        assert loss is not None
        costs = with_loss_cost(costs, loss)
        timings["loss_cost_s"] = time.perf_counter() - t0
    runtime = options.runtime
    if options.split_cost and options.training and ranks > 1:
        t0 = time.perf_counter()
        with phase("split cost"):
            runtime = _with_split_cost(session, runtime, captured, flat, costs, points, scaled,
                                       smallest)
        timings["split_cost_s"] = time.perf_counter() - t0
    if options.selective_cost and options.training:
        t0 = time.perf_counter()
        with phase("selective cost"):
            runtime = dataclasses.replace(runtime, selective_us_per_node=_selective_cached(
                session, captured, flat, costs))
        timings["selective_cost_s"] = time.perf_counter() - t0
    if options.training and torch.device(session.device).type == "cpu":
        # torch.utils.checkpoint keeps the CPU generator's state from each recomputing
        # stage's forward to its backward (preserve_rng_state): on CPU ranks, device memory
        state = torch.get_rng_state()
        runtime = dataclasses.replace(
            runtime, checkpoint_held_bytes=state.numel() * state.element_size())
    cores = usable_cores()
    if (options.runtime.ranks_are_processes and options.training and ranks > cores
            and torch.device(session.device).type == "cpu" and corunners_available()):
        # more CPU rank processes than cores: what time-slicing costs the model's compute
        t0 = time.perf_counter()
        with phase("time sharing"):
            at = (captured, flat) if smallest is None else smallest[:2]
            runtime = dataclasses.replace(runtime, time_sharing_factor=_time_sharing_cached(
                session, *at, ranks, cores))
        timings["time_sharing_s"] = time.perf_counter() - t0
    return ModelProfile(captured=captured, costs=costs, devices=tuple(options.devices),
                        batch_size=batch, num_microbatches=m_fixed,
                        microbatch_candidates=candidates, training=options.training,
                        timings_s=timings, from_cache=frozenset(session.hits), runtime=runtime,
                        co_runners=session.neighbours)


def _with_split_cost(session: Session, runtime: RuntimeDescription, captured: CapturedGraph,
                     flat: list[Any], costs: CostGraph, points: tuple[int, int] | None,
                     scaled: tuple[int, ...],
                     smallest: tuple[CapturedGraph, list[Any], CostGraph] | None,
                     ) -> RuntimeDescription:
    """``runtime`` with the split's per-node cost: at the profiled microbatch when m is fixed
    (or one point), else at each microbatch size whose segments were timed, smallest first
    (``split_backward_points``), as the cost grows with the rows."""
    name = SPLIT_OVERHEAD + ("" if runtime.name == "local" else f":{runtime.name}")
    if smallest is None or points is None:
        us = _split_cost_cached(session, name, lambda: (captured, flat, costs)) or 0.0
        return dataclasses.replace(runtime, split_backward_us_per_node=us)
    got = []
    for m in sorted({*points, *scaled}, reverse=True):
        us_m = _split_cost_cached(session, f"{name}@{session.batch // m}",
                                  functools.partial(_split_piece, session, m, smallest))
        if us_m is not None:
            got.append((session.batch // m, us_m))
    return dataclasses.replace(runtime, split_backward_points=tuple(got),
                               split_backward_us_per_node=got[0][1] if got else 0.0)


def _split_cost_cached(session: Session, name: str,
                       piece: Callable[[], tuple[CapturedGraph, list[Any], CostGraph] | None],
                       ) -> float | None:
    """The split's per-node cost, µs, read from the cache as the number ``name``, or else
    measured on what ``piece()`` returns (capture, flat inputs, profile; called only on a
    miss, since making it may capture the model) and stored; None where ``piece()`` is
    None. ``"split_cost"`` goes into the session's hits when read."""
    cached = session.load(name)
    if cached is not None:
        session.hits.add("split_cost")
        return float(cached)
    made = piece()
    if made is None:
        return None
    runtime = session.options.runtime
    if runtime.split_engine is None:
        raise PlanError(f"the runtime description {runtime.name!r} names no split engine; pass "
                        "split_cost=False, or a description from "
                        "autopart.runtime.description.describe()")
    us = measure_split_backward_overhead(*made, session.device, session.cut_positions(made[2]),
                                         cast(SplitEngine, runtime.split_engine))
    session.store(name, us)
    return float(us)


def _selective_cached(session: Session, captured: CapturedGraph, flat: list[Any],
                      costs: CostGraph) -> tuple[float, float]:
    """The selective policy's ``(forward, backward)`` cost per node, µs, from the cache or
    measured at the profiled batch and stored (``"selective_cost"`` goes into the session's
    hits when read)."""
    cached = [session.load(name) for name in SELECTIVE_OVERHEAD]
    if all(c is not None for c in cached):
        session.hits.add("selective_cost")
        return float(cached[0]), float(cached[1])  # type: ignore[arg-type]
    got = measure_selective_overhead(captured, flat, costs, session.device,
                                     session.cut_positions(costs))
    for name, value in zip(SELECTIVE_OVERHEAD, got, strict=True):
        session.store(name, value)
    return got


def _time_sharing_cached(session: Session, captured: CapturedGraph, flat: list[Any],
                         ranks: int, cores: int) -> float:
    """The model's ``RuntimeDescription.time_sharing_factor`` for ``ranks`` CPU rank
    processes on ``cores`` cores: read from the cache, else measured on one forward and
    backward of ``captured`` (:func:`autopart.profiler.corunners.time_sharing_factor`) and
    stored (not while the machine is oversubscribed: :meth:`Session.store`). The model's
    gradients, buffers and random state are left as they were."""
    name = f"{TIME_SHARING}@{batch_size(tuple(flat), {})}:{ranks}on{cores}"
    cached = session.load(name)
    if cached is not None:
        session.hits.add("time_sharing")
        return max(1.0, float(cached))
    # the timed forward and backward run on the model's own tensors (the captured graph holds
    # them): timed on fresh gradients (a held one would be accumulated into in place), and
    # the model left as it was
    gm = captured.graph_module
    # the machine's load is judged before the co-runners start: they alone put the load
    # average above the cores (3.5 on this project's 2 CPUs), so judged after, the factor was
    # never cached and every profile for more ranks than cores measured it again (100-230 s)
    busy = _profile_state.machine_busy()  # the name Session.store asks
    with kept_state(gm.parameters(), gm.buffers()):
        for p in gm.parameters():
            p.grad = None
        factor = time_sharing_factor(corunner_step(captured, flat), ranks, cores)
    session.store(name, factor, busy=busy)
    return factor


def _split_piece(session: Session, m: int,
                 smallest: tuple[CapturedGraph, list[Any], CostGraph],
                 ) -> tuple[CapturedGraph, list[Any], CostGraph] | None:
    """What the split's cost is timed on at ``m`` microbatches: the capture there with the
    smallest microbatch's profile, its saved bytes scaled to the rows (the piece's cuts
    follow the profile's time shares, the cache flush its bytes); None where the graph's ops
    differ from the smallest's.

    Raises:
        TraceError: the model cannot be captured at that batch (it was at the others)."""
    low_captured, _, low_costs = smallest
    cap, flat = session.capture_at(m)
    if cap is not low_captured and not same_ops(cap, low_captured):
        return None
    k = (session.batch // m) / low_costs.batch_size
    costs = dataclasses.replace(low_costs, nodes=tuple(
        dataclasses.replace(nd, saved_bytes=math.ceil(nd.saved_bytes * k))
        for nd in low_costs.nodes))
    return cap, flat, costs


def _warn_uncompiled(fuse: bool, exc: PlanError) -> None:
    """Warn, where the stages will run compiled, that the profile stays the eager one."""
    if fuse:
        warnings.warn(f"fuse=True: the profile could not be calibrated to compiled segments "
                      f"({exc}); the plan is priced on eager node times, which may be slower "
                      "or faster than the compiled stages", stacklevel=3)
