"""What torch's selective activation checkpointing costs on this device beyond the kernels it
runs again, per node, measured (the ``"selective"`` recompute policy)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from autopart.codegen.recompute import run_recomputed
from autopart.core.capture import CapturedGraph
from autopart.core.costgraph import CostGraph
from autopart.core.recompute_policy import SELECTIVE_KEPT_NODE_OPS
from autopart.profiler.split_cost import piece_cuts, piece_run
from autopart.profiler.timer import time_samples

__all__ = ["measure_selective_overhead"]


def measure_selective_overhead(captured: CapturedGraph, flat_inputs: list[Any],
                               costs: CostGraph, device: str, positions: Sequence[int], *,
                               min_pairs: int = 5, max_pairs: int = 12, budget_s: float = 2.0,
                               start: float = 0.25, share: float = 0.06,
                               ) -> tuple[float, float]:
    """``(forward, backward)`` µs per node per microbatch that a stage recomputing under the
    selective policy spends beyond running its unkept nodes again: the solver's
    ``RuntimeDescription.selective_us_per_node``.

    Selective checkpointing runs every kernel of the forward through a Python
    ``TorchDispatchMode`` that caches the kept outputs, and the backward's recomputation
    through another that hands them back; on this project's 2-core CPU that cost more than
    the unkept kernels themselves (a 6-layer GPT-2, n_embd 384, 2 x 256 tokens, 286 nodes:
    forward 147 -> 162 ms, backward 269 -> 336 ms where the unkept nodes' forward is 28 ms).

    The piece of the graph :func:`autopart.profiler.split_cost.piece_cuts` picks (about
    ``share`` of the profiled time) runs, per *pair*, once plainly and once under
    :func:`autopart.codegen.recompute.run_recomputed` with ``policy="selective"``, each
    forward and backward timed. The forward's extra is ``selective F - plain F``; the
    backward's ``selective B - plain B - r * plain F``, where ``r`` is the unkept nodes'
    share of the piece's profiled forward (what the policy runs again, which the cost model
    prices from the profile). The first pair is a warm-up; pairs are timed until
    ``min_pairs`` and then until ``max_pairs`` or ``budget_s`` seconds; the medians, divided
    by the piece's node count, never below 0. The model's parameters, buffers, gradients
    and random state are left as they were.

    Args:
        captured: the captured model; ``flat_inputs`` its flat inputs.
        costs: its profile (chooses the piece, gives ``r``).
        device: where to run (the profiled device).
        positions: where the graph may be cut (the solver's cut candidates).
        min_pairs, max_pairs: timed pairs at least and at most (defaults 5 and 12).
        budget_s: seconds of timing after which no pair beyond ``min_pairs`` starts.
        start, share: where the piece starts and how much of the profiled time it holds.

    Returns:
        ``(forward µs, backward µs)`` per node, ``(0.0, 0.0)`` where it cannot be measured
        (fewer than two cut candidates, or nothing leaves the piece that needs a gradient).

    Raises:
        ValueError: ``min_pairs < 1`` or ``max_pairs < min_pairs``.
    """
    if min_pairs < 1 or max_pairs < min_pairs:
        raise ValueError(f"need 1 <= min_pairs <= max_pairs, got min_pairs={min_pairs}, "
                         f"max_pairs={max_pairs}")
    cuts = piece_cuts(costs, positions, start=start, share=share)
    if cuts is None:
        return 0.0, 0.0
    piece = costs.nodes[cuts[0]:cuts[1]]
    total_fwd = sum(nd.fwd_us for nd in piece)
    unkept = sum(nd.fwd_us for nd in piece if nd.op not in SELECTIVE_KEPT_NODE_OPS)
    share_again = unkept / total_fwd if total_fwd > 0 else 0.0
    dev = torch.device(device)
    with piece_run(captured, flat_inputs, cuts, dev) as (middle, args):

        def run(selective: bool) -> tuple[float, float] | None:
            leaves = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor)
                      and a.requires_grad else a for a in args]
            out: list[Any] = []

            def forward() -> None:
                out[:] = [run_recomputed(middle, *leaves, policy="selective") if selective
                          else middle(*leaves)]
            (f_us,), _ = time_samples(dev, lambda: forward, 0, 1)
            roots = [o for o in out[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if not roots:
                return None
            grads = [torch.ones_like(o) for o in roots]
            (b_us,), _ = time_samples(dev, lambda: lambda: torch.autograd.backward(
                roots, grads), 0, 1)
            return f_us, b_us

        def pair() -> tuple[float, float] | None:
            plain, sel = run(False), run(True)
            if plain is None or sel is None:
                return None
            return sel[0] - plain[0], sel[1] - plain[1] - share_again * plain[0]

        if pair() is None:  # the warm-up; None: the outputs need no gradient
            return 0.0, 0.0
        got: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        while len(got) < max_pairs:
            one = pair()
            if one is None:  # pragma: no cover - the warm-up had a backward
                return 0.0, 0.0
            got.append(one)
            if len(got) >= min_pairs and time.perf_counter() - t0 >= budget_s:
                break
    nodes = max(len(piece), 1)
    return (max(statistics.median(f for f, _ in got) / nodes, 0.0),
            max(statistics.median(b for _, b in got) / nodes, 0.0))
