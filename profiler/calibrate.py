"""Whole-graph calibration: node times rescaled to what the runtime's stage code takes."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.core.capture import CapturedGraph
from autopart.core.costgraph import HOST_FIELDS, CostGraph, NodeCost
from autopart.profiler._state import kept_state
from autopart.profiler.timer import _MIN_WAIT_US, _device_wait

__all__ = ["whole_graph_times", "calibrate_to_whole_graph", "segment_times",
           "calibrate_to_segments", "segment_cuts"]

#: The longest device wait queued before a timed segment part, µs: a segment issues many
#: ops (a microbatch of the H100 GPT-2 took 30-45 ms of host time, benchmarks/gpu/README.md).
_MAX_SEGMENT_WAIT_US = 200_000.0


def whole_graph_times(captured: CapturedGraph, flat_inputs: list[Any], device: str, *,
                      min_repeats: int = 3, budget_s: float = 1.0) -> tuple[float, float]:
    """Forward and backward time of the whole graph run as one stage, µs:
    :func:`segment_times` with no cut.

    The graph is built as the runtimes build a stage (:func:`build_stage_modules`, no cut),
    its forward is timed, then its backward: ``torch.autograd.grad`` of the outputs that need a
    gradient (seeded with ones) with respect to the trainable parameters, which is the work
    of ``backward()`` without writing ``.grad``. One untimed warm-up, then at least
    ``min_repeats`` timed runs and more while ``budget_s`` seconds have not gone by; the
    medians are returned. The model's parameters, ``.grad``, buffers (BatchNorm statistics
    are restored) and random state are left as they were.

    Args:
        captured: the captured model; ``flat_inputs`` its flat inputs.
        device: where to run (the profiled device).
        min_repeats: timed runs at least (default 3, >= 1).
        budget_s: seconds after which no run beyond ``min_repeats`` starts (default 1.0).

    Returns:
        ``(forward µs, backward µs)``; the backward is 0 when nothing needs a gradient.
    """
    (times,) = segment_times(captured, flat_inputs, device, (), min_repeats=min_repeats,
                             budget_s=budget_s)
    return times


def calibrate_to_whole_graph(costs: CostGraph, fwd_us: float, bwd_us: float) -> CostGraph:
    """``costs`` with every node's forward time scaled so that they sum to ``fwd_us`` and
    both backward parts scaled so that they sum to ``bwd_us`` (a sum that is 0, or a
    whole-graph time that is 0, leaves that side as it was).

    Node by node profiling runs each op alone, on inputs it just read, so it misses what
    the stage's code pays between ops (cold caches, the allocator, dispatch between ops).
    Measured on this project's 2-core CPU (torch 2.13, one thread): a GPT-2-like model's
    node sums were 12-17 % under its whole forward at a microbatch of 2 rows, a small CNN's
    14 %. The shares of the nodes stay the profile's.
    """
    return dataclasses.replace(costs, nodes=_rescaled(costs.nodes, fwd_us, bwd_us))


def _rescaled(nodes: Sequence[NodeCost], fwd_us: float, bwd_us: float,
              fields: tuple[str, str, str] = ("fwd_us", "bwd_input_us", "bwd_weight_us"),
              ) -> tuple[NodeCost, ...]:
    """``nodes`` with their forward ``fields[0]`` scaled to sum to ``fwd_us`` µs and both
    backward parts (``fields[1:]``) to ``bwd_us`` µs (a zero sum or target leaves that side
    as it was; a missing host time counts as 0). ``fields``: the device times (default) or
    the host issue times (:data:`autopart.core.costgraph.HOST_FIELDS`)."""
    f, i, w = fields

    def get(n: NodeCost, name: str) -> float:
        return getattr(n, name) or 0.0

    total_f = sum(get(n, f) for n in nodes)
    total_b = sum(get(n, i) + get(n, w) for n in nodes)
    rf = fwd_us / total_f if total_f > 0 and fwd_us > 0 else 1.0
    rb = bwd_us / total_b if total_b > 0 and bwd_us > 0 else 1.0
    return tuple(dataclasses.replace(n, **{f: get(n, f) * rf, i: get(n, i) * rb,
                                           w: get(n, w) * rb}) for n in nodes)


def segment_cuts(costs: CostGraph, positions: list[int] | tuple[int, ...],
                 segments: int) -> tuple[int, ...]:
    """Up to ``segments - 1`` of ``positions`` (op-node positions where the graph may be
    cut) splitting the profiled time (forward + backward) into ``segments`` nearly equal
    parts: for each ``k / segments`` of the time, the position nearest it (duplicates
    dropped). Empty for ``segments < 2`` or no positions."""
    if segments < 2 or not positions:
        return ()
    prefix = [0.0]
    for nd in costs.nodes:
        prefix.append(prefix[-1] + nd.fwd_us + nd.bwd_us)
    total = prefix[-1]
    chosen = {min(positions, key=lambda q: abs(prefix[q] - k * total / segments))
              for k in range(1, segments)}
    return tuple(sorted(q for q in chosen if 0 < q < len(costs.nodes)))


class _SegmentClock:
    """Times one part of a segment run: on CPU, ``time.perf_counter`` around it; on CUDA, a
    pair of events on the current stream around it with the part queued behind a device
    wait (:func:`autopart.profiler.timer._device_wait`) three times as long as the part's
    host issue took the last time (200 µs to 200 ms), so the events span its kernels and not
    the gaps in which the device waits for the host to launch them (the cost model's device
    time; the host's issue time is the per-node profile's). A part's first call (the
    untimed warm-up) waits the least. A synchronize follows each part, outside the timed
    region, so the parts stay in sequence.

    Args:
        device: where the segments run.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.issued_us: dict[tuple[str, int], float] = {}  # last host issue time per part
        self.last_issue_us = 0.0  # the host issue time of the last part timed (CUDA)

    def time(self, part: tuple[str, int], fn: Callable[[], Any]) -> tuple[float, Any]:
        """``(µs, fn())``: the part's device time on CUDA, its wall time on CPU."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            out = fn()
            return (time.perf_counter() - t0) * 1e6, out
        wait = 3 * self.issued_us.get(part, 0.0)  # unknown (the warm-up): the least
        _device_wait(self.device, min(max(wait, _MIN_WAIT_US), _MAX_SEGMENT_WAIT_US))
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        h0 = time.perf_counter()
        out = fn()
        self.issued_us[part] = self.last_issue_us = (time.perf_counter() - h0) * 1e6
        end.record()
        torch.cuda.synchronize(self.device)
        return float(start.elapsed_time(end)) * 1e3, out


def segment_times(captured: CapturedGraph, flat_inputs: list[Any], device: str,
                  positions: list[int] | tuple[int, ...], *, min_repeats: int = 3,
                  budget_s: float = 1.0, fuse: bool = False,
                  host: list[tuple[float, float]] | None = None) -> list[tuple[float, float]]:
    """Forward and backward time of each segment of the graph cut at ``positions``, run in
    sequence as the runtimes run stages, µs.

    The graph is split and built as the runtimes build stages (:func:`split_graph`,
    :func:`build_stage_modules`); a forward runs the segments one after another, each on
    detached copies of what the previous one returned (leaves where they need a gradient,
    as a stage receives them); the backward then runs from the last segment to the first,
    each ``torch.autograd.backward`` of its outputs (seeded with ones on the last, with the
    next segment's input gradients on the others) into its inputs and trainable parameters,
    whose ``.grad`` hold zeros: the work of a stage's backward for every microbatch of a step
    but the first, which adds each parameter's gradient into ``.grad``. (Timed with
    ``torch.autograd.grad`` instead, which writes no ``.grad``, the fidelity GPT-2's backward
    at 2 rows per microbatch measured 0.9-1.1 ms, 3 %, under the runtime's.) One untimed
    warm-up, then at least ``min_repeats`` timed runs and more while ``budget_s`` seconds
    have not gone by; per segment the medians are returned. ``time.perf_counter`` on CPU;
    on CUDA the device time of each part (:class:`_SegmentClock`: CUDA events, the part
    queued behind a device wait so that the host's launch gaps are left out, as the per-node
    profile's device times are). With no positions the whole graph is one segment
    (:func:`whole_graph_times`).

    With ``fuse`` each segment runs as ``torch.compile`` of its module (Inductor's default
    mode, as :func:`autopart.codegen.stages.build_stages` wraps a stage with ``fuse=True``):
    the untimed warm-up then compiles it, forward and backward, and the times are those of
    the compiled code. Compiling costs time: planning the fidelity GPT-2 at m = 8 with its 8
    calibration segments compiled (benchmarks/fidelity/results_fuse.md) took 20 s more than
    eagerly from an empty Inductor cache on this project's 2-core CPU at a load average of 2,
    120-150 s more at 11-18 (torch 2.13); seconds once Inductor's on-disk cache holds them.

    The model's parameters, ``.grad``, buffers and random state are left as they were.

    Args:
        captured: the captured model; ``flat_inputs`` its flat inputs.
        device: where to run (the profiled device).
        positions: ascending op-node positions to cut at (``len(positions) + 1`` segments).
        min_repeats: timed runs at least (default 3, >= 1).
        budget_s: seconds after which no run beyond ``min_repeats`` starts (default 1.0).
        fuse: time each segment compiled with ``torch.compile`` (default False: eager).
        host: on CUDA, a list to which each segment's median host issue times
            ``(forward µs, backward µs)`` are appended: ``time.perf_counter`` around the
            part's call, which returns once its kernels are queued (the device is held by
            the wait queued before it); left empty on CPU, where the host runs the ops.

    Returns:
        ``[(forward µs, backward µs)]`` per segment; a backward is 0 where nothing needs a
        gradient.

    Raises:
        PlanError: a position cannot be cut (:func:`split_graph`).
    """
    dev = torch.device(device)
    graphs = split_graph(captured, list(positions))
    stages, _ = build_stage_modules(captured, graphs, [dev] * len(graphs))
    runners = [torch.compile(st) if fuse and st is not None else st  # type: ignore[misc]
               for st in stages]
    buffers = [b for st in stages if st is not None for b in st.buffers()]
    params = [[p for p in st.parameters() if p.requires_grad] if st is not None else []
              for st in stages]
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in flat_inputs]

    clock = _SegmentClock(dev)

    def run() -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """One forward and backward of every segment: per segment ``(fwd µs, bwd µs)``,
        and its host issue times the same way (the clock's; 0.0 off CUDA)."""
        fwd: list[float] = []
        fwd_issue: list[float] = []
        bwd_issue = [0.0] * len(stages)
        kept: list[tuple[list[Any], tuple[Any, ...]]] = []  # (leaves, outputs) per segment
        args: list[Any] = inputs
        for k, st in enumerate(runners):
            assert st is not None

            def forward(st: Any = st, args: list[Any] = args) -> Any:
                with torch.enable_grad():
                    return st(*args)
            us, out = clock.time(("F", k), forward)
            fwd.append(us)
            fwd_issue.append(clock.last_issue_us)
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            kept.append((args, out))
            args = [o.detach().requires_grad_(o.requires_grad) if isinstance(o, torch.Tensor)
                    and o.is_floating_point() else o for o in out]
        bwd = [0.0] * len(stages)
        grads_in: dict[int, torch.Tensor] = {}  # position in the next segment's inputs
        for k in range(len(stages) - 1, -1, -1):
            leaves, out = kept[k]
            last = k == len(stages) - 1
            roots, seeds = [], []
            for i, o in enumerate(out):
                if not (isinstance(o, torch.Tensor) and o.requires_grad):
                    continue
                g = torch.ones_like(o) if last else grads_in.get(i)
                if g is not None:
                    roots.append(o)
                    seeds.append(g)
            wanted = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad
                      and x.grad_fn is None] if k > 0 else []
            targets = wanted + params[k]
            grads_in = {}
            if roots and targets:
                bwd[k], _ = clock.time(("B", k), lambda r=roots, g=seeds, t=targets:
                                       torch.autograd.backward(r, g, inputs=t))
                bwd_issue[k] = clock.last_issue_us
                index = {id(x): i for i, x in enumerate(leaves)}
                grads_in = {index[id(x)]: x.grad for x in wanted if x.grad is not None}
        return list(zip(fwd, bwd, strict=True)), list(zip(fwd_issue, bwd_issue, strict=True))

    trainable = list({id(p): p for group in params for p in group}.values())
    with kept_state(trainable, buffers):
        for p in trainable:  # as a step's later microbatches find them
            p.grad = torch.zeros_like(p)
        run()  # warm-up: allocator, first-call dispatch
        runs: list[list[tuple[float, float]]] = []
        issues: list[list[tuple[float, float]]] = []
        start = time.perf_counter()
        while len(runs) < min_repeats or time.perf_counter() - start < budget_s:
            times, issued = run()
            runs.append(times)
            issues.append(issued)
        if host is not None and dev.type == "cuda":
            host.extend((statistics.median(r[k][0] for r in issues),
                         statistics.median(r[k][1] for r in issues)) for k in range(len(stages)))
        return [(statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs))
                for k in range(len(stages))]


