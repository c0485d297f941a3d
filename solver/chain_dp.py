"""Exact dynamic programs over a ChainProblem: the min-max seed, the least largest stage time,
and the least stage-time sum under a horizon on every stage's time.

All three run the same layered DP over "stage s ends at segment j"; they differ in what a stage
is worth and how stages combine (max or sum). A stage spans at most ``W`` segments
(:func:`_window`: ``K - S + 1``, as every other stage takes one at least, and fewer where the
parameter state of more already exceeds the largest cap), so the tables hold ``(K + 1) x W``
entries, one row per end segment, and the DP takes O(K W S) numpy element operations instead of
O(K^2 S); a DP stops as soon as no stage end is reachable. With one stage per rank
(``stages_per_rank == 1``) every stage's memory check is exact, so the DPs are exact; with more
stages per rank :func:`chain_min_max` relaxes it (each stage within its whole rank's cap) and
stays a lower bound, and :func:`chain_dp_hint` tightens it (each stage within ``cap / v``) and
stays feasible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autopart.core.errors import PlanError
from autopart.solver.chain import ChainAnswer, ChainProblem

__all__ = ["chain_dp_hint", "chain_min_max", "chain_min_sum"]

#: "No answer" in the DP tables; two of them still add up without int64 overflow.
_BIG = np.int64(2**61)


@dataclass(frozen=True, slots=True)
class _Options:
    """A stage's two options (0: keep activations, 1: recompute) over a band of spans.

    Each array is indexed ``[j - rows.start, e]`` for the stage holding segments
    ``first[j, e] .. j - 1`` (:class:`_Tables`): ``time`` its ``t_s``, ``mem`` its memory,
    ``fits`` the option is allowed (mode, valid range, memory within the stage's cap),
    ``hidden`` the W time it takes off.
    """

    time: tuple[np.ndarray, np.ndarray]
    mem: tuple[np.ndarray, np.ndarray]
    fits: tuple[np.ndarray, np.ndarray]
    hidden: tuple[np.ndarray, np.ndarray]


#: The attributes of :class:`_Tables` that depend only on :func:`_arrays_key`.
_ARRAY_NAMES = ("first", "in_b", "base_mem", "act", "act_kept", "rc_kept", "rc_act", "valid",
                "times", "modes")
#: The last tables' arrays, their band width and their key: the (kind, v) subproblems of one
#: microbatch count share them (the layout search seeds them count by count; a narrower band
#: is the last columns of a wider one), and each holds several (K + 1) x width arrays, so only
#: one set is kept.
_LAST_ARRAYS: list[tuple[tuple[object, ...], int, dict[str, Any]]] = []


def _narrowed(arrays: dict[str, Any], drop: int) -> dict[str, Any]:
    """The band ``arrays`` (:data:`_ARRAY_NAMES`) without their first ``drop`` columns: the
    band ``drop`` narrower, as each row's starts are its columns' in ascending order."""
    if drop == 0:
        return arrays
    out = {name: a[:, drop:] if isinstance(a, np.ndarray) else a for name, a in arrays.items()}
    out["times"] = {r: tuple(a[:, drop:] for a in ts) for r, ts in arrays["times"].items()}
    return out


def _arrays_key(problem: ChainProblem) -> tuple[object, ...]:
    """What :class:`_Tables`' arrays are made of: the segments' times and bytes, the ranks
    and their speeds, the recompute mode (not the kind's weights, in-flight counts or caps,
    which :meth:`_Tables.stage` reads from the problem)."""
    placed = (None if problem.speed is None
              else (problem.stages_per_rank, problem.placement))  # which ranks' speeds
    return (problem.seg_time, problem.seg_fwd, problem.cut_out, problem.cut_in,
            problem.num_ranks, problem.speed, placed, problem.seg_state, problem.seg_saved,
            problem.cut_bytes, problem.first_in_bytes, problem.last_out_bytes,
            problem.recompute, problem.seg_bwd_weight, problem.outputs_held,
            problem.seg_split, problem.seg_rc_kept)


def _window(problem: ChainProblem, cap_divisor: int) -> int:
    """The most segments a stage can span in any answer that passes the per-stage caps.

    ``K - S + 1`` (every other stage takes one segment at least), lowered where a span's
    parameter state alone exceeds the largest rank cap divided by ``cap_divisor`` (a stage's
    memory in either option is at least its state: every other term is >= 0), never below 1.
    """
    k = problem.num_segments
    width = k - problem.num_stages + 1
    if problem.rank_caps is not None and problem.seg_state is not None and width > 1:
        cap = max(problem.rank_caps) // cap_divisor
        pre = np.concatenate([np.zeros(1, dtype=np.int64),
                              np.cumsum(np.array(problem.seg_state, dtype=np.int64))])
        # for each end j, the first start i whose span's state fits: pre[j] - pre[i] <= cap
        lowest = np.searchsorted(pre, pre[1:] - cap, side="left")
        width = min(width, max(int(np.max(np.arange(1, k + 1) - lowest)), 1))
    return width


class _Tables:
    """Prefix sums of one chain problem and each stage's options over a band of spans.

    Every array has shape ``(K + 1, width)``: row ``j`` is the end segment (the stage holds
    segments ``i .. j - 1``), column ``e`` the start ``i = j - width + e`` (``first[j, e]``,
    clipped to 0; ``valid`` says whether ``0 <= i < j``). Spans longer than ``width`` are left
    out: no answer that passes the caps has one (:func:`_window`).

    Args:
        problem: the chain problem.
        cap_divisor: a stage's memory must stay within its rank's cap divided by this (1: the
            whole cap, a relaxation when ``stages_per_rank > 1``; ``stages_per_rank``: a share,
            conservative).
    """

    def __init__(self, problem: ChainProblem, cap_divisor: int) -> None:
        self.problem = problem
        self.cap_divisor = cap_divisor
        self.width = _window(problem, cap_divisor)
        key = _arrays_key(problem)
        if _LAST_ARRAYS and _LAST_ARRAYS[0][0] == key and _LAST_ARRAYS[0][1] >= self.width:
            _, wide, arrays = _LAST_ARRAYS[0]
            self.__dict__.update(_narrowed(arrays, wide - self.width))
            return
        self._build(problem)
        _LAST_ARRAYS[:] = [(key, self.width, {name: self.__dict__[name] for name in _ARRAY_NAMES})]

    def _build(self, problem: ChainProblem) -> None:
        k, w = problem.num_segments, self.width
        zero = np.zeros(1, dtype=np.int64)
        ends = np.arange(k + 1, dtype=np.int64)[:, None]
        starts = ends - w + np.arange(w, dtype=np.int64)[None, :]
        self.valid = starts >= 0        # and starts < ends by construction
        self.first = np.maximum(starts, 0)

        def prefix(values: list[int] | tuple[int, ...]) -> np.ndarray:
            return np.concatenate([zero, np.cumsum(np.array(values, dtype=np.int64))])

        def span(pre: np.ndarray) -> np.ndarray:  # [j, e] = sum of segments first[j, e] .. j - 1
            return pre[:, None] - pre[self.first]

        cross = list(problem.cut_bytes or [0] * (k - 1))
        self.in_b = np.array([problem.first_in_bytes, *cross], dtype=np.int64)[self.first]  # by i
        out_b = np.array([0, *cross, problem.last_out_bytes], dtype=np.int64)[:, None]  # by j
        self.base_mem = span(prefix(problem.seg_state or [0] * k)) + self.in_b + out_b
        self.act = span(prefix(problem.seg_saved or [0] * k))
        # held per microbatch in flight without recompute: the saved set, and the outputs
        # where the cost model holds them (ChainProblem.outputs_held)
        self.act_kept = self.act + out_b * problem.outputs_held
        # what a recomputing stage still holds per microbatch in flight beyond its inputs,
        # which its backward trades for the saved set (the selective policy; 0 under "full")
        self.rc_kept = span(prefix(problem.seg_rc_kept or [0] * k))
        self.rc_act = self.act - self.rc_kept
        cin = np.array([0, *problem.cut_in], dtype=np.int64)[self.first]
        cout = np.array([0, *problem.cut_out, 0], dtype=np.int64)[:, None]
        # per rank (ranks of equal speed share): times without and with recompute, W, and
        # what a split backward adds
        Times = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
        self.times: dict[int, Times] = {}
        by_speed: dict[float, Times] = {}
        for r in sorted({problem.rank_of(s) for s in range(problem.num_stages)}):
            f = 1.0 if problem.speed is None else problem.speed[r]
            if f not in by_speed:
                t0 = span(prefix(problem.seg_time_on(r))) + cin + cout
                by_speed[f] = (t0, t0 + span(prefix(problem.seg_fwd_on(r))),
                               span(prefix(problem.seg_bwd_weight_on(r))),
                               span(prefix(problem.seg_split_on(r))))
            self.times[r] = by_speed[f]
        self.modes = {"none": (True, False), "all": (False, True),
                      "auto": (True, True)}[problem.recompute]

    def stage(self, s: int, rows: slice) -> _Options:
        """Stage ``s``'s options over the end segments ``rows`` (every start in the band)."""
        prob = self.problem
        kk = prob.in_flight_of(s)
        bm, ok = self.base_mem[rows], self.valid[rows]
        mem0 = bm + kk * self.act_kept[rows]
        mem1 = bm + kk * (self.in_b[rows] + self.rc_kept[rows]) + self.rc_act[rows]
        r = prob.rank_of(s)
        t0, t1, w, split = (a[rows] for a in self.times[r])
        # the stages whose backward splits pay what the split adds (ChainProblem.seg_split)
        if prob.hides_weight(s, False):
            t0 = t0 + split
        if prob.hides_weight(s, True):
            t1 = t1 + split
        cap = None if prob.rank_caps is None else prob.rank_caps[r] // self.cap_divisor
        none = np.zeros_like(ok)
        ok0 = (ok if cap is None else ok & (mem0 <= cap)) if self.modes[0] else none
        ok1 = (ok if cap is None else ok & (mem1 <= cap)) if self.modes[1] else none
        zero = np.zeros_like(w)
        return _Options(time=(t0, t1), mem=(mem0, mem1), fits=(ok0, ok1),
                        hidden=(w if prob.hides_weight(s, False) else zero,
                                w if prob.hides_weight(s, True) else zero))


def _layered_dp(tables: _Tables, value: str, combine: str,
                horizon: int | None = None) -> tuple[int, ChainAnswer | None]:
    """The layered DP: the best ``combine`` ("max" or "sum") over stages of each stage's best
    option's ``value`` ("time", "mem" or "sum_term" = ``w_sum * t - hidden``), options whose
    time exceeds ``horizon`` left out. A stage takes option 1 (recompute) only when strictly
    better; ties keep the smallest first segment, so answers are deterministic.

    Returns:
        The optimal combined value (``_BIG`` when nothing is allowed) and its answer (None then).
    """
    prob = tables.problem
    k, s_total = prob.num_segments, prob.num_stages
    best = np.full(k + 1, _BIG, dtype=np.int64)
    best[0] = 0
    args: list[np.ndarray] = []
    flags: list[np.ndarray] = []
    # Stage s (0-based) ends before j in [s + 1, K - (S - s - 1)] (every stage takes one
    # segment at least); it starts where stage s - 1 ended (best is _BIG elsewhere).
    for s in range(s_total):
        j0, j1 = s + 1, k - (s_total - s - 1) + 1
        rows = slice(j0, j1)
        opt = tables.stage(s, rows)
        first = tables.first[rows]
        vals = []
        for o in (0, 1):
            ok = opt.fits[o] if horizon is None else opt.fits[o] & (opt.time[o] <= horizon)
            v = {"time": opt.time[o], "mem": opt.mem[o],
                 "sum_term": prob.w_sum * opt.time[o] - opt.hidden[o]}[value]
            vals.append(np.where(ok, v, _BIG))
        use1 = vals[1] < vals[0]
        val = np.minimum(vals[0], vals[1])
        prev = best[first]
        if combine == "max":
            cand = np.maximum(prev, val)
        else:
            cand = np.minimum(prev + val, _BIG)
        cand[prev >= _BIG] = _BIG
        at = np.arange(j1 - j0)
        arg_e = np.argmin(cand, axis=1)  # the first minimum: the smallest start
        best = np.full(k + 1, _BIG, dtype=np.int64)
        best[j0:j1] = cand[at, arg_e]
        if not (best < _BIG).any():
            return int(_BIG), None  # no stage s ends anywhere: nothing passes
        arg = np.zeros(k + 1, dtype=np.int64)
        arg[j0:j1] = first[at, arg_e]
        flag = np.zeros(k + 1, dtype=bool)
        flag[j0:j1] = use1[at, arg_e]
        args.append(arg)
        flags.append(flag)
    if best[k] >= _BIG:
        return int(_BIG), None
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
    return int(best[k]), ChainAnswer(tuple(cuts), tuple(rc), prob.objective(cuts, rc))


def chain_dp_hint(problem: ChainProblem) -> ChainAnswer | None:
    """A fast answer to ``problem`` for seeding CP-SAT: exact min-max by dynamic programming.

    Minimises the largest per-stage value (stage time ``t_s`` for ``"speed"``, stage memory for
    ``"memory"``), ignoring the rank-load and sum terms of the objective. Each stage recomputes
    only when it must to fit (``"auto"``). Memory is checked per stage against its rank's cap
    divided by ``stages_per_rank``, which is exact for one stage per rank and conservative
    otherwise. Vectorised with numpy: O(K W S) element operations (``W`` the band width,
    at most ``K - S + 1``).

    Returns:
        The DP's cuts and recompute flags with ``problem.objective`` of them, or None when no
        partition passes the per-stage caps.
    """
    tables = _Tables(problem, problem.stages_per_rank)
    _, answer = _layered_dp(tables, "mem" if problem.optimize == "memory" else "time", "max")
    return answer


def chain_min_max(problem: ChainProblem) -> int | None:
    """The least largest stage time ``max_s t_s`` over every answer that fits the caps.

    Exact with one stage per rank; with ``stages_per_rank > 1`` each stage is only held within
    its whole rank's cap (a rank's stages all hold memory >= 0, so every answer that fits
    passes), which makes the value a lower bound. Either way no fitting answer has a smaller
    largest stage time. The ``optimize`` target is ignored: this is always about time.

    Returns:
        The value (integer time units), or None when no answer passes (then none fits).
    """
    value, answer = _layered_dp(_Tables(problem, 1), "time", "max")
    return None if answer is None else value


def chain_min_sum(problem: ChainProblem, horizon: int | None = None) -> tuple[int, ChainAnswer] | None:
    """The least ``sum_s (w_sum * t_s - W_s)`` (``W_s`` the weight-gradient time stage s hides,
    :meth:`ChainProblem.hides_weight`) over the answers that fit the caps and keep every
    ``t_s <= horizon`` (``None``: no horizon). Exact, for one stage per rank.

    With ``a = w_stage + w_rank`` the objective of such an answer is ``a * max_s t_s`` plus
    this sum, so ``a * T + chain_min_sum(problem, T)`` is the best objective among answers
    whose largest stage time is at most ``T`` only up to ``a * (T - max_s t_s)``: the search
    over ``T`` in :func:`autopart.solver.chain_bound.threshold_search` uses that.

    Returns:
        ``(least sum, an answer reaching it)`` or None when no answer passes.

    Raises:
        PlanError: ``stages_per_rank > 1`` (a rank's memory spans several stages, which this
            DP cannot check).
    """
    if problem.stages_per_rank != 1:
        raise PlanError(f"chain_min_sum needs one stage per rank, not stages_per_rank="
                        f"{problem.stages_per_rank}")
    value, answer = _layered_dp(_Tables(problem, 1), "sum_term", "sum", horizon)
    return None if answer is None else (value, answer)
