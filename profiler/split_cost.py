"""What splitting a backward into I and W costs on this device: ``(I + W) / B``, measured."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.codegen.split_backward import SplitBackward
from autopart.core.capture import CapturedGraph
from autopart.core.costgraph import CostGraph
from autopart.profiler.timer import time_samples

__all__ = ["measure_split_backward_factor"]


def measure_split_backward_factor(captured: CapturedGraph, flat_inputs: list[Any],
                                  costs: CostGraph, device: str, positions: Sequence[int], *,
                                  repeats: int = 7, budget_s: float = 2.0) -> float:
    """``(I + W) / B`` of the executor's zero-bubble split on a middle fifth of the model.

    The graph is cut at the two of ``positions`` nearest 40% and 60% of its profiled time (a
    fifth keeps this to seconds: a middle third of GPT-2 small at batch 8 x 128 took 21 s
    on this project's CPU). The middle piece, whose inputs are activations as every stage's
    but the first are, is run forward; then its backward is timed both ways, alternating,
    after a warm-up of each (at least two and at most ``repeats`` of each): one
    ``torch.autograd.backward`` (``B``) against
    :class:`autopart.codegen.split_backward.SplitBackward`'s ``input_grads`` then ``weight_grads``
    (``I + W``). The ratio of the medians, at least 1.0, is what the solver charges
    zero-bubble stages (``SolveOptions.split_backward_factor``). On one thread of this
    project's 2-core CPU it measured 1.07-1.2 on the 8-layer, width-256 GPT-2 of
    ``benchmarks/pipeline_cpu``: the split is not free, whatever the ZB-H1 paper's model
    assumes.

    The model's parameters, buffers, gradients and random state are left as they were.

    Args:
        captured: the captured model; ``flat_inputs`` its flat inputs.
        costs: its profile (chooses the cuts).
        device: where to run (the profiled device).
        positions: where the graph may be cut (op-node positions, e.g. the solver's cut
            candidates ``find_candidates(costs, 3).positions``).
        repeats: at most this many timed backward passes of each kind (default 7).
        budget_s: stop after two of each once both kinds have taken this many seconds
            (default 2.0), so that big models are not timed seven times.

    Returns:
        The factor, or 1.0 where it cannot be measured (fewer than two cut candidates, or
        no floating-point activation enters the middle piece, or nothing leaves it that
        needs a gradient).
    """
    if len(positions) < 2:
        return 1.0
    prefix = [0.0]
    for nd in costs.nodes:
        prefix.append(prefix[-1] + nd.fwd_us + nd.bwd_us)

    def nearest(share: float) -> int:
        return min(positions, key=lambda q: abs(prefix[q] - share * prefix[-1]))

    cuts = sorted({nearest(0.4), nearest(0.6)})
    if len(cuts) < 2:
        return 1.0
    dev = torch.device(device)
    stages, _ = build_stage_modules(captured, split_graph(captured, cuts), [dev] * 3)
    first, middle = stages[0], stages[1]
    assert first is not None and middle is not None
    # a training forward may update buffers (BatchNorm statistics); backward writes .grad
    buffers = list(first.buffers()) + list(middle.buffers())
    saved_buffers = [b.detach().clone() for b in buffers]
    all_params = list(middle.parameters())
    saved_grads = [p.grad for p in all_params]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        with torch.no_grad():
            sent = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
            received = list(first(*sent))
        params = [p for p in middle.parameters() if p.requires_grad]

        args = [x.detach().requires_grad_(True)
                if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in received]
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return 1.0

        no_backward: list[bool] = []

        def backward(split: bool) -> Callable[[], Any]:
            """Untimed: a fresh forward; returns the backward to time (B, or I then W)."""
            leaves = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor)
                      and a.requires_grad else a for a in args]
            out = middle(*leaves)
            roots = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
            grads = [torch.ones_like(o) for o in roots]
            if not roots:  # nothing to time: the outputs need no gradient
                no_backward.append(True)
                return lambda: None
            if not split:
                return lambda: torch.autograd.backward(roots, grads)
            sb = SplitBackward(roots, grads, [a for a in leaves if isinstance(a, torch.Tensor)
                                               and a.requires_grad], params)
            return lambda: (sb.input_grads(), sb.weight_grads())

        # alternate B and I + W one call at a time, so that drift hits both alike
        samples_us: dict[bool, list[float]] = {False: [], True: []}
        for i in range(repeats + 1):
            for split in (False, True):
                (us,), _ = time_samples(dev, lambda split=split: backward(split), 0, 1)
                if i > 0:  # the first of each is a warm-up
                    samples_us[split].append(us)
            if i >= 2 and min(sum(samples_us[False]), sum(samples_us[True])) >= budget_s * 1e6:
                break
        if no_backward:
            return 1.0
        factor = statistics.median(samples_us[True]) / statistics.median(samples_us[False])
        return max(1.0, round(factor, 3))
    finally:
        with torch.no_grad():
            for b, data in zip(buffers, saved_buffers, strict=True):
                b.copy_(data)
        for p, grad in zip(all_params, saved_grads, strict=True):
            p.grad = grad
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

