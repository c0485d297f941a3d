"""profile_model: measure one model on one set of devices, once, as the solver needs it."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from autopart.core.capture import CapturedGraph, capture
from autopart.core.costgraph import CostGraph
from autopart.core.errors import PlanError
from autopart.core.progress import phase
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.signature import InputSignature, batch_size, microbatch_inputs
from autopart.profiler._state import kept_state
from autopart.profiler.batch_points import (
    batch_points,
    calibration_suffix,
    same_ops,
    scaled_batch_points,
    segment_calibrated,
    two_point_costs,
)
from autopart.profiler.cache import (
    cache_enabled,
    cached_profile,
    load_measure,
    machine_busy,
    profile_key,
    store_measure,
)
from autopart.profiler.corunners import available as corunners_available
from autopart.profiler.corunners import model_step as corunner_step
from autopart.profiler.corunners import time_sharing_factor, usable_cores
from autopart.profiler.links import LinkFigures
from autopart.profiler.loss_cost import (
    LossCost,
    cached_loss,
    estimate_loss_cost,
    loss_source,
    loss_tag,
    measure_loss_cost,
    with_loss_cost,
)
from autopart.profiler.measure import profile_graph
from autopart.profiler.split_cost import SplitEngine, measure_split_backward_overhead

__all__ = ["ProfileOptions", "ModelProfile", "profile_model", "PROFILE_METHOD"]

#: What ``profile_model`` measures with; part of the cache key, so a change re-profiles.
PROFILE_METHOD = ("measured:profile_graph(warmup=1,repeats=3,long_call_us=50000,"
                  "long=min-of-2-after-warm,backward-peak)")

#: The split's per-node cost's name in the cache, with the revision of its measurement.
SPLIT_OVERHEAD = "split_backward_us_per_node:flushed-mad-v6"
#: The cache entry of the model's time-sharing factor (CPU time beside co-runners sharing
#: each core over a core each; :func:`autopart.profiler.corunners.time_sharing_factor`).
TIME_SHARING = "time_sharing_factor:thread-time-v1"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """What :func:`profile_model` measures, and where.

    Attributes:
        devices: one device string per rank; the model is measured on ``devices[0]``.
        cut_positions: where the graph may be cut, for a profile (op-node positions; the
            solver's cut candidates): calibration segments and the split's piece are cut
            there. The profiler never chooses cuts itself.
        num_microbatches: m when fixed (the model is then profiled at the microbatch), else
            None (profiled at the full batch; the solver picks m among the divisors that
            leave microbatches of at least 2 rows).
        training: forward + backward (default) or forward only.
        split_cost: measure what zero-bubble's I/W split adds per node (training on more
            than one rank only; default True).
        loss_fn: ``(output, target) -> scalar``; its cost is added to the last node.
        example_target: the full batch's target: the loss is measured with it, else
            estimated as a cross-entropy over the outputs.
        cache: read and store in the profile cache; None (default): on unless
            ``$AUTOPART_CACHE`` is ``0``/``off``.
        low_batch: where m is open, time the model at two (and more) smaller microbatches
            too (default True; see :func:`autopart.profiler.batch_points.two_point_costs`).
        runtime: the runtime the plan is for: how it splits a backward
            (``split_engine``), whether its ranks are processes computing at once
            (``ranks_are_processes``: calibration beside co-runners).
        cpu_malloc: what the caller set of the CPU allocator before profiling (part of the
            cache key), or None.
        fuse: the stages will run compiled (``torch.compile``, ``CompileOptions.fuse``):
            every profile the solver reads is calibrated segment by segment to compiled
            segments' times (:func:`autopart.profiler.batch_points.segment_calibrated`), at
            the profiled microbatch when m is fixed or no batch points are timed, else at the
            batch points (default False: eager segments, where calibrated at all). Part of
            the cache key of every calibrated figure.
    """

    devices: tuple[str, ...]
    cut_positions: Callable[[CostGraph], Sequence[int]]
    num_microbatches: int | None = None
    training: bool = True
    split_cost: bool = True
    loss_fn: Any = None
    example_target: Any = None
    cache: bool | None = None
    low_batch: bool = True
    runtime: RuntimeDescription = RuntimeDescription()
    cpu_malloc: str | None = None
    fuse: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelProfile:
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
        timings_s: seconds per phase: ``capture_s``, ``profile_s``, ``loss_cost_s``,
            ``batch_points_s``, ``split_cost_s`` (and ``link_s``, ``solve_s`` added by the
            caller); a phase read from the cache counts the reading.
        from_cache: the phases read from the profile cache: ``"profile"``,
            ``"split_cost"``, ``"low_batch_profile"``, ``"high_batch_times"``,
            ``"scaled_batch_times"`` (empty when the cache was off or missed).
        runtime: the runtime description with what was measured of it here: the split's
            cost (``split_backward_us_per_node`` at the smallest microbatch the plan may use,
            ``split_backward_points`` where m is open) and the per-transfer cost.
        host_link: the link between CPU ranks when measured (two or more ``cpu`` ranks).
        co_runners: copies of this process that ran the model beside the segment
            calibration (0: timed alone).
    """

    captured: CapturedGraph
    costs: CostGraph
    devices: tuple[str, ...]
    batch_size: int
    num_microbatches: int | None
    microbatch_candidates: tuple[int, ...] | None
    training: bool
    timings_s: dict[str, float]
    from_cache: frozenset[str] = frozenset()
    runtime: RuntimeDescription = RuntimeDescription()
    host_link: LinkFigures | None = None
    co_runners: int = 0


