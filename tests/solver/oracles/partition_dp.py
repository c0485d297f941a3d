"""Exact min-max chain partition by dynamic programming in O(K^2 S), and brute force."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autopart.core.errors import InfeasiblePlanError, PlanError

__all__ = ["partition_dp", "partition_brute_force", "stage_costs", "check_chain"]


def check_chain(seg_cost: Sequence[int], cut_cost: Sequence[int], num_stages: int,
                cut_in_cost: Sequence[int] | None = None) -> None:
    """Validate a chain-partition instance.

    Raises:
        PlanError: ``num_stages < 1``, a cost is negative, or a cut-cost list is not ``K - 1`` long.
        InfeasiblePlanError: ``num_stages`` exceeds the number of segments ``K``.
    """
    k = len(seg_cost)
    if num_stages < 1:
        raise PlanError(f"num_stages={num_stages}; it must be >= 1")
    if num_stages > k:
        raise InfeasiblePlanError(
            f"num_stages={num_stages} but the chain has only {k} segments (each stage needs at "
            f"least one); use num_stages <= {k} or allow more cut candidates")
    for what, costs in (("cut_cost", cut_cost), ("cut_in_cost", cut_in_cost)):
        if costs is not None and len(costs) != max(k - 1, 0):
            raise PlanError(f"{what} has {len(costs)} entries; a chain of {k} segments needs "
                            f"{max(k - 1, 0)}")
    if any(c < 0 for c in seg_cost) or any(c < 0 for c in cut_cost) or (
            cut_in_cost is not None and any(c < 0 for c in cut_in_cost)):
        raise PlanError("chain costs must be >= 0")


def stage_costs(seg_cost: Sequence[int], cut_cost: Sequence[int], cuts: Sequence[int],
                cut_in_cost: Sequence[int] | None = None) -> list[int]:
    """Cost of every stage for given cuts.

    A stage costs the sum of its segments, plus ``cut_cost[i]`` for the cut after its last
    segment ``i`` (the sender's forward activation send) plus ``cut_in_cost[i]`` for the cut
    after segment ``i`` just before its first segment (the receiver's backward gradient send).
    ``cut_in_cost=None`` means ``cut_in_cost = cut_cost``: each cut is charged to BOTH stages
    beside it, which is the training case with a symmetric link.

    Args:
        seg_cost: per-segment cost, length K.
        cut_cost: per-cut cost charged to the stage before the cut, length K - 1.
        cuts: ascending cut indices; ``i`` means "cut after segment i".
        cut_in_cost: per-cut cost charged to the stage after the cut (default ``cut_cost``).

    Returns:
        ``len(cuts) + 1`` stage costs.
    """
    cin = cut_cost if cut_in_cost is None else cut_in_cost
    bounds = [-1, *cuts, len(seg_cost) - 1]
    out: list[int] = []
    for a, b in itertools.pairwise(bounds):
        cost = sum(seg_cost[a + 1:b + 1])
        if a >= 0:
            cost += cin[a]
        if b < len(seg_cost) - 1:
            cost += cut_cost[b]
        out.append(cost)
    return out


def partition_dp(seg_cost: Sequence[int], cut_cost: Sequence[int], num_stages: int,
                 cut_in_cost: Sequence[int] | None = None) -> tuple[int, tuple[int, ...]]:
    """Split a chain of K segments into exactly S non-empty contiguous stages, minimising the
    largest stage cost (see :func:`stage_costs` for how cuts are charged).

    ``best[s][j]`` is the smallest achievable max cost of the first ``j`` segments in ``s``
    stages; ``best[s][j] = min_i max(best[s - 1][i], cost(i, j))``. Ties keep the smallest ``i``
    so the answer is deterministic. O(K^2 S) time, O(K S) memory.

    Args:
        seg_cost: per-segment integer cost, length K (e.g. 0.1 µs units).
        cut_cost: cost of cutting after segment ``i`` (``i`` in ``0 .. K - 2``), charged to both
            neighbouring stages unless ``cut_in_cost`` is given.
        num_stages: S, ``1 <= S <= K``.
        cut_in_cost: optional separate charge to the stage after each cut.

    Returns:
        ``(objective, cuts)``: the optimal largest stage cost and the ``S - 1`` cut indices,
        ascending, ``i`` meaning "cut after segment i".

    Raises:
        PlanError: malformed input (see :func:`check_chain`).
        InfeasiblePlanError: ``S > K``.
    """
    check_chain(seg_cost, cut_cost, num_stages, cut_in_cost)
    k, s_total = len(seg_cost), num_stages
    cin = cut_cost if cut_in_cost is None else cut_in_cost
    prefix = [0]
    for c in seg_cost:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> int:  # stage of segments i .. j - 1
        c = prefix[j] - prefix[i]
        if i > 0:
            c += cin[i - 1]
        if j < k:
            c += cut_cost[j - 1]
        return c

    inf = float("inf")
    best: list[list[float]] = [[inf] * (k + 1) for _ in range(s_total + 1)]
    arg: list[list[int]] = [[-1] * (k + 1) for _ in range(s_total + 1)]
    for j in range(1, k + 1):
        best[1][j] = cost(0, j)
    for s in range(2, s_total + 1):
        for j in range(s, k - (s_total - s) + 1):
            for i in range(s - 1, j):
                val = max(best[s - 1][i], cost(i, j))
                if val < best[s][j]:
                    best[s][j], arg[s][j] = val, i
    cuts: list[int] = []
    j = k
    for s in range(s_total, 1, -1):
        i = arg[s][j]
        cuts.append(i - 1)
        j = i
    return int(best[s_total][k]), tuple(reversed(cuts))


def partition_brute_force(seg_cost: Sequence[int], cut_cost: Sequence[int], num_stages: int,
                          cut_in_cost: Sequence[int] | None = None) -> tuple[int, tuple[int, ...]]:
    """Same problem as :func:`partition_dp` by enumerating all C(K - 1, S - 1) cut sets.

    For tests on tiny chains only. Ties keep the lexicographically smallest cut tuple.

    Raises:
        PlanError: malformed input.
        InfeasiblePlanError: ``S > K``.
    """
    check_chain(seg_cost, cut_cost, num_stages, cut_in_cost)
    best: tuple[int, tuple[int, ...]] | None = None
    for cuts in itertools.combinations(range(len(seg_cost) - 1), num_stages - 1):
        val = max(stage_costs(seg_cost, cut_cost, cuts, cut_in_cost))
        if best is None or val < best[0]:
            best = (val, tuple(cuts))
    assert best is not None
    return best
