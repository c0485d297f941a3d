"""A plan's per-rank peak memory at another input shape than the one it was planned on (a
lazy pipeline's new sequence length), and the refusal when that no longer fits."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from autopart.codegen import plan_for_graph
from autopart.codegen.attention_graph import attention_heads
from autopart.core.capture import CapturedGraph
from autopart.core.cluster import Cluster, DeviceSpec
from autopart.core.errors import PlanError, ProfileError
from autopart.core.plan import Plan
from autopart.core.runtime_model import RuntimeDescription
from autopart.layout_planning import host_ranks_topology
from autopart.profiler.analytical import profile_analytical
from autopart.profiler.loss_cost import estimate_loss_cost, with_loss_cost
from autopart.solver.layout_predict import predict_layout_peaks
from autopart.solver.layout_search import LayoutOptions
from autopart.solver.options import SolveOptions
from autopart.solver.predict import predict

__all__ = ["ShapePeaks", "peaks_at_shape", "check_fits"]

_GIB = 2**30


@dataclass(frozen=True)
class ShapePeaks:
    """Per pipeline rank of a plan, its peak at the planned shape and at a new one, bytes.

    Attributes:
        planned_bytes: the plan's own per-rank peaks (``RankPlan.peak_memory_bytes``, at
            the shape it was planned on).
        bytes: the same ranks' peaks predicted at the new shape: ``planned_bytes`` plus what
            the analytical memory model adds going from the planned graph to the new one
            (:func:`peaks_at_shape`).
        capacity_bytes: each rank's device memory, bytes (the cap the plan was solved under).
    """

    planned_bytes: tuple[int, ...]
    bytes: tuple[int, ...]
    capacity_bytes: tuple[int, ...]

    def over(self) -> list[int]:
        """The ranks whose predicted peak at the new shape exceeds their device's memory."""
        return [r for r, (b, cap) in enumerate(zip(self.bytes, self.capacity_bytes, strict=True))
                if b > cap]


def _analytical_peaks(plan: Plan, captured: CapturedGraph, spec: DeviceSpec,
                      options: SolveOptions) -> tuple[int, ...]:
    """``plan``'s per-rank peaks on the analytical costs of ``captured`` (the plan moved onto
    that graph by node name), as the plan's own predictor charges them: the pipeline
    replay (:func:`autopart.solver.predict.predict`) for a plan of one replica, the layout
    search's pricing (:func:`autopart.solver.layout_predict.predict_layout_peaks`, ``captured``
    being one cp rank's tokens) for a (tp, pp, dp, cp, ZeRO) layout."""
    costs = profile_analytical(captured, None, spec, training=options.training)
    if options.training:  # the loss's log-softmax grows with the tokens too
        costs = with_loss_cost(costs, estimate_loss_cost(captured))
    on_graph = plan_for_graph(plan, captured)
    if on_graph.num_gpus == len(on_graph.ranks):
        cluster = Cluster.uniform(spec, [r.device for r in on_graph.ranks])
        return predict(on_graph, costs, cluster, options).peak_memory_bytes
    heads = attention_heads(captured) if plan.cp > 1 else None
    layout = LayoutOptions(num_gpus=on_graph.num_gpus,
                           topology=host_ranks_topology(on_graph.num_gpus, spec),
                           cp_tokens_profiled=True, attention_heads=heads)
    options = dataclasses.replace(options, schedule_kind=plan.schedule_kind,
                                  num_microbatches=plan.num_microbatches)
    return predict_layout_peaks(on_graph, costs, spec, options, layout)


