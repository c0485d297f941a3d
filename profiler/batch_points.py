"""Node times where m is open: the model timed at two smaller microbatches (and more), each
profile calibrated segment by segment, and the line through them."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from autopart.core.batch_lines import segment_scales, through_two_batches, time_on_line
from autopart.core.capture import CapturedGraph
from autopart.core.costgraph import HOST_FIELDS, CostGraph
from autopart.core.errors import PlanError
from autopart.profiler.calibrate import calibrate_to_segments, segment_cuts, segment_times
from autopart.profiler.corunners import co_runners
from autopart.profiler.corunners import model_step as corunner_step
from autopart.profiler.loss_cost import LossCost, loss_tag, with_loss_cost

if TYPE_CHECKING:
    from autopart.profiler.profile_state import Session

__all__ = ["batch_points", "scaled_batch_points", "two_point_costs", "segment_calibrated",
           "calibration_suffix", "calibration_cuts", "same_ops", "CALIBRATION_SEGMENTS", "FUSED"]

#: Segments a profile is calibrated in: their times in sequence, as stages run, set the
#: shares of the profile's nodes in each.
CALIBRATION_SEGMENTS = 8

#: How the two batch points are measured on top of the profile method (cache key).
CALIBRATION = ",segment-calibrated-v2"

#: What a calibration of compiled segments (``ProfileOptions.fuse``) adds to a cache key.
FUSED = ",fused=torch.compile(inductor)"


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
    line's: the candidates of at least twice the ranks' microbatches, other than the two
    points, at most ``most`` (default 4) of them, the ones nearest the larger point in
    ``log m``; ascending. Empty when m is fixed. (Each costs a capture and a timed forward
    and backward.)"""
    if not candidates:
        return ()
    m_high = points[1]
    extra = [m for m in candidates if m >= 2 * max(num_ranks, 1) and m not in points
             and batch // m < batch]
    extra.sort(key=lambda m: (abs(math.log(m / m_high)), m))
    return tuple(sorted(extra[:most]))


def calibration_suffix(neighbours: int, fuse: bool = False) -> str:
    """What a segment calibration beside ``neighbours`` co-runners, of compiled segments
    with ``fuse``, adds to a cache key."""
    return (CALIBRATION + (f",co-runners={neighbours}" if neighbours else "")
            + (FUSED if fuse else ""))


def calibration_cuts(session: Session, costs: CostGraph) -> tuple[int, ...]:
    """Where a profile is cut for its calibration: up to :data:`CALIBRATION_SEGMENTS`
    segments of nearly equal profiled time, at the session's cut positions."""
    return segment_cuts(costs, session.cut_positions(costs), CALIBRATION_SEGMENTS)


def same_ops(a: CapturedGraph, b: CapturedGraph) -> bool:
    """Whether two captures have the same op nodes, as ``(name, target)`` in order: what
    pairs their times node by node."""
    return _ops(a) == _ops(b)


def _ops(captured: CapturedGraph) -> list[tuple[str, str]]:
    return [(n.name, str(n.target)) for n in captured.graph_module.graph.nodes
            if n.op == "call_function"]


def segment_calibrated(session: Session, costs: CostGraph, captured: CapturedGraph,
                       flat: list[Any]) -> CostGraph:
    """``costs`` (``captured``'s profile on ``flat``) with each calibration segment's nodes
    scaled to the segment's forward and backward timed in sequence
    (:func:`autopart.profiler.calibrate.segment_times`), beside the session's co-runners;
    each segment compiled with ``torch.compile`` where the session fuses
    (``ProfileOptions.fuse``), so that the node costs sum, segment by segment, to the
    compiled code's times."""
    cuts = calibration_cuts(session, costs)
    host: list[tuple[float, float]] = []
    with co_runners(corunner_step(captured, flat), session.neighbours):
        times = segment_times(captured, flat, session.device, cuts, fuse=session.options.fuse,
                              host=host)
    return calibrate_to_segments(costs, cuts, times, host)


def _segments_at(session: Session, m: int, cuts: tuple[int, ...],
                 same_as: CapturedGraph | None = None,
                 ) -> tuple[CapturedGraph, list[tuple[float, float]] | None]:
    """The model captured at ``m`` microbatches and its segments (cut at ``cuts``) timed
    there beside the session's co-runners; None for the times when ``same_as`` is given and
    the capture's ops differ from it.

    Raises:
        PlanError: a segment cannot be cut at that batch.
    """
    captured, flat = session.capture_at(m)
    if same_as is not None and not same_ops(captured, same_as):
        return captured, None
    with co_runners(corunner_step(captured, flat), session.neighbours):
        return captured, segment_times(captured, flat, session.device, cuts,
                                       fuse=session.options.fuse)


def two_point_costs(session: Session, points: tuple[int, int], unlossed: CostGraph,
                    scaled: tuple[int, ...] = (),
                    ) -> tuple[CostGraph, tuple[CapturedGraph, list[Any], CostGraph]]:
    """The full batch's costs with node and loss times from two smaller batches.

    At the smallest microbatch (``points[0]`` microbatches) a profile calibrated segment by
    segment, cached like a profile; at the larger one (``points[1]``) the full batch's node
    shares calibrated to that graph's segments, cached as numbers on the full batch's
    profile. The loss is measured at both microbatches: the line through them gives its time
    at the full batch, and its bytes there are the larger microbatch's, scaled. Each node's
    time at another microbatch is read off the line through its two points
    (:func:`autopart.core.batch_lines.through_two_batches`), except at ``scaled``
    (:func:`scaled_batch_points`), whose segments are timed the same way and give the line a
    :class:`~autopart.core.costgraph.BatchScale` each. With co-runners in the session the
    segments are timed while they run the model at the same microbatch, as the host's other
    ranks will; such figures are cached apart. The loss is timed alone.

    Returns:
        The costs, and the smallest microbatch's capture, flat inputs and profile.

    Raises:
        PlanError: a graph captured at another batch differs (node count, names, ops).
    """
    batch = session.batch
    m_low, m_high = points
    low_captured, low_flat = session.capture_at(m_low)
    calibration = calibration_suffix(session.neighbours, session.options.fuse)

    def measure_low() -> CostGraph:
        low = session.profile(low_captured, low_flat)
        return segment_calibrated(session, low, low_captured, low_flat)

    low_key = session.profile_key(low_captured, low_flat, session.method + calibration)
    low = session.cached_costs(low_key, measure_low, "low_batch_profile")
    b_low, b_high = batch // m_low, batch // m_high
    loss_low = session.cached_loss(f"@{b_low}{calibration}", low_captured, m_low)
    cuts = calibration_cuts(session, unlossed)
    values = _high_point_values(session, m_high, cuts, calibration)
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
    line = with_host_times_of(through_two_batches(unlossed, low, high), low)
    scales = []
    for m in scaled:
        rows = batch // m
        got = _scaled_segment_times(session, m, cuts, calibration, low_captured)
        if got is None:
            continue  # a segment that cannot be cut there, or another graph: the line there
        loss_m = ((0.0, 0.0) if loss_low is None else (
            time_on_line(loss_low.fwd_us, values[0], b_low, b_high, rows),
            time_on_line(loss_low.bwd_us, values[1], b_low, b_high, rows)))
        scales.append(segment_scales(line, rows, cuts, list(zip(got[0::2], got[1::2], strict=True)),
                                     loss_m))
    return (dataclasses.replace(line, batch_scales=tuple(scales)),
            (low_captured, low_flat, low))


def with_host_times_of(costs: CostGraph, source: CostGraph) -> CostGraph:
    """``costs`` with each node's host issue times taken from ``source``'s node of the same
    name (a node ``source`` lacks keeps its own); ``costs`` as it is when either has no host
    times. A call's issue time does not grow with its tensors, so the line through two
    batches takes the smallest microbatch's, which :func:`segment_calibrated` scaled to its
    segments' issue times."""
    if not (costs.has_host_times and source.has_host_times):
        return costs
    by_name = {n.name: n for n in source.nodes}
    return dataclasses.replace(costs, nodes=tuple(
        dataclasses.replace(n, **{f: getattr(s, f) for f in HOST_FIELDS})
        if (s := by_name.get(n.name)) is not None else n for n in costs.nodes))


def _high_point_values(session: Session, m_high: int, cuts: tuple[int, ...],
                       calibration: str) -> list[float]:
    """At the larger point: the loss's ``fwd_us, bwd_us, saved_bytes, transient_bytes``
    (zeros without a loss) then each segment's ``fwd_us, bwd_us``; cached as numbers."""
    b_high = session.batch // m_high
    tag = loss_tag(session.measured_loss)
    fields = ("loss_fwd_us", "loss_bwd_us", "loss_saved_bytes", "loss_transient_bytes",
              *(f"segment{k}_{f}" for k in range(len(cuts) + 1) for f in ("fwd_us", "bwd_us")))
    names = [f"{f}@{b_high}{calibration}{tag if f.startswith('loss_') else ''}" for f in fields]
    cached = [session.load(n) for n in names]
    if all(v is not None for v in cached):
        session.hits.add("high_batch_times")
        return [float(v) for v in cached if v is not None]
    high_captured, times = _segments_at(session, m_high, cuts)
    assert times is not None
    loss_high = session.loss_at(high_captured, m_high)
    values = ([0.0] * 4 if loss_high is None else [
        loss_high.fwd_us, loss_high.bwd_us, float(loss_high.saved_bytes),
        float(loss_high.transient_bytes)]) + [t for pair in times for t in pair]
    for n, v in zip(names, values, strict=True):
        session.store(n, v)
    return values


def _scaled_segment_times(session: Session, m: int, cuts: tuple[int, ...], calibration: str,
                          low_captured: CapturedGraph) -> list[float] | None:
    """Each segment's ``fwd_us, bwd_us`` at ``m`` microbatches (cached as numbers), or None
    where a segment cannot be cut there or the graph's ops differ from the smallest's."""
    rows = session.batch // m
    names = [f"segment{k}_{f}@{rows}{calibration}" for k in range(len(cuts) + 1)
             for f in ("fwd_us", "bwd_us")]
    got = [session.load(n) for n in names]
    if all(v is not None for v in got):
        session.hits.add("scaled_batch_times")
        return [float(v) for v in got if v is not None]
    try:
        _, m_times = _segments_at(session, m, cuts, same_as=low_captured)
    except PlanError:
        return None
    if m_times is None:
        return None
    seg = [t for pair in m_times for t in pair]
    for n, v in zip(names, seg, strict=True):
        session.store(n, v)
    return seg
