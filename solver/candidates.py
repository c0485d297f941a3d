"""Cut candidates: where a CostGraph may be split, what crosses each cut, the segments between."""

from __future__ import annotations

import bisect
import functools
import itertools
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from autopart.core.costgraph import CostGraph
from autopart.core.errors import InfeasiblePlanError, PlanError

__all__ = [
    "Segment",
    "CutCandidates",
    "crossing_profile",
    "crossing_sums",
    "crossing_values",
    "find_candidates",
    "add_positions",
]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class _Value:
    """A graph value: produced at ``produced`` (-1: graph input), last read at ``last_use``."""

    name: str
    produced: int
    last_use: int
    nbytes: int
    is_tensor: bool


@dataclass(frozen=True, slots=True)
class Segment:
    """Op nodes ``start .. stop - 1`` between two neighbouring candidate cuts (the solver's atom).

    Attributes:
        start: index of its first op node.
        stop: one past the index of its last op node.
        fwd_us: sum of its nodes' forward times at the profiled batch, µs.
        bwd_us: sum of its nodes' backward times at the profiled batch, µs.
        saved_bytes: sum of its nodes' saved activations at the profiled batch, bytes.
        param_bytes: bytes of the parameters first read in it (``NodeCost.param_bytes`` summed).
        num_nodes: ``stop - start``.
    """

    start: int
    stop: int
    fwd_us: float
    bwd_us: float
    saved_bytes: int
    param_bytes: int
    num_nodes: int


@dataclass(frozen=True, slots=True)
class CutCandidates:
    """The cut positions the solver chooses among, and the segments they delimit.

    Attributes:
        positions: candidate cut positions, ascending; position ``k`` splits node ``k - 1`` from
            node ``k``.
        crossing_bytes: crossing bytes at each candidate, per microbatch of the profiled batch.
        segments: ``len(positions) + 1`` segments covering every op node in order.
        num_valid: how many valid cut positions the graph has (before filtering).
        fallback: True when the filter left too few candidates and every valid position was used.
    """

    positions: tuple[int, ...]
    crossing_bytes: tuple[int, ...]
    segments: tuple[Segment, ...]
    num_valid: int
    fallback: bool = False


#: What :func:`_values`, :func:`crossing_profile`, :func:`_set_hashes` and the solver's cost
#: and memory tables (:func:`_per_graph`) made of a cost graph, by (what, graph identity); each
#: entry lives as long as its graph (CostGraph is frozen, so what was made of it stays true;
#: a weak reference drops the entry when the graph goes, so its id is not reused while
#: cached). The layout search asks for the same few graphs (one per tp, ep and cp degree)
#: hundreds of times.
_BY_GRAPH: dict[tuple[str, int], tuple[weakref.ref[CostGraph], Any]] = {}


def _per_graph(what: str, costs: CostGraph, make: Callable[[CostGraph], Any]) -> Any:
    """``make(costs)``, computed once per graph object and ``what`` while the graph lives
    (:data:`_BY_GRAPH`). ``what`` names everything beside the graph that ``make`` reads."""
    key = (what, id(costs))
    hit = _BY_GRAPH.get(key)
    if hit is not None and hit[0]() is costs:
        return hit[1]
    value = make(costs)
    _BY_GRAPH[key] = (weakref.ref(costs, functools.partial(_forget, key)), value)
    return value


def _forget(key: tuple[str, int], ref: weakref.ref[CostGraph]) -> None:
    """Drop ``key``'s entry once its graph is gone (the entry of that graph only)."""
    entry = _BY_GRAPH.get(key)
    if entry is not None and entry[0] is ref:
        del _BY_GRAPH[key]


def _values(costs: CostGraph) -> list[_Value]:
    """Every graph input and node output with its production index and last use, O(n + edges)
    once per graph (:func:`_per_graph`; the list is shared: read it, do not change it)."""
    return _per_graph("values", costs, _make_values)  # type: ignore[no-any-return]


def _make_values(costs: CostGraph) -> list[_Value]:
    n = len(costs.nodes)
    index: dict[str, int] = {name: -1 for name in costs.graph_inputs}
    last: dict[str, int] = {}
    for i, node in enumerate(costs.nodes):
        index[node.name] = i
        for inp in node.inputs:
            last[inp] = i
    for out in costs.graph_outputs:
        last[out] = n
    values = [_Value(name, -1, last.get(name, -1), nbytes, True)
              for name, nbytes in costs.graph_inputs.items()]
    values += [_Value(nd.name, i, last.get(nd.name, i), nd.output_bytes, nd.output_is_tensor)
               for i, nd in enumerate(costs.nodes)]
    return values