class Session:
    """One :func:`profile_model` call's shared state: the model and inputs, the cache key and
    whether the cache is used, the phases read from it, and the captures made at each
    microbatch count (so no batch is captured twice)."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 options: ProfileOptions, batch: int) -> None:
        self.model, self.args, self.kwargs, self.options = model, args, kwargs, options
        self.batch = batch
        self.device = options.devices[0]
        self.training = options.training
        self.use_cache = cache_enabled() if options.cache is None else options.cache
        self.hits: set[str] = set()
        self.captures: dict[int, tuple[CapturedGraph, list[Any]]] = {}
        self.dtype = _dtype_name(model)
        self.on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        self.measured_loss = (options.training and options.loss_fn is not None
                              and options.example_target is not None and not self.on_meta)
        cpu_ranks = all(torch.device(d).type == "cpu" for d in options.devices)
        # the runtime's CPU ranks on this host compute at once: calibrate beside that many
        # copies of this process running the model (autopart.profiler.corunners)
        self.neighbours = (min(len(options.devices) - 1, (os.cpu_count() or 1) - 1)
                           if options.runtime.ranks_are_processes and options.training
                           and len(options.devices) > 1 and cpu_ranks
                           and corunners_available() else 0)
        self.method = PROFILE_METHOD + (",cpu-malloc=kept" if options.cpu_malloc else "") + (
            ",host-issue" if torch.device(self.device).type == "cuda" else "")  # host times
        self.key: dict[str, Any] = {}
        self._warned_busy = False

    def profile(self, captured: CapturedGraph, flat: list[Any]) -> CostGraph:
        """``captured``'s per-node profile on the session's device
        (:func:`autopart.profiler.measure.profile_graph`)."""
        return profile_graph(captured, flat, device=self.device, training=self.training)

    def cut_positions(self, costs: CostGraph) -> list[int]:
        """Where ``costs``' graph may be cut (the caller's ``ProfileOptions.cut_positions``)."""
        return list(self.options.cut_positions(costs))

    def capture_at(self, m: int) -> tuple[CapturedGraph, list[Any]]:
        """The model captured at ``m`` microbatches and its flat inputs (made once)."""
        if m not in self.captures:
            m_args, m_kwargs = microbatch_inputs(self.args, self.kwargs, m)
            cap = capture(self.model, m_args, m_kwargs)
            self.captures[m] = (cap, cap.flatten_inputs(m_args, m_kwargs))
        return self.captures[m]

    def profile_key(self, captured: CapturedGraph, flat: list[Any], method: str) -> dict[str, Any]:
        return profile_key(captured.fingerprint, self.device, flat, dtype=self.dtype,
                           training=self.training, method=method)

    def cached_costs(self, key: dict[str, Any], measure: Callable[[], CostGraph],
                     phase: str) -> CostGraph:
        """``measure()``'s CostGraph, read from (and stored in) the profile cache under
        ``key`` when the cache is on; ``phase`` goes into ``hits`` when it was read."""
        if not self.use_cache:
            return measure()
        costs, hit = cached_profile(key, measure)
        if hit:
            self.hits.add(phase)
        return costs

    def load(self, name: str) -> float | None:
        """A number cached on the full batch's profile, or None (none, or the cache off)."""
        return load_measure(self.key, name) if self.use_cache else None

    def store(self, name: str, value: float) -> None:
        """Cache ``name = value`` on the full batch's profile, unless the cache is off or,
        on a CPU, the machine is oversubscribed now (:func:`machine_busy`): as a profile
        measured then is not cached, neither is a timing (a batch point's segment times
        cached under a load average of 4 on this project's 2 CPUs later priced a 4 x 256
        GPT-2's m = 4 plans 3.5x their measured step)."""
        if not self.use_cache:
            return
        if torch.device(self.device).type == "cpu" and (busy := machine_busy()) is not None:
            if not self._warned_busy:
                warnings.warn(f"timed while the machine was busy ({busy}): these figures are "
                              "used but not cached", RuntimeWarning, stacklevel=2)
                self._warned_busy = True
            return
        store_measure(self.key, name, value)

    def loss_at(self, cap: CapturedGraph, m: int | None) -> LossCost | None:
        """The loss's cost at the batch ``cap`` was captured at (``m`` microbatches; None:
        the full batch), or None without a loss."""
        opts = self.options
        if not (self.training and opts.loss_fn is not None):
            return None
        if not self.measured_loss:  # timed as a cross-entropy on a materialised model
            return estimate_loss_cost(cap, None if self.on_meta else self.device)
        target = (opts.example_target if m is None
                  else InputSignature.split_target(opts.example_target, m)[0])
        return measure_loss_cost(cap, opts.loss_fn, target, self.device)

    def cached_loss(self, suffix: str, cap: CapturedGraph, m: int | None) -> LossCost | None:
        """:meth:`loss_at`, cached as numbers named ``loss_<field><suffix>``."""
        return cached_loss(self.key if self.use_cache else None,
                           suffix + loss_tag(self.measured_loss), lambda: self.loss_at(cap, m),
                           loss_source(self.device, self.measured_loss))


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
    with kept_state(gm.parameters(), gm.buffers()):
        for p in gm.parameters():
            p.grad = None
        factor = time_sharing_factor(corunner_step(captured, flat), ranks, cores)
    session.store(name, factor)
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


def _dtype_name(model: nn.Module) -> str:
    """The dtype of the model's first floating-point parameter (``"float32"`` if none)."""
    return next((str(p.dtype).removeprefix("torch.") for p in model.parameters()
                 if p.is_floating_point()), "float32")