def calibrate_to_segments(costs: CostGraph, positions: list[int] | tuple[int, ...],
                          times: list[tuple[float, float]],
                          host: list[tuple[float, float]] | None = None) -> CostGraph:
    """``costs`` with each segment's nodes (cut at ``positions``) rescaled as
    :func:`calibrate_to_whole_graph` rescales the whole graph, to that segment's measured
    ``(forward µs, backward µs)`` in ``times`` (:func:`segment_times`); with ``host`` (the
    segments' host issue times, ``segment_times(host=...)``) and host times on the nodes,
    their host issue times too, the same way.

    The per-node profile times each op's call alone and each backward part as a
    ``torch.autograd.grad`` call of its own, floored at the op's forward issue time; a
    stage's backward is one engine call that issues every node's kernels from C++. Measured
    on one H200 (torch 2.11, ``benchmarks/gpu/README.md``): the per-node host times of a
    12 x 768 GPT-2 summed to 48.5 ms per microbatch, while 4 stages at m = 16 ran at 26.7 ms
    per microbatch in all, device time included.

    Raises:
        ValueError: ``times`` (or a non-empty ``host``) does not have one entry per segment.
    """
    bounds = [0, *positions, len(costs.nodes)]
    if len(times) != len(bounds) - 1:
        raise ValueError(f"{len(times)} segment times for {len(bounds) - 1} segments")
    if host and len(host) != len(times):
        raise ValueError(f"{len(host)} segment host times for {len(times)} segments")
    nodes: list[Any] = []
    for k, ((a, z), (fwd_us, bwd_us)) in enumerate(zip(itertools.pairwise(bounds), times,
                                                       strict=True)):
        part = _rescaled(costs.nodes[a:z], fwd_us, bwd_us)
        if host and costs.has_host_times:
            part = _rescaled(part, *host[k], fields=HOST_FIELDS)
        nodes.extend(part)
    return dataclasses.replace(costs, nodes=tuple(nodes))