def crossing_profile(costs: CostGraph) -> tuple[list[int], list[bool]]:
    """Crossing bytes and validity at every position ``0 .. n``, by a difference array.

    A value crosses position ``k`` iff ``produced < k <= last_use``; graph inputs are produced at
    -1 and graph outputs are last used at ``n``, so position 0 sizes the graph inputs that are
    read and position ``n`` the graph outputs. A position is valid iff no crossing value is a
    non-tensor (``NodeCost.output_is_tensor=False``) and the graph does not rule it out
    (``CostGraph.no_cut``: inside a tensor-parallel pair); only ``1 .. n - 1`` are ever cuts.

    Args:
        costs: the cost graph.

    Returns:
        ``(crossing_bytes, valid)``, each of length ``n + 1`` (new lists; computed once per
        graph, :func:`_per_graph`); bytes per microbatch of the profiled batch.
    """
    crossing, valid = _per_graph("profile", costs, _make_profile)
    return list(crossing), list(valid)


def _make_profile(costs: CostGraph) -> tuple[list[int], list[bool]]:
    values = _values(costs)
    crossing = crossing_sums(costs, values, lambda v: v.nbytes)
    bad = crossing_sums(costs, values, lambda v: 0 if v.is_tensor else 1)
    return crossing, [b == 0 and k not in costs.no_cut for k, b in enumerate(bad)]


def crossing_sums(costs: CostGraph, values: list[_Value],
                  weight: Callable[[_Value], int]) -> list[int]:
    """At every position ``0 .. n``, the sum of ``weight(v)`` over the values ``v`` of
    ``values`` (from :func:`_values`) that cross it (see :func:`crossing_profile`), by a
    difference array: O(n + len(values))."""
    n = len(costs.nodes)
    diff = [0] * (n + 2)
    for v in values:
        w = weight(v)
        if w and v.last_use > v.produced:
            diff[v.produced + 1] += w
            diff[v.last_use + 1] -= w
    return list(itertools.accumulate(diff[:n + 1]))


def crossing_values(costs: CostGraph, position: int) -> tuple[str, ...]:
    """Names of the values crossing ``position`` (graph inputs first, then nodes in order).

    Args:
        costs: the cost graph.
        position: ``0 .. n``; a cut at ``k`` splits node ``k - 1`` from node ``k``.

    Raises:
        PlanError: ``position`` is outside ``0 .. n``.
    """
    n = len(costs.nodes)
    if not 0 <= position <= n:
        raise PlanError(f"crossing_values: position={position} is outside 0..{n} (the graph has "
                        f"{n} nodes, so a cut sits at 0..{n}); pass a position in 0..{n}")
    return tuple(v.name for v in _values(costs) if v.produced < position <= v.last_use)


def _set_hashes(costs: CostGraph) -> list[int]:
    """XOR of a 64-bit mix of each crossing value's index, per position (a crossing-set hash);
    once per graph (:func:`_per_graph`; the list is shared: read it, do not change it)."""
    return _per_graph("hashes", costs, _make_set_hashes)  # type: ignore[no-any-return]


def _make_set_hashes(costs: CostGraph) -> list[int]:
    n = len(costs.nodes)
    diff = [0] * (n + 2)
    for idx, v in enumerate(_values(costs)):
        if v.last_use > v.produced:
            h = _splitmix64(idx)
            diff[v.produced + 1] ^= h
            diff[v.last_use + 1] ^= h
    out: list[int] = []
    acc = 0
    for k in range(n + 1):
        acc ^= diff[k]
        out.append(acc)
    return out