def peaks_at_shape(plan: Plan, planned: CapturedGraph, new: CapturedGraph,
                   specs: tuple[DeviceSpec, ...], *, training: bool, state_factor: float,
                   runtime: RuntimeDescription) -> ShapePeaks:
    """``plan``'s per-rank peaks at the shape ``new`` was captured at, bytes.

    The plan's peaks were predicted on the costs it was solved on (measured, as a rule) at
    the shape ``planned`` was captured at. Nothing is measured at the new shape: both graphs
    are costed analytically (:func:`autopart.profiler.analytical.profile_analytical`, on
    ``meta`` tensors) and the plan (same cuts by node name, m, schedule, recompute, layout)
    is priced on each with the plan's own memory model. Each rank's new peak is its planned
    peak plus the difference of the two: parameters, gradients and optimizer state are the
    same at both shapes and cancel; what grows with the sequence (saved activations, held
    sends, working sets, the loss) is charged as the analytical model counts it: attention
    as the device's kernel saves it (:func:`autopart.profiler.analytical.profile_analytical`),
    the loss as a cross-entropy over the outputs
    (:func:`autopart.profiler.loss_cost.estimate_loss_cost`).

    Args:
        plan: the plan (made for ``planned``'s graph, or moved onto it by name).
        planned: the model captured at one microbatch of the planned shape.
        new: the model captured at one microbatch of the new shape (one cp rank's tokens
            where ``plan.cp > 1``, as the stages run).
        specs: per pipeline rank, its device (``memory_bytes`` is the capacity).
        training: the pipeline trains (saved activations, gradients, optimizer state).
        state_factor: optimizer state bytes per parameter byte (as the plan was solved).
        runtime: the runtime the pipeline runs on (its receive buffers).

    Raises:
        PlanError: a cut of the plan not found by name in one of the graphs.
        ProfileError: a node the analytical walk cannot run on ``meta`` tensors.
    """
    if len(specs) != len(plan.ranks):
        raise PlanError(f"{len(specs)} device specs for the plan's {len(plan.ranks)} ranks")
    options = SolveOptions(batch_size=plan.batch_size, num_microbatches=plan.num_microbatches,
                           training=training, optimizer_state_bytes_per_param_byte=state_factor,
                           runtime=runtime, recompute_policy=plan.recompute_policy)
    before = _analytical_peaks(plan, planned, specs[0], options)
    after = _analytical_peaks(plan, new, specs[0], options)
    planned_bytes = tuple(r.peak_memory_bytes for r in plan.ranks)
    return ShapePeaks(planned_bytes,
                      tuple(max(0, p + a - b) for p, a, b in zip(planned_bytes, after, before,
                                                                 strict=True)),
                      tuple(s.memory_bytes for s in specs))


def check_fits(plan: Plan, planned: CapturedGraph, new: CapturedGraph,
               specs: tuple[DeviceSpec, ...], *, training: bool, state_factor: float,
               runtime: RuntimeDescription, shapes: tuple[str, str]) -> ShapePeaks | None:
    """:func:`peaks_at_shape`, refusing a shape at which a rank no longer fits its device.

    Args:
        plan, planned, new, specs, training, state_factor, runtime: as for
            :func:`peaks_at_shape`.
        shapes: the planned and the new inputs' shapes, as the message prints them.

    Returns:
        The peaks, or None (with a ``RuntimeWarning``) where the analytical walk cannot cost
        one of the graphs: the new shape then runs unchecked, as before this check.

    Raises:
        PlanError: a rank's predicted peak at the new shape exceeds its device's memory (the
            message names the rank, both figures and the fixes).
    """
    try:
        peaks = peaks_at_shape(plan, planned, new, specs, training=training,
                               state_factor=state_factor, runtime=runtime)
    except ProfileError as exc:
        warnings.warn(f"the memory at inputs {shapes[1]} could not be estimated ({exc}); the "
                      "pipeline runs there unchecked", RuntimeWarning, stacklevel=3)
        return None
    over = peaks.over()
    if over:
        r = max(over, key=lambda k: peaks.bytes[k] - peaks.capacity_bytes[k])
        raise PlanError(
            f"inputs {shapes[1]} no longer fit the plan made at {shapes[0]}: rank {r} "
            f"({plan.ranks[r].device}) is predicted to peak at {peaks.bytes[r] / _GIB:.2f} GiB "
            f"there, over its device's {peaks.capacity_bytes[r] / _GIB:.2f} GiB (planned: "
            f"{peaks.planned_bytes[r] / _GIB:.2f} GiB at {shapes[0]}). Plan at the longest "
            "shape instead: make the first call (or autopart.compile(model, example_inputs=...)) "
            "with a batch of that length; or let the plan save memory at this shape "
            "(recompute=True, optimize='memory', or a larger cp= to split the sequence); or "
            f"pad or bucket the inputs to a length that fits")
    return peaks
