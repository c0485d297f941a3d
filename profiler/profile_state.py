"""What profiling one model keeps: its options (:class:`ProfileOptions`), its result
(:class:`ModelProfile`) and the state one profiling run shares between its phases
(:class:`Session`: the model, the cache entries, the co-runners)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from autopart.core.capture import CapturedGraph, capture, on_meta
from autopart.core.costgraph import CostGraph
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.signature import InputSignature, microbatch_inputs
from autopart.profiler.cache import (
    cache_enabled,
    cached_profile,
    load_measure,
    machine_busy,
    profile_key,
    store_measure,
)
from autopart.profiler.corunners import available as corunners_available
from autopart.profiler.links import LinkFigures
from autopart.profiler.loss_cost import (
    LossCost,
    cached_loss,
    estimate_loss_cost,
    loss_source,
    loss_tag,
    measure_loss_cost,
)
from autopart.profiler.measure import profile_graph

__all__ = ["ProfileOptions", "ModelProfile", "Session", "PROFILE_METHOD", "SPLIT_OVERHEAD",
           "SELECTIVE_OVERHEAD",
           "TIME_SHARING"]

#: What ``profile_model`` measures with; part of the cache key, so a change re-profiles.
PROFILE_METHOD = ("measured:profile_graph(warmup=1,repeats=3,long_call_us=50000,"
                  "long=min-of-2-after-warm,backward-peak)")

#: The split's per-node cost's name in the cache, with the revision of its measurement.
SPLIT_OVERHEAD = "split_backward_us_per_node:flushed-mad-v6"
#: Cache names of the selective policy's forward and backward cost per node.
SELECTIVE_OVERHEAD = ("selective_fwd_us_per_node:v1", "selective_bwd_us_per_node:v1")
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
        selective_cost: measure what the selective recompute policy's checkpointing adds
            per node (training only; default False: the plan will not recompute
            selectively; :func:`autopart.profiler.selective_cost.measure_selective_overhead`).
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
    selective_cost: bool = False
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
        self.on_meta = on_meta(model)
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

    def store(self, name: str, value: float, *,
              busy: str | None | Literal[True] = True) -> None:
        """Cache ``name = value`` on the full batch's profile, unless the cache is off or,
        on a CPU, the machine is oversubscribed (:func:`machine_busy`): as a profile
        measured then is not cached, neither is a timing (a batch point's segment times
        cached under a load average of 4 on this project's 2 CPUs later priced a 4 x 256
        GPT-2's m = 4 plans 3.5x their measured step).

        ``busy``: True (default) asks :func:`machine_busy` now; a measurement that loads the
        machine itself (the time-sharing factor's co-runners) passes what it said before the
        measurement started (a reason, or None for a quiet machine)."""
        if not self.use_cache:
            return
        if busy is True:
            busy = machine_busy()
        if torch.device(self.device).type == "cpu" and busy:
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


def _dtype_name(model: nn.Module) -> str:
    """The dtype of the model's first floating-point parameter (``"float32"`` if none)."""
    return next((str(p.dtype).removeprefix("torch.") for p in model.parameters()
                 if p.is_floating_point()), "float32")
