"""Costs as lines through two batch points: a node's time at any microbatch size from its
times at two profiled ones, and the per-segment scales a calibrated profile carries."""

from __future__ import annotations

import dataclasses

from autopart.core.costgraph import BatchScale, CostGraph
from autopart.core.errors import PlanError

__all__ = ["through_two_batches", "time_on_line", "segment_scales"]


def time_on_line(t1: float, t2: float, b1: int, b2: int, b: int) -> float:
    """Time at batch ``b`` on the line through ``(b1, t1)`` and ``(b2, t2)``, its slope kept
    >= 0 (a time measured lower at the larger batch is noise: held at ``t1``). Times in any
    one unit (µs here), batches in rows, ``b1 < b2``."""
    return t1 + max((t2 - t1) / (b2 - b1), 0.0) * (b - b1)


def through_two_batches(costs: CostGraph, low: CostGraph, high: CostGraph) -> CostGraph:
    """``costs`` (the full batch's profile, which keeps its bytes) with node times from two
    profiles of the same graph at smaller batches ``b1 < b2``: per node and part (forward,
    input gradient, weight gradient) the line through ``(b1, t1)`` and ``(b2, t2)``, its
    slope kept >= 0, gives the time at ``costs.batch_size``, and ``low``'s times become the
    second point (:meth:`CostGraph.with_low_batch`). The cost model's line through those two
    points is the same line.

    Raises:
        PlanError: the batches are not ``b1 < b2 < costs.batch_size``, or a graph differs.
    """
    b0, b1, b2 = costs.batch_size, low.batch_size, high.batch_size
    if not b1 < b2 < b0:
        raise PlanError(f"the two profiles' batches must be increasing and below the full "
                        f"batch {b0}, got {b1} and {b2}")
    if len(high.nodes) != len(costs.nodes) or any(
            a.name != b.name or a.op != b.op for a, b in zip(costs.nodes, high.nodes, strict=True)):
        raise PlanError(f"the graph captured at batch {b2} differs from the one at batch {b0}; "
                        "its times cannot be paired node by node")

    def at_b0(t1: float, t2: float) -> float:
        return time_on_line(t1, t2, b1, b2, b0)

    nodes = tuple(dataclasses.replace(
        n, fwd_us=at_b0(lo.fwd_us, hi.fwd_us),
        bwd_input_us=at_b0(lo.bwd_input_us, hi.bwd_input_us),
        bwd_weight_us=at_b0(lo.bwd_weight_us, hi.bwd_weight_us))
        for n, lo, hi in zip(costs.nodes, low.nodes, high.nodes, strict=True))
    return dataclasses.replace(costs, nodes=nodes).with_low_batch(low)


def segment_scales(line: CostGraph, rows: int, positions: tuple[int, ...],
                   times: list[tuple[float, float]], loss: tuple[float, float] = (0.0, 0.0),
                   ) -> BatchScale:
    """The :class:`BatchScale` at ``rows`` of ``line`` (a graph with a second profiled batch),
    from its segments' measured ``(forward µs, backward µs)`` there (``times``, cut at
    ``positions``; :func:`autopart.profiler.calibrate.segment_times`, which runs the graph
    without the loss). ``loss``: the loss's ``(forward, backward)`` µs at ``rows`` on its own
    line, added to the last segment's measured times, since ``line``'s last node holds it.

    Each factor is the segment's measured time over the sum of its nodes' times on the line
    at ``rows`` (as :class:`autopart.solver._cost_model.CostModel` reads it), 1.0 where either
    is 0.

    Raises:
        PlanError: ``line`` has no second batch, or ``times`` has not one pair per segment.
    """
    if not line.low_batch_size:
        raise PlanError("segment_scales needs a graph with a second profiled batch")
    bounds = [0, *positions, len(line.nodes)]
    if len(times) != len(bounds) - 1:
        raise PlanError(f"{len(times)} segment times for {len(bounds) - 1} segments")
    b0, b1 = line.batch_size, line.low_batch_size
    fwd: list[float] = []
    bwd: list[float] = []
    for k, (fwd_us, bwd_us) in enumerate(times):
        nodes = range(bounds[k], bounds[k + 1])
        f_line = sum(time_on_line(line.low_times[i][0], line.nodes[i].fwd_us, b1, b0, rows)
                     for i in nodes)
        b_line = sum(time_on_line(line.low_times[i][1], line.nodes[i].bwd_input_us, b1, b0, rows)
                     + time_on_line(line.low_times[i][2], line.nodes[i].bwd_weight_us, b1, b0,
                                    rows) for i in nodes)
        if k == len(times) - 1:
            fwd_us, bwd_us = fwd_us + loss[0], bwd_us + loss[1]
        fwd.append(fwd_us / f_line if fwd_us > 0 and f_line > 0 else 1.0)
        bwd.append(bwd_us / b_line if bwd_us > 0 and b_line > 0 else 1.0)
    return BatchScale(rows, tuple(positions), tuple(fwd), tuple(bwd))
