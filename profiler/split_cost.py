"""What splitting a backward into I and W costs on this device: ``(I + W) / B``, measured."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.codegen.split_backward import SplitBackward
from autopart.core.capture import CapturedGraph
from autopart.core.costgraph import CostGraph
from autopart.profiler.timer import spread, time_samples

__all__ = ["measure_split_backward_factor", "measure_split_backward_overhead", "piece_cuts",
           "factor_of", "overhead_of", "flush_bytes"]


def piece_cuts(costs: CostGraph, positions: Sequence[int], *, start: float = 0.25,
               share: float = 0.06) -> tuple[int, int] | None:
    """The two cut positions around the piece whose split is timed.

    The piece starts at the position of ``positions`` nearest ``start`` of the profiled
    time (forward + backward, summed in topological order) and ends at the first position
    after it where the piece holds at least ``share`` of that time (the last position if none
    does).

    Args:
        costs: the profile; ``positions``: where the graph may be cut (op-node positions).
        start, share: fractions of the profiled time (defaults 0.25 and 0.06: on GPT-2
            small one transformer block out of twelve plus the LM head, a quarter in).

    Returns:
        ``(first, second)`` positions, or None when fewer than two positions are given.
    """
    if len(positions) < 2:
        return None
    prefix = [0.0]
    for nd in costs.nodes:
        prefix.append(prefix[-1] + nd.fwd_us + nd.bwd_us)
    total = prefix[-1]
    ordered = sorted(positions)
    first = min(ordered[:-1], key=lambda q: abs(prefix[q] - start * total))
    later = [q for q in ordered if q > first]
    second = next((q for q in later if prefix[q] - prefix[first] >= share * total), later[-1])
    return first, second


def measure_split_backward_factor(captured: CapturedGraph, flat_inputs: list[Any],
                                  costs: CostGraph, device: str, positions: Sequence[int], *,
                                  min_pairs: int = 3, max_pairs: int = 8,
                                  max_spread: float = 0.05, budget_s: float = 2.0,
                                  start: float = 0.25, share: float = 0.06,
                                  runtime: str = "local") -> float:
    """``(I + W) / B`` of the executor's zero-bubble split, timed on a small piece of the model.

    The graph is cut around a piece of about ``share`` of its profiled time (see
    :func:`piece_cuts`: by default one GPT-2 block a quarter in, whose inputs are activations
    as every stage's but the first are). What comes before it runs once to make the piece's
    inputs; those that need a gradient there become the piece's leaves, as in the runtime.
    Then, per *pair*: one untimed forward of the piece, its backward timed once as
    ``torch.autograd.backward(..., retain_graph=True)`` (``B``) and then, on the same graph,
    as
    :class:`autopart.codegen.split_backward.SplitBackward`'s ``input_grads`` then
    ``weight_grads`` (``I + W``), or with ``runtime="distributed"`` torch's split on copies of
    the outputs, as the distributed stages send them (the local executor builds its
    ``SplitBackward`` in ``I``, and so is it timed). Before each of ``B``, ``I`` and ``W``
    :func:`flush_bytes` are written (untimed: the model's parameters and one microbatch's
    saved activations, at most 64 MiB), so each starts with the caches as a pipeline
    leaves them, where other microbatches' work runs between a microbatch's forward, its
    ``I`` and its ``W``:
    timed back to back, torch's split of the fidelity GPT-2's piece at 2 rows cost 10-15 µs
    a node; with the caches flushed 16-18 µs; in that GPT-2's ZB-H1 run (m = 16, 2 gloo
    ranks) the second rank's ``I + W`` took 48 ms a step more than its ``B`` under 1F1B,
    about 30 µs a node. The pair's ratio is taken back to back
    on the same activations, so load that drifts over seconds (other processes on a shared
    machine) cancels out of it. The first pair is a warm-up. Pairs are
    timed until at least ``min_pairs`` ratios spread by at most ``max_spread`` (``(max - min) / median``), or
    ``max_pairs`` were timed, or ``budget_s`` seconds went by after ``min_pairs``. The factor
    is :func:`factor_of` the ratios: their median, rounded to 0.05, where it exceeds 1 by
    more than the ratios' noise, else 1.0.

    The ZB-H1 paper's cost model takes the split as free (factor 1); this measures what
    the runtime pays. The result is cached with the profile by
    :func:`autopart.planning.profile_model`, so one device, model and input shape pays it
    once.

    The model's parameters, buffers, gradients and random state are left as they were.

    Args:
        captured: the captured model; ``flat_inputs`` its flat inputs.
        costs: its profile (chooses the piece).
        device: where to run (the profiled device).
        positions: where the graph may be cut (op-node positions, e.g. the solver's cut
            candidates ``find_candidates(costs, 3).positions``).
        min_pairs: timed pairs at least (default 3, >= 1).
        max_pairs: timed pairs at most (default 8, >= ``min_pairs``).
        max_spread: relative spread of the ratios at which timing stops (default 0.05).
        budget_s: seconds of timing after which no pair beyond ``min_pairs`` starts
            (default 2.0).
        start, share: where the piece starts and how much of the profiled time it holds
            (:func:`piece_cuts`).
        runtime: whose split is timed: ``"local"`` (default; the local executor's
            :class:`~autopart.codegen.split_backward.SplitBackward`) or ``"distributed"``
            (torch.distributed.pipelining's ``stage_backward_input`` and
            ``stage_backward_weight``, which the distributed runtime's stages run; measured
            here 1.08-1.13 against SplitBackward's 1.05-1.11 on the same pieces).

    Returns:
        The factor, or 1.0 where it cannot be measured (fewer than two cut candidates, or
        no floating-point activation enters the piece, or nothing leaves it that needs a
        gradient).

    Raises:
        ValueError: ``min_pairs < 1`` or ``max_pairs < min_pairs``, or an unknown
            ``runtime``.
    """
    ratios = _timed_ratios(captured, flat_inputs, costs, device, positions, min_pairs=min_pairs,
                           max_pairs=max_pairs, max_spread=max_spread, budget_s=budget_s,
                           start=start, share=share, runtime=runtime)
    return factor_of(ratios)


def factor_of(ratios: Sequence[float], *, step: float = 0.05) -> float:
    """The factor the solver is charged for timed ``(I + W) / B`` ratios.

    The median ratio, rounded to a multiple of ``step`` (default 0.05), where the split is
    measurably slower: its excess over 1 is larger than half the ratios' range (the noise
    of this measurement). Otherwise, and for no ratios at all, 1.0: an overhead within the
    noise is not charged, so that the same model measured twice gets the same factor.

    Args:
        ratios: the pairs' ratios (dimensionless).
        step: the rounding grid (> 0).

    Returns:
        A factor >= 1.0.
    """
    if not ratios:
        return 1.0
    median = statistics.median(ratios)
    noise = (max(ratios) - min(ratios)) / 2
    if median - 1.0 <= noise:
        return 1.0
    return max(1.0, round(round(median / step) * step, 6))


def overhead_of(pairs: Sequence[tuple[float, float]], nodes: int, *,
                step: float = 0.5) -> float:
    """The per-node cost the solver is charged for timed ``(B, I + W)`` pairs of a piece
    with ``nodes`` nodes that have a backward, µs.

    The median of the pairs' ``(I + W - B) / nodes``, rounded to a multiple of ``step``
    (default 0.5 µs), where the split is measurably slower: the median ratio
    ``(I + W) / B`` exceeds 1 by more than the median's standard error, taken robustly as
    ``1.253 * 1.4826 * MAD / sqrt(n)`` (MAD: the ratios' median absolute deviation; for
    normal noise ``1.4826 * MAD`` estimates the standard deviation and ``1.253 / sqrt(n)``
    of it is the median's error). Otherwise, and for no pairs or nodes, 0.0. (A test on the
    ratios' range, used before, let one or two pairs caught by a burst of the machine zero a
    real cost: the fidelity CNN's split adds 12-26 % to ``B`` in 16 pairs, and under a
    concurrent load single pairs measured 0.59 and 2.41, which put that test's threshold at
    13-16 % of ``B``; one cold profile of five came out 0 while another job ran.)
    """
    if not pairs or nodes < 1:
        return 0.0
    ratios = [s / b for b, s in pairs]
    mid = statistics.median(ratios)
    mad = statistics.median(abs(r - mid) for r in ratios)
    if mid - 1.0 <= 1.253 * 1.4826 * mad / len(ratios) ** 0.5:
        return 0.0
    per_node = statistics.median((s - b) / nodes for b, s in pairs)
    return max(0.0, round(round(per_node / step) * step, 6))


def measure_split_backward_overhead(captured: CapturedGraph, flat_inputs: list[Any],
                                    costs: CostGraph, device: str, positions: Sequence[int],
                                    *, min_pairs: int = 7, max_pairs: int = 16,
                                    max_spread: float = 0.05, budget_s: float = 2.0,
                                    start: float = 0.25, share: float = 0.06,
                                    runtime: str = "local") -> float:
    """What splitting a backward into I and W adds per node that has a backward, µs per
    microbatch: the solver's ``split_backward_us_per_node``.

    Timed as :func:`measure_split_backward_factor` times its piece (same arguments, but
    at least 7 and at most 16 pairs by default: one pair's ratio moves by 20 % here), and
    reduced by :func:`overhead_of` over the piece's nodes with a backward (``bwd_us > 0`` in
    ``costs``). The split's extra work is a walk of the autograd graph per node (I's hooks
    on the intermediates W restarts from, W's second traversal), whatever the rows: on the
    fidelity GPT-2 (2-core CPU, torch 2.13.0+cpu, torch's split) ``(I + W) / B`` measured
    1.03-1.06 at 32 rows, 1.11-1.12 at 4 and 1.16 at 2. Time it on the smallest
    microbatch the plan may use, where it weighs most and is measured best;
    :func:`autopart.planning.profile_model` does.

    Returns:
        µs per node (>= 0), 0.0 where it cannot be measured (see
        :func:`measure_split_backward_factor`) or is within the noise.

    Raises:
        ValueError: as :func:`measure_split_backward_factor`.
    """
    pairs = _timed_pairs(captured, flat_inputs, costs, device, positions, min_pairs=min_pairs,
                         max_pairs=max_pairs, max_spread=max_spread, budget_s=budget_s,
                         start=start, share=share, runtime=runtime)
    cuts = piece_cuts(costs, positions, start=start, share=share)
    if not pairs or cuts is None:
        return 0.0
    nodes = sum(nd.bwd_us > 0 for nd in costs.nodes[cuts[0]:cuts[1]])
    return overhead_of(pairs, nodes)


#: The most bytes written between the timed parts of a pair, to take the caches' contents
#: away: in a pipeline a microbatch's B, I and W each run after other microbatches' work.
_FLUSH_BYTES = 64 * 1024 * 1024


def flush_bytes(costs: CostGraph) -> int:
    """Bytes written before each timed part of a pair: what the model's other microbatches
    touch in between, at most: its parameters and buffers and one microbatch's saved
    activations (at ``costs.batch_size``), capped at :data:`_FLUSH_BYTES` (more than this
    project's CPU's last-level cache, and than an H100's 50 MB L2). A model whose work fits
    in the caches keeps them warm in a pipeline too."""
    touched = sum(costs.param_sizes.values()) + sum(nd.saved_bytes for nd in costs.nodes)
    return min(_FLUSH_BYTES, touched)


def _cache_flusher(device: torch.device, nbytes: int) -> Any:
    """A function that writes ``nbytes`` (rounded down to 4) on ``device``."""
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    return lambda: buf.add_(1.0)


def _timed_ratios(captured: CapturedGraph, flat_inputs: list[Any], costs: CostGraph,
                  device: str, positions: Sequence[int], *, min_pairs: int, max_pairs: int,
                  max_spread: float, budget_s: float, start: float, share: float,
                  runtime: str = "local") -> list[float]:
    """The pairs' ``(I + W) / B`` ratios, in the order timed (empty: not measurable)."""
    return [s_us / b_us for b_us, s_us in _timed_pairs(
        captured, flat_inputs, costs, device, positions, min_pairs=min_pairs,
        max_pairs=max_pairs, max_spread=max_spread, budget_s=budget_s, start=start,
        share=share, runtime=runtime)]


def _timed_pairs(captured: CapturedGraph, flat_inputs: list[Any], costs: CostGraph,
                 device: str, positions: Sequence[int], *, min_pairs: int, max_pairs: int,
                 max_spread: float, budget_s: float, start: float, share: float,
                 runtime: str = "local") -> list[tuple[float, float]]:
    """The pairs' ``(B, I + W)`` times in µs, in the order timed (empty: not measurable)."""
    if runtime not in ("local", "distributed"):
        raise ValueError(f"runtime must be 'local' or 'distributed', got {runtime!r}")
    if min_pairs < 1 or max_pairs < min_pairs:
        raise ValueError(f"need 1 <= min_pairs <= max_pairs, got min_pairs={min_pairs}, "
                         f"max_pairs={max_pairs}")
    cuts = piece_cuts(costs, positions, start=start, share=share)
    if cuts is None:
        return []
    dev = torch.device(device)
    stages, _ = build_stage_modules(captured, split_graph(captured, list(cuts)), [dev] * 3)
    first, middle = stages[0], stages[1]
    assert first is not None and middle is not None
    # a training forward may update buffers (BatchNorm statistics); backward writes .grad
    buffers = list({id(b): b for st in (first, middle) for b in st.buffers()}.values())
    saved_buffers = [b.detach().clone() for b in buffers]
    all_params = list(middle.parameters())
    saved_grads = [p.grad for p in all_params]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        # with grad, so that what needs a gradient is known (a BatchNorm's running statistics
        # crossing the cut do not); the runtime makes exactly those leaves that need one
        with torch.enable_grad():
            sent = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
            received = list(first(*sent))
        params = [p for p in middle.parameters() if p.requires_grad]
        args = [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor)
                and x.requires_grad and x.is_floating_point()
                else x.detach() if isinstance(x, torch.Tensor) else x for x in received]
        del received
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return []

        flush = _cache_flusher(dev, flush_bytes(costs))

        def cold(thunk: Any) -> Any:
            """A :func:`time_samples` factory: the caches flushed (untimed), then ``thunk``."""
            return lambda: (flush(), thunk)[1]

        def pair() -> tuple[float, float] | None:
            """One forward, then B and I + W on its graph, each part after the caches were
            flushed, µs (None: no backward)."""
            leaves = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor)
                      and a.requires_grad else a for a in args]
            out = middle(*leaves)
            roots = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
            if not roots:
                return None
            if runtime == "distributed":  # the distributed stages send copies (see _P2PStage)
                roots = [o.clone() for o in roots]
            grads = [torch.ones_like(o) for o in roots]
            needing = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
            (b_us,), _ = time_samples(dev, cold(lambda: torch.autograd.backward(
                roots, grads, retain_graph=True)), 0, 1)
            if runtime == "distributed":  # torch's zero-bubble stages' I and W
                from torch.distributed.pipelining._backward import (
                    stage_backward_input,
                    stage_backward_weight,
                )

                (i_us,), (_, groups) = time_samples(dev, cold(lambda: stage_backward_input(
                    roots, grads, needing, iter(params))), 0, 1)
                (w_us,), _ = time_samples(dev, cold(lambda: stage_backward_weight(
                    iter(params), groups)), 0, 1)
            else:  # the local executor builds its SplitBackward in I
                made: list[SplitBackward] = []
                (i_us,), _ = time_samples(dev, cold(lambda: (made.append(SplitBackward(
                    roots, grads, needing, params)), made[-1].input_grads())), 0, 1)
                (w_us,), _ = time_samples(dev, cold(made[-1].weight_grads), 0, 1)
            return (b_us, i_us + w_us) if b_us > 0 else None

        if pair() is None:  # the warm-up; None: the outputs need no gradient
            return []
        pairs: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        while len(pairs) < max_pairs:
            got = pair()
            if got is None:  # pragma: no cover - the warm-up had a backward
                return []
            pairs.append(got)
            if len(pairs) >= min_pairs and (spread([s / b for b, s in pairs]) <= max_spread
                                            or time.perf_counter() - t0 >= budget_s):
                break
        return pairs
    finally:
        with torch.no_grad():
            for b, data in zip(buffers, saved_buffers, strict=True):
                b.copy_(data)
        for p, grad in zip(all_params, saved_grads, strict=True):
            p.grad = grad
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