def _splitmix64(x: int) -> int:
    z = (x * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _window_min(values: list[float], window: int) -> list[float]:
    """``out[k] = min(values[k - window .. k + window])`` (clipped), O(len) via a monotone deque."""
    out: list[float] = []
    dq: deque[int] = deque()
    size = len(values)
    nxt = 0
    for k in range(size):
        while nxt < size and nxt <= k + window:
            while dq and values[dq[-1]] >= values[nxt]:
                dq.pop()
            dq.append(nxt)
            nxt += 1
        while dq[0] < k - window:
            dq.popleft()
        out.append(values[dq[0]])
    return out


def _thin(positions: list[int], cum_us: list[float], keep: int) -> list[int]:
    """Keep ``keep`` positions spread evenly in cumulative compute.

    Rule: with ``T`` the total fwd + bwd time, target ``j`` (1..keep) sits at
    ``j * T / (keep + 1)``; for each target in order the kept position is the one whose
    cumulative compute before it is nearest the target (ties: the earlier), chosen among
    positions after the previous pick that still leave room for the remaining targets. The
    result is ascending and has ``keep`` entries.
    """
    if len(positions) <= keep:
        return positions
    cum = [cum_us[p] for p in positions]
    total = cum_us[-1]
    picked: list[int] = []
    lo = 0
    for j in range(1, keep + 1):
        hi = len(positions) - (keep - j)  # exclusive upper bound leaves room for the rest
        target = j * total / (keep + 1)
        i = bisect.bisect_left(cum, target, lo, hi)
        best = min((c for c in (i - 1, i) if lo <= c < hi),
                   key=lambda c: (abs(cum[c] - target), c))
        picked.append(positions[best])
        lo = best + 1
    return picked


def find_candidates(costs: CostGraph, num_stages: int, *, crossing_factor: float = 2.0,
                    window: int = 32, max_candidates: int = 128) -> CutCandidates:
    """Choose the cut positions the solver may use and build the segments between them.

    A valid position ``k`` is a candidate when its crossing bytes are at most ``crossing_factor``
    times the smallest crossing bytes among valid positions within ``window`` positions of it.
    Of consecutive candidates with identical crossing sets only the first is kept. More than
    ``max(max_candidates, num_stages - 1)`` candidates are thinned by the even-compute rule of
    :func:`_thin`. If fewer than ``num_stages - 1`` remain, every valid position is used instead
    (``fallback=True``), thinned by the same rule.

    Args:
        costs: the cost graph (at least one node).
        num_stages: S; at least ``S - 1`` candidates are returned.
        crossing_factor: how much more than the local minimum a candidate may carry (default 2.0).
        window: half-width of the neighbourhood for the local minimum, in positions (default 32).
        max_candidates: most candidates kept (default 128).

    Returns:
        The candidates, their crossing bytes (per microbatch of the profiled batch) and segments.

    Raises:
        PlanError: ``num_stages < 1``, ``crossing_factor < 1``, ``window < 0``,
            ``max_candidates < 1`` or the graph has no nodes.
        InfeasiblePlanError: the graph has fewer than ``num_stages - 1`` valid cut positions.
    """
    made = _per_graph("cut candidates", costs, lambda _: {})
    key = (num_stages, crossing_factor, window, max_candidates)
    if key not in made:  # the same few per graph in a layout search (immutable: shared)
        made[key] = _find_candidates(costs, num_stages, crossing_factor, window, max_candidates)
    return made[key]  # type: ignore[no-any-return]


def _find_candidates(costs: CostGraph, num_stages: int, crossing_factor: float, window: int,
                     max_candidates: int) -> CutCandidates:
    n = len(costs.nodes)
    if n == 0:
        raise PlanError("the cost graph has no op nodes; there is nothing to partition")
    if num_stages < 1:
        raise PlanError(f"num_stages={num_stages}; it must be >= 1")
    if crossing_factor < 1.0 or window < 0 or max_candidates < 1:
        raise PlanError(f"crossing_factor={crossing_factor} must be >= 1, window={window} >= 0 "
                        f"and max_candidates={max_candidates} >= 1")
    crossing, valid = crossing_profile(costs)
    valid_pos = [k for k in range(1, n) if valid[k]]
    need = num_stages - 1
    if len(valid_pos) < need:
        raise InfeasiblePlanError(
            f"num_stages={num_stages} needs {need} cuts, but the graph has only {len(valid_pos)} "
            f"valid cut positions (a tuple or scalar crossing a position makes it invalid); "
            f"num_stages must be <= {len(valid_pos) + 1}")
    cum_us = [0.0]
    for node in costs.nodes:
        cum_us.append(cum_us[-1] + node.fwd_us + node.bwd_us)

    # Local-minimum filter over valid positions (invalid ones count as +inf).
    inf = float("inf")
    masked = [float(crossing[k]) if valid[k] else inf for k in range(n + 1)]
    local_min = _window_min(masked, window)
    chosen = [k for k in valid_pos if crossing[k] <= crossing_factor * local_min[k]]

    # Drop repeats: consecutive candidates with the same crossing set keep the first.
    hashes = _set_hashes(costs)
    deduped: list[int] = []
    for k in chosen:
        if deduped and hashes[deduped[-1]] == hashes[k] and crossing[deduped[-1]] == crossing[k]:
            continue
        deduped.append(k)

    keep = max(max_candidates, need)
    fallback = len(deduped) < need
    positions = _thin(valid_pos if fallback else deduped, cum_us, keep)
    return CutCandidates(
        positions=tuple(positions),
        crossing_bytes=tuple(crossing[k] for k in positions),
        segments=_segments(costs, positions),
        num_valid=len(valid_pos),
        fallback=fallback,
    )


def _segments(costs: CostGraph, positions: list[int]) -> tuple[Segment, ...]:
    bounds = [0, *positions, len(costs.nodes)]
    segs: list[Segment] = []
    for start, stop in itertools.pairwise(bounds):
        nodes = costs.nodes[start:stop]
        segs.append(Segment(
            start=start, stop=stop,
            fwd_us=sum(nd.fwd_us for nd in nodes),
            bwd_us=sum(nd.bwd_us for nd in nodes),
            saved_bytes=sum(nd.saved_bytes for nd in nodes),
            param_bytes=sum(nd.param_bytes for nd in nodes),
            num_nodes=stop - start,
        ))
    return tuple(segs)


def add_positions(costs: CostGraph, cands: CutCandidates, extra: Iterable[int]) -> CutCandidates:
    """``cands`` with the valid positions of ``extra`` added (baseline cuts, a previous plan's).

    Positions outside ``1 .. n - 1`` or invalid (a non-tensor crosses them) are ignored.
    """
    crossing, valid = crossing_profile(costs)
    n = len(costs.nodes)
    merged = sorted(set(cands.positions) | {k for k in extra if 1 <= k < n and valid[k]})
    if len(merged) == len(cands.positions):
        return cands
    return CutCandidates(positions=tuple(merged),
                         crossing_bytes=tuple(crossing[k] for k in merged),
                         segments=_segments(costs, merged), num_valid=cands.num_valid,
                         fallback=cands.fallback)
