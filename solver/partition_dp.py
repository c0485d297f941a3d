"""Exact chain partition by dynamic programming in O(K^2 S), brute force, and the DP seed for CP-SAT."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.solver.chain import ChainAnswer, ChainProblem

__all__ = ["partition_dp", "partition_brute_force", "stage_costs", "check_chain", "chain_dp_hint"]


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


def chain_dp_hint(problem: ChainProblem) -> ChainAnswer | None:
    """A fast answer to ``problem`` for seeding CP-SAT: exact min-max by dynamic programming.

    Minimises the largest per-stage value (stage time ``t_s`` for ``"speed"``, stage memory for
    ``"memory"``), ignoring the rank-load and sum terms of the objective. Each stage recomputes
    only when it must to fit (``"auto"``). Memory is checked per stage against its rank's cap
    divided by ``stages_per_rank``, which is exact for one stage per rank and conservative
    otherwise. Vectorised with numpy: O(K^2 S) element operations.

    Returns:
        The DP's cuts and recompute flags with ``problem.objective`` of them, or None when no
        partition passes the per-stage caps.
    """
    k, s_total = problem.num_segments, problem.num_stages
    big = np.int64(2**62)
    state = np.array(problem.seg_state or [0] * k, dtype=np.int64)
    saved = np.array(problem.seg_saved or [0] * k, dtype=np.int64)
    cross = list(problem.cut_bytes or [0] * (k - 1))
    zero = np.zeros(1, dtype=np.int64)
    p_state = np.concatenate([zero, np.cumsum(state)])
    p_saved = np.concatenate([zero, np.cumsum(saved)])
    # Stage of segments i .. j - 1: rows i = 0..K-1, columns j = 1..K (index j).
    in_b = np.array([problem.first_in_bytes, *cross], dtype=np.int64)          # by i
    out_b = np.array([0, *cross, problem.last_out_bytes], dtype=np.int64)      # by j
    cin = np.array([0, *problem.cut_in], dtype=np.int64)
    cout = np.array([0, *problem.cut_out, 0], dtype=np.int64)
    base_mem = (p_state[None, :] - p_state[:k, None]) + in_b[:, None] + out_b[None, :]
    act = p_saved[None, :] - p_saved[:k, None]
    valid = np.arange(k + 1)[None, :] > np.arange(k)[:, None]
    times = {}
    by_speed: dict[float, tuple[np.ndarray, np.ndarray]] = {}  # ranks of equal speed share
    for r in sorted({problem.rank_of(s) for s in range(s_total)}):
        f = 1.0 if problem.speed is None else problem.speed[r]
        if f not in by_speed:
            pt = np.concatenate([zero, np.cumsum(np.array(problem.seg_time_on(r), dtype=np.int64))])
            pf = np.concatenate([zero, np.cumsum(np.array(problem.seg_fwd_on(r), dtype=np.int64))])
            t0 = (pt[None, :] - pt[:k, None]) + cin[:k, None] + cout[None, :]
            by_speed[f] = (t0, t0 + (pf[None, :] - pf[:k, None]))
        times[r] = by_speed[f]
    modes = {"none": (True, False), "all": (False, True), "auto": (True, True)}[problem.recompute]

    def stage_matrix(s: int, rows: slice, cols: slice) -> tuple[np.ndarray, np.ndarray]:
        kk = problem.in_flight_of(s)
        bm, ac, ok = base_mem[rows, cols], act[rows, cols], valid[rows, cols]
        mem0 = bm + kk * ac
        mem1 = bm + kk * in_b[rows, None] + ac
        t0, t1 = times[problem.rank_of(s)]
        t0, t1 = t0[rows, cols], t1[rows, cols]
        cap = (None if problem.rank_caps is None
               else problem.rank_caps[problem.rank_of(s)] // problem.stages_per_rank)
        none = np.zeros_like(ok)
        ok0 = (ok if cap is None else ok & (mem0 <= cap)) if modes[0] else none
        ok1 = (ok if cap is None else ok & (mem1 <= cap)) if modes[1] else none
        if problem.optimize == "memory":
            v0, v1 = mem0, mem1
        else:
            v0, v1 = t0, t1
        val0 = np.where(ok0, v0, big)
        val1 = np.where(ok1, v1, big)
        use1 = val1 < val0
        return np.minimum(val0, val1), use1

    # Stage s (0-based) can only start at segment i in [s, K - (S - s)] and end before j in
    # [s + 1, K - (S - s - 1)] (every stage takes one segment at least): the DP runs on that
    # window only, which gives the same answer (ties still keep the smallest i).
    best = np.full(k + 1, big, dtype=np.int64)
    best[0] = 0
    args: list[np.ndarray] = []
    flags: list[np.ndarray] = []
    for s in range(s_total):
        i0, i1 = s, k - (s_total - s) + 1
        j0, j1 = s + 1, k - (s_total - s - 1) + 1
        val, use1 = stage_matrix(s, slice(i0, i1), slice(j0, j1))
        prev = best[i0:i1]
        cand = np.maximum(prev[:, None], val)
        cand[prev >= big, :] = big
        cols = np.arange(j1 - j0)
        arg_w = np.argmin(cand, axis=0)
        best = np.full(k + 1, big, dtype=np.int64)
        best[j0:j1] = cand[arg_w, cols]
        arg = np.zeros(k + 1, dtype=np.int64)
        arg[j0:j1] = arg_w + i0
        flag = np.zeros(k + 1, dtype=bool)
        flag[j0:j1] = use1[arg_w, cols]
        args.append(arg)
        flags.append(flag)
    if best[k] >= big:
        return None
    cuts: list[int] = []
    rc: list[bool] = []
    j = k
    for s in range(s_total - 1, -1, -1):
        i = int(args[s][j])
        rc.append(bool(flags[s][j]))
        if s > 0:
            cuts.append(i - 1)
        j = i
    cuts.reverse()
    rc.reverse()
    return ChainAnswer(tuple(cuts), tuple(rc), problem.objective(cuts, rc))
