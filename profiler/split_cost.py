"""What splitting a backward into I and W adds on this device, per node, measured."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from autopart.codegen.params import build_stage_modules
from autopart.codegen.split import split_graph
from autopart.core.capture import CapturedGraph
from autopart.core.costgraph import CostGraph
from autopart.profiler._state import kept_state
from autopart.profiler.timer import spread, time_samples

__all__ = ["SplitEngine", "measure_split_backward_overhead", "piece_cuts", "piece_run",
           "overhead_of", "flush_bytes"]


class SplitEngine(Protocol):
    """How the runtime that will run a plan splits a stage's backward into its input- and
    weight-gradient parts (zero-bubble's I and W); the runtime package provides one per
    backend (``autopart.runtime.split_engines``), so the profiler times what that runtime
    runs without importing it."""

    def sent(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The stage's outputs as the runtime hands them on (the backward starts from
        these)."""
        ...

    def split(self, roots: list[torch.Tensor], grads: list[torch.Tensor],
              inputs: list[torch.Tensor], params: list[torch.nn.Parameter],
              ) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """``(I, W)``: two calls, I first, that compute the gradients of ``inputs`` and then
        of ``params`` from ``roots`` with output gradients ``grads``; whatever the runtime
        builds to split the backward is built in I."""
        ...


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


def overhead_of(pairs: Sequence[tuple[float, float]], nodes: int, *,
                step: float = 0.5) -> float:
    """The per-node cost the solver is charged for timed ``(B, I + W)`` pairs of a piece
    with ``nodes`` nodes that have a backward, µs.

    The median of the pairs' ``(I + W - B) / nodes``, rounded to a multiple of ``step``
    (default 0.5 µs), where the split is measurably slower: the median ratio
    ``(I + W) / B`` exceeds 1 by more than the median's standard error, taken robustly as
    ``1.253 * 1.4826 * MAD / sqrt(n)`` (MAD: the ratios' median absolute deviation; for
    normal noise ``1.4826 * MAD`` estimates the standard deviation and ``1.253 / sqrt(n)``
    of it is the median's error). Otherwise, and for no pairs or nodes, 0.0. (The median
    absolute deviation, not the range: one pair caught by a burst of load cannot zero a real
    cost.)
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
                                    engine: SplitEngine, *, min_pairs: int = 7,
                                    max_pairs: int = 16, max_spread: float = 0.05,
                                    budget_s: float = 2.0, start: float = 0.25,
                                    share: float = 0.06) -> float:
    """What splitting a backward into I and W adds per node that has a backward, µs per
    microbatch: the solver's ``split_backward_us_per_node``.

    The graph is cut around a piece of about ``share`` of its profiled time (see
    :func:`piece_cuts`), whose inputs are activations as every stage's but the first are.
    What comes before it runs once to make the piece's inputs; those that need a gradient
    there become the piece's leaves, as in the runtime. Then, per *pair*: one untimed
    forward of the piece, its backward timed once as
    ``torch.autograd.backward(..., retain_graph=True)`` (``B``) and then, on the same graph,
    as ``engine`` splits it (``I`` then ``W``). Before each of ``B``, ``I`` and ``W``
    :func:`flush_bytes` are written (untimed), so each starts with the caches as a pipeline
    leaves them. A pair's ratio is taken back to back on the same activations, so load that
    drifts over seconds cancels out of it. The first pair is a warm-up. Pairs are timed
    until at least ``min_pairs`` ratios spread by at most ``max_spread``
    (``(max - min) / median``), or ``max_pairs`` were timed, or ``budget_s`` seconds went by
    after ``min_pairs``; :func:`overhead_of` reduces them over the piece's nodes with a
    backward (``bwd_us > 0`` in ``costs``). The model's parameters, buffers, gradients and
    random state are left as they were.

    Args:
        captured: the captured model; ``flat_inputs`` its flat inputs.
        costs: its profile (chooses the piece).
        device: where to run (the profiled device).
        positions: where the graph may be cut (op-node positions, e.g. the solver's cut
            candidates).
        engine: how the runtime that will run the plan splits a backward
            (:class:`SplitEngine`).
        min_pairs, max_pairs: timed pairs at least and at most (defaults 7 and 16).
        max_spread: relative spread of the ratios at which timing stops (default 0.05).
        budget_s: seconds of timing after which no pair beyond ``min_pairs`` starts
            (default 2.0).
        start, share: where the piece starts and how much of the profiled time it holds
            (:func:`piece_cuts`).

    Returns:
        µs per node (>= 0); 0.0 where it cannot be measured (fewer than two cut
        candidates, no floating-point activation enters the piece, or nothing leaves it
        that needs a gradient) or is within the noise.

    Raises:
        ValueError: ``min_pairs < 1`` or ``max_pairs < min_pairs``.
    """
    pairs = _timed_pairs(captured, flat_inputs, costs, device, positions, engine,
                         min_pairs=min_pairs, max_pairs=max_pairs, max_spread=max_spread,
                         budget_s=budget_s, start=start, share=share)
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


@contextlib.contextmanager
def piece_run(captured: CapturedGraph, flat_inputs: list[Any], cuts: tuple[int, int],
              device: torch.device) -> Iterator[tuple[nn.Module, list[Any]]]:
    """The piece of the graph between ``cuts`` as a stage module on ``device``, and its
    inputs as the runtime hands them over: what comes before it run once (with grad, so
    that what needs a gradient is known: a BatchNorm's running statistics crossing the cut
    do not), detached, those that need a gradient made leaves. On exit the piece's
    parameters' gradients and both parts' buffers (a training forward may update BatchNorm
    statistics) are as they were."""
    stages, _ = build_stage_modules(captured, split_graph(captured, list(cuts)), [device] * 3)
    first, middle = stages[0], stages[1]
    assert first is not None and middle is not None
    with kept_state(middle.parameters(), [b for st in (first, middle) for b in st.buffers()]):
        with torch.enable_grad():
            sent = [x.to(device) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
            received = list(first(*sent))
        args = [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor)
                and x.requires_grad and x.is_floating_point()
                else x.detach() if isinstance(x, torch.Tensor) else x for x in received]
        del received
        yield middle, args


def _timed_pairs(captured: CapturedGraph, flat_inputs: list[Any], costs: CostGraph,
                 device: str, positions: Sequence[int], engine: SplitEngine, *,
                 min_pairs: int, max_pairs: int, max_spread: float, budget_s: float,
                 start: float, share: float) -> list[tuple[float, float]]:
    """The pairs' ``(B, I + W)`` times in µs, in the order timed (empty: not measurable)."""
    if min_pairs < 1 or max_pairs < min_pairs:
        raise ValueError(f"need 1 <= min_pairs <= max_pairs, got min_pairs={min_pairs}, "
                         f"max_pairs={max_pairs}")
    cuts = piece_cuts(costs, positions, start=start, share=share)
    if cuts is None:
        return []
    dev = torch.device(device)
    with piece_run(captured, flat_inputs, cuts, dev) as (middle, args):
        params = [p for p in middle.parameters() if p.requires_grad]
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
            roots = engine.sent(roots)
            grads = [torch.ones_like(o) for o in roots]
            needing = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
            (b_us,), _ = time_samples(dev, cold(lambda: torch.autograd.backward(
                roots, grads, retain_graph=True)), 0, 1)
            run_i, run_w = engine.split(roots, grads, needing, params)
            (i_us,), _ = time_samples(dev, cold(run_i), 0, 1)
            (w_us,), _ = time_samples(dev, cold(run_w), 0, 1)
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
