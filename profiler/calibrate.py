"""Whole-graph calibration: the per-op profile's sums against the graph run as one module."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.core.capture import CapturedGraph
from autopart.core.costgraph import CostGraph
from autopart.profiler.timer import RngState, time_samples

__all__ = ["Calibration", "measure_calibration", "calibrated"]


@dataclass(frozen=True)
class Calibration:
    """How the graph run whole compares with the sum of its nodes' profiled times.

    Attributes:
        fwd_factor: measured whole forward / sum of node ``fwd_us``.
        bwd_factor: measured whole backward / sum of node ``bwd_us`` (1.0 for inference).
        fwd_us: the whole forward, µs (median); ``bwd_us``: the whole backward, µs.
    """

    fwd_factor: float
    bwd_factor: float
    fwd_us: float
    bwd_us: float


def measure_calibration(captured: CapturedGraph, flat_inputs: list[Any], costs: CostGraph,
                        device: str, *, training: bool = True, repeats: int = 5,
                        budget_s: float = 3.0) -> Calibration:
    """Run the whole graph as one module (the stage a one-stage plan would build) and
    compare with the profile.

    Node-by-node timing sees each op alone, with its inputs warm in cache and without the
    autograd engine's own work between ops; the whole run sees both, as the stages will.
    On this project's 2-core CPU the whole GPT-2-like graph's forward took 0.9-1.1x the
    sum of its nodes and the backward 1.1-1.3x (see ``benchmarks/fidelity``). Forward and
    backward are timed in alternation, one warm-up of each, then up to ``repeats`` of
    each, stopping after two once both took ``budget_s`` in all; medians.

    Parameters, buffers (BatchNorm statistics), gradients and random state are left as
    they were.

    Args:
        captured: the captured graph; ``flat_inputs`` its flat inputs (the profiled batch).
        costs: its profile.
        device: where to run (the profiled device).
        training: time the backward too.
        repeats: at most this many timed calls of each (default 5).
        budget_s: see above (default 3.0).

    Returns:
        The factors (1.0 where a sum is zero).
    """
    dev = torch.device(device)
    (whole,), _ = build_stage_modules(captured, split_graph(captured, []), [dev])
    assert whole is not None
    buffers = list(whole.buffers())
    saved_buffers = [b.detach().clone() for b in buffers]
    params = list(whole.parameters())
    saved_grads = [p.grad for p in params]
    args = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
    fwd: list[float] = []
    bwd: list[float] = []
    try:
        with RngState(dev):
            for i in range(repeats + 1):
                with torch.set_grad_enabled(training):
                    (us,), out = time_samples(dev, lambda: lambda: whole(*args), 0, 1)
                if i > 0:
                    fwd.append(us)
                if training:
                    roots = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
                    if roots:
                        grads = [torch.ones_like(o) for o in roots]
                        (us,), _ = time_samples(
                            dev, lambda r=roots, g=grads: lambda: torch.autograd.backward(r, g),
                            0, 1)
                        if i > 0:
                            bwd.append(us)
                    for p in params:
                        p.grad = None
                del out
                if i >= 2 and sum(fwd) + sum(bwd) >= budget_s * 1e6:
                    break
    finally:
        with torch.no_grad():
            for b, data in zip(buffers, saved_buffers, strict=True):
                b.copy_(data)
        for p, grad in zip(params, saved_grads, strict=True):
            p.grad = grad
    fwd_us = statistics.median(fwd)
    bwd_us = statistics.median(bwd) if bwd else 0.0
    sum_fwd = sum(nd.fwd_us for nd in costs.nodes)
    sum_bwd = sum(nd.bwd_us for nd in costs.nodes)
    return Calibration(fwd_factor=fwd_us / sum_fwd if sum_fwd > 0 else 1.0,
                       bwd_factor=bwd_us / sum_bwd if sum_bwd > 0 and bwd else 1.0,
                       fwd_us=fwd_us, bwd_us=bwd_us)


def calibrated(costs: CostGraph, cal: Calibration) -> CostGraph:
    """``costs`` with every node's forward time scaled by ``cal.fwd_factor`` and its backward
    times by ``cal.bwd_factor``."""
    nodes = tuple(dataclasses.replace(nd, fwd_us=nd.fwd_us * cal.fwd_factor,
                                      bwd_input_us=nd.bwd_input_us * cal.bwd_factor,
                                      bwd_weight_us=nd.bwd_weight_us * cal.bwd_factor)
                  for nd in costs.nodes)
    return dataclasses.replace(costs, nodes=nodes)
