"""The chain partition as CP-SAT models: min-max with weight caps, and the full ChainProblem."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.solver.chain import ChainAnswer, ChainProblem
from autopart.solver.partition_dp import check_chain, stage_costs

__all__ = ["CpSatResult", "ChainResult", "partition_cpsat", "solve_chain_cpsat", "greedy_cuts"]


@dataclass(frozen=True, slots=True)
class CpSatResult:
    """What one CP-SAT solve of the chain partition returned.

    Attributes:
        objective: largest stage cost of the returned cuts (integer cost units).
        bound: CP-SAT's best lower bound on it (equal to ``objective`` when OPTIMAL).
        status: CP-SAT status name, ``"OPTIMAL"`` or ``"FEASIBLE"``.
        wall_s: solver wall time, seconds.
        cuts: ascending cut indices, ``i`` meaning "cut after segment i".
    """

    objective: int
    bound: int
    status: str
    wall_s: float
    cuts: tuple[int, ...]


def greedy_cuts(seg_cost: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """A quick balanced guess used as the CP-SAT hint: fill each stage up to an even share.

    Stage ``s`` takes segments while its sum stays nearest ``remaining / remaining_stages``,
    always leaving at least one segment for each later stage. Cut costs are ignored.

    Returns:
        ``num_stages - 1`` ascending cut indices ("cut after segment i").
    """
    k = len(seg_cost)
    cuts: list[int] = []
    start = 0
    remaining = sum(seg_cost)
    for s in range(num_stages - 1):
        target = remaining / (num_stages - s)
        last_allowed = k - (num_stages - s)  # last segment index this stage may end at
        acc, end = seg_cost[start], start
        while end < last_allowed and abs(acc + seg_cost[end + 1] - target) <= abs(acc - target):
            end += 1
            acc += seg_cost[end]
        cuts.append(end)
        remaining -= acc
        start = end + 1
    return tuple(cuts)


def partition_cpsat(seg_cost: Sequence[int], cut_cost: Sequence[int], num_stages: int,
                    cut_in_cost: Sequence[int] | None = None, *,
                    seg_weight: Sequence[int] | None = None,
                    cut_weight: Sequence[int] | None = None,
                    weight_cap: int | Sequence[int] | None = None,
                    time_limit_s: float = 10.0, num_workers: int = 1,
                    random_seed: int = 0) -> CpSatResult:
    """Split a chain of K segments into exactly S non-empty contiguous stages with CP-SAT,
    minimising the largest stage cost (charged as in :func:`partition_dp.stage_costs`).

    Optionally each stage's weight (sum of ``seg_weight`` over its segments plus ``cut_weight``
    of the cut on each side of it) must stay within ``weight_cap`` (one cap, or one per stage);
    the memory-aware callers use bytes here.

    Args:
        seg_cost: per-segment integer cost, length K (e.g. 0.1 µs units).
        cut_cost: cost of cutting after segment ``i``, charged to the stage before the cut (and
            to the stage after it too unless ``cut_in_cost`` is given), length K - 1.
        num_stages: S, ``1 <= S <= K``.
        cut_in_cost: optional separate charge to the stage after each cut, length K - 1.
        seg_weight: per-segment weight, length K (required with ``weight_cap``).
        cut_weight: per-cut weight charged to both neighbouring stages, length K - 1
            (default zeros).
        weight_cap: largest allowed stage weight; ``None`` = no cap.
        time_limit_s: CP-SAT wall-clock limit, seconds (default 10).
        num_workers: CP-SAT search workers (default 1: deterministic).
        random_seed: CP-SAT seed (default 0).

    Returns:
        Objective, best bound, status name, wall time and cuts.

    Raises:
        PlanError: malformed input, or no solution was found within ``time_limit_s``.
        InfeasiblePlanError: ``S > K``, or no partition keeps every stage within ``weight_cap``.
    """
    # Data.
    check_chain(seg_cost, cut_cost, num_stages, cut_in_cost)
    k, s_total = len(seg_cost), num_stages
    cin = list(cut_cost if cut_in_cost is None else cut_in_cost)
    cout = list(cut_cost)
    caps: list[int] | None = None
    if weight_cap is not None:
        caps = [int(weight_cap)] * s_total if isinstance(weight_cap, int) else list(weight_cap)
        if seg_weight is None or len(seg_weight) != k or len(caps) != s_total:
            raise PlanError("weight_cap needs seg_weight of length K and one cap or S caps")
    wseg = list(seg_weight) if seg_weight is not None else [0] * k
    wcut = list(cut_weight) if cut_weight is not None else [0] * (k - 1)
    hint = greedy_cuts(seg_cost, s_total)
    horizon = sum(seg_cost) + sum(cout) + sum(cin)
    if caps is None or all(w <= c for w, c in zip(
            stage_costs(wseg, wcut, hint), caps, strict=True)):
        # The greedy answer is feasible, so the optimum is at most its cost: a stage s can only
        # hold segment i if segments 0..i fit in s + 1 stages and i..K-1 in S - s stages.
        horizon = max(stage_costs(seg_cost, cout, hint, cin))
    prefix = [0]
    for c in seg_cost:
        prefix.append(prefix[-1] + c)

    def allowed(i: int, s: int) -> bool:
        return (prefix[i + 1] <= (s + 1) * horizon
                and prefix[k] - prefix[i] <= (s_total - s) * horizon)

    model = cp_model.CpModel()
    # Variables.
    # x[i, s] = segment i is in stage s (only where stages 0..s-1 and s+1..S-1 can take the
    # segments before and after i, one each at least and each within the horizon).
    x: dict[tuple[int, int], cp_model.IntVar] = {}
    for i in range(k):
        for s in range(max(0, s_total - (k - i)), min(i, s_total - 1) + 1):
            if allowed(i, s):
                x[i, s] = model.new_bool_var(f"x[{i},{s}]")
    # e[i, s] = cut after segment i, with segment i the last of stage s (and i + 1 first of s + 1).
    e: dict[tuple[int, int], cp_model.IntVar] = {}
    for i in range(k - 1):
        for s in range(s_total - 1):
            if (i, s) in x and (i + 1, s + 1) in x:
                e[i, s] = model.new_bool_var(f"e[{i},{s}]")
    # max_cost = the largest stage cost (the objective).
    max_cost = model.new_int_var(0, horizon, "max_cost")

    # Constraints.
    # Each segment is in exactly one stage.
    for i in range(k):
        model.add_exactly_one(x[i, s] for s in range(s_total) if (i, s) in x)
    # Contiguity: first segment in stage 0, last in S - 1, and the stage index steps by 0 or 1
    # from one segment to the next (so every stage is non-empty).
    model.add(x[0, 0] == 1)
    model.add(x[k - 1, s_total - 1] == 1)
    for (i, s), var in x.items():
        if i + 1 < k:
            model.add_bool_or([x[i + 1, t] for t in (s, s + 1) if (i + 1, t) in x]
                              ).only_enforce_if(var)
        if i > 0:
            model.add_bool_or([x[i - 1, t] for t in (s - 1, s) if (i - 1, t) in x]
                              ).only_enforce_if(var)
    # e[i, s] is exactly "segment i ends stage s and segment i + 1 starts stage s + 1".
    for (i, s), var in e.items():
        model.add_implication(var, x[i, s])
        model.add_implication(var, x[i + 1, s + 1])
        model.add_bool_or([var, x[i, s].Not(), x[i + 1, s + 1].Not()])
    # Stage cost (segments + outgoing and incoming cut charges) is at most max_cost;
    # stage weight within its cap.
    for s in range(s_total):
        segs = [i for i in range(k) if (i, s) in x]
        outs = [i for i in range(k - 1) if (i, s) in e]
        ins = [i for i in range(k - 1) if (i, s - 1) in e]
        cost = (sum(seg_cost[i] * x[i, s] for i in segs)
                + sum(cout[i] * e[i, s] for i in outs)
                + sum(cin[i] * e[i, s - 1] for i in ins))
        model.add(cost <= max_cost)
        if caps is not None:
            weight = (sum(wseg[i] * x[i, s] for i in segs)
                      + sum(wcut[i] * e[i, s] for i in outs)
                      + sum(wcut[i] * e[i, s - 1] for i in ins))
            model.add(weight <= caps[s])

    # Objective.
    model.minimize(max_cost)
    stage = 0
    for i in range(k):
        for s in range(s_total):
            if (i, s) in x:
                model.add_hint(x[i, s], s == stage)
        if i in hint:
            stage += 1
    for (i, s), var in e.items():
        model.add_hint(var, i in hint and sum(1 for c in hint if c < i) == s)

    # Solve.
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = random_seed
    solver.parameters.max_time_in_seconds = time_limit_s
    t0 = time.perf_counter()
    status = solver.solve(model)
    wall_s = time.perf_counter() - t0

    # Read.
    if status == cp_model.INFEASIBLE:
        raise InfeasiblePlanError(
            f"no split of {k} segments into {s_total} stages keeps every stage's weight within "
            f"its cap {caps}; raise the cap or use more stages")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise PlanError(f"CP-SAT found no partition within time_limit_s={time_limit_s} "
                        f"(status {solver.status_name(status)}); raise time_limit_s")
    cuts = tuple(i for (i, _s), var in sorted(e.items()) if solver.boolean_value(var))
    objective = int(round(solver.objective_value))
    bound = min(objective, int(math.ceil(solver.best_objective_bound - 1e-9)))
    return CpSatResult(objective=objective, bound=bound, status=solver.status_name(status),
                       wall_s=wall_s, cuts=cuts)


@dataclass(frozen=True, slots=True)
class ChainResult:
    """What one CP-SAT solve of a :class:`ChainProblem` returned.

    Attributes:
        answer: the best cuts and recompute flags found (their objective included).
        status: CP-SAT status name (``"OPTIMAL"`` or ``"FEASIBLE"``), or ``"HINT"`` when CP-SAT
            returned nothing in its limits and the hint is kept.
        bound: CP-SAT's best lower bound on the objective (integer units).
        wall_s: solver wall time, seconds.
    """

    answer: ChainAnswer
    status: str
    bound: int
    wall_s: float

    @property
    def objective(self) -> int:
        """The answer's objective (integer units)."""
        return self.answer.objective


def solve_chain_cpsat(problem: ChainProblem, hint: ChainAnswer | None = None, *,
                      time_limit_s: float = 10.0, deterministic_time: float | None = None,
                      num_workers: int = 1, random_seed: int = 0,
                      band: int | None = None) -> ChainResult:
    """Solve a :class:`ChainProblem` exactly with CP-SAT (see its docstring for the model).

    Variables: ``x[i, s]`` segment i in stage s, ``e[i, s]`` the cut after segment i closes
    stage s, ``rc[s]`` stage s recomputes, ``t[s]`` stage time, ``mem[s]`` stage memory. The
    objective is linear in ``max t``, ``max rank load``, ``sum t`` and (ZB-H1) the hidden
    ``W`` of the stages after the first. With a feasible hint its
    value bounds every stage's time, which prunes ``x`` to a band (as in :func:`partition_cpsat`).

    Args:
        problem: the chain problem.
        hint: a starting answer (e.g. :func:`autopart.solver.partition_dp.chain_dp_hint`).
        time_limit_s: wall-clock limit, seconds (default 10); a safety net only.
        deterministic_time: CP-SAT's deterministic time limit (reproducible; ``None``: none).
        num_workers: CP-SAT workers (default 1: deterministic).
        random_seed: CP-SAT seed (default 0).
        band: with a hint, only let segment i sit within ``band`` stages of the hint's stage
            for it (a large-neighbourhood search for big problems); its bound then holds for
            that neighbourhood only and the status is reported as ``"FEASIBLE"``.

    Returns:
        The best answer, status, bound and wall time.

    Raises:
        InfeasiblePlanError: no answer keeps every rank within its cap.
        PlanError: CP-SAT found nothing within its limits and there is no feasible hint.
    """
    # Data.
    k, s_total, p = problem.num_segments, problem.num_stages, problem.num_ranks
    if hint is not None and not problem.fits(hint.cuts, hint.recompute):
        hint = None
    seg_t = {r: problem.seg_time_on(r) for r in range(p)}
    seg_f = {r: problem.seg_fwd_on(r) for r in range(p)}
    cross = list(problem.cut_bytes or [0] * (k - 1))
    state = list(problem.seg_state or [0] * k)
    saved = list(problem.seg_saved or [0] * k)
    fast = [min(seg_t[r][i] for r in range(p)) for i in range(k)]
    prefix = [0]
    for c in fast:
        prefix.append(prefix[-1] + c)
    upper = sum(max(seg_t[r][i] + seg_f[r][i] for r in range(p)) for i in range(k)) + sum(
        problem.cut_out) + sum(problem.cut_in)
    horizon = upper
    w_max = problem.w_stage + problem.w_rank
    seg_w = {r: problem.seg_bwd_weight_on(r) for r in range(p)}
    # the most W time the objective can take off (ZB-H1), so the horizon stays valid
    hidden_max = sum(max(seg_w[r][i] for r in range(p)) for i in range(k))
    if hint is not None and problem.optimize == "speed" and w_max > 0:
        horizon = min(upper, (hint.objective + hidden_max - problem.w_sum * prefix[k]) // w_max)

    hint_stage = ([sum(1 for c in hint.cuts if c < i) for i in range(k)]
                  if hint is not None and band is not None else None)

    def allowed(i: int, s: int) -> bool:
        if hint_stage is not None and abs(s - hint_stage[i]) > band:
            return False
        return prefix[i + 1] <= (s + 1) * horizon and prefix[k] - prefix[i] <= (s_total - s) * horizon

    model = cp_model.CpModel()
    # Variables.
    # x[i, s] = segment i is in stage s.
    x: dict[tuple[int, int], cp_model.IntVar] = {}
    for i in range(k):
        for s in range(max(0, s_total - (k - i)), min(i, s_total - 1) + 1):
            if allowed(i, s):
                x[i, s] = model.new_bool_var(f"x[{i},{s}]")
    # e[i, s] = cut after segment i, which ends stage s.
    e: dict[tuple[int, int], cp_model.IntVar] = {}
    for i in range(k - 1):
        for s in range(s_total - 1):
            if (i, s) in x and (i + 1, s + 1) in x:
                e[i, s] = model.new_bool_var(f"e[{i},{s}]")
    # rc[s] = stage s recomputes its forward in backward (constant unless mode "auto").
    rc: list[Any] = []
    for s in range(s_total):
        rc.append(model.new_bool_var(f"rc[{s}]") if problem.recompute == "auto"
                  else int(problem.recompute == "all"))
    # t[s] = stage time; max_t, max_load = the objective's max terms.
    t = [model.new_int_var(0, upper, f"t[{s}]") for s in range(s_total)]
    max_t = model.new_int_var(0, upper, "max_t")
    max_load = model.new_int_var(0, upper * problem.stages_per_rank, "max_load")

    # Constraints.
    # Each segment in exactly one stage; stages contiguous and in order (as partition_cpsat).
    for i in range(k):
        if not any((i, s) in x for s in range(s_total)):
            raise InfeasiblePlanError("no stage can hold segment "
                                      f"{i} within the hint's horizon")  # pragma: no cover
        model.add_exactly_one(x[i, s] for s in range(s_total) if (i, s) in x)
    model.add(x[0, 0] == 1)
    model.add(x[k - 1, s_total - 1] == 1)
    for (i, s), var in x.items():
        if i + 1 < k:
            model.add_bool_or([x[i + 1, u] for u in (s, s + 1) if (i + 1, u) in x]
                              ).only_enforce_if(var)
        if i > 0:
            model.add_bool_or([x[i - 1, u] for u in (s - 1, s) if (i - 1, u) in x]
                              ).only_enforce_if(var)
    for (i, s), var in e.items():
        model.add_implication(var, x[i, s])
        model.add_implication(var, x[i + 1, s + 1])
        model.add_bool_or([var, x[i, s].Not(), x[i + 1, s + 1].Not()])
    stage_segs = [[i for i in range(k) if (i, s) in x] for s in range(s_total)]
    outs = [[i for i in range(k - 1) if (i, s) in e] for s in range(s_total)]
    ins = [[i for i in range(k - 1) if (i, s - 1) in e] for s in range(s_total)]
    # Stage time: segments (+ recompute's forward) + outgoing and incoming cut charges.
    for s in range(s_total):
        r = problem.rank_of(s)
        base = (sum(seg_t[r][i] * x[i, s] for i in stage_segs[s])
                + sum(problem.cut_out[i] * e[i, s] for i in outs[s])
                + sum(problem.cut_in[i] * e[i, s - 1] for i in ins[s]))
        fwd = sum(seg_f[r][i] * x[i, s] for i in stage_segs[s])
        if isinstance(rc[s], int):
            model.add(t[s] == base + (fwd if rc[s] else 0))
        else:
            model.add(t[s] == base + fwd).only_enforce_if(rc[s])
            model.add(t[s] == base).only_enforce_if(rc[s].Not())
        model.add(t[s] <= max_t)
    for r in range(p):
        model.add(sum(t[r::p]) <= max_load)
    # Stage memory: state + crossing in/out + in-flight activations (or inputs, recomputing).
    mem: list[cp_model.IntVar] = []
    if problem.has_memory:
        mem_upper = (sum(state) + 2 * (sum(cross) + problem.first_in_bytes + problem.last_out_bytes)
                     + max(problem.in_flight or (1,)) * (sum(saved) + sum(cross)
                                                         + problem.first_in_bytes) + sum(saved))
        for s in range(s_total):
            kk = problem.in_flight_of(s)
            cin_b = (sum(cross[i] * e[i, s - 1] for i in ins[s]) if s > 0
                     else problem.first_in_bytes)
            cout_b = (sum(cross[i] * e[i, s] for i in outs[s]) if s < s_total - 1
                      else problem.last_out_bytes)
            act = sum(saved[i] * x[i, s] for i in stage_segs[s])
            base = sum(state[i] * x[i, s] for i in stage_segs[s]) + cin_b + cout_b
            var = model.new_int_var(0, mem_upper, f"mem[{s}]")
            if isinstance(rc[s], int):
                model.add(var >= base + (kk * cin_b + act if rc[s] else kk * act))
            else:
                model.add(var >= base + kk * act).only_enforce_if(rc[s].Not())
                model.add(var >= base + kk * cin_b + act).only_enforce_if(rc[s])
            mem.append(var)
        if problem.rank_caps is not None:
            for r in range(p):
                model.add(sum(mem[r::p]) <= problem.rank_caps[r])

    # Objective.
    if problem.optimize == "memory":
        max_mem = model.new_int_var(0, mem_upper * problem.stages_per_rank, "max_mem")
        for r in range(p):
            model.add(sum(mem[r::p]) <= max_mem)
        model.minimize(max_mem)
    else:
        # ZB-H1: stage s >= 1 that does not recompute has its W off the critical path
        hidden: list[Any] = []
        hiding = range(1, s_total) if problem.seg_bwd_weight is not None else range(0)
        for s in hiding:
            w_s = sum(seg_w[problem.rank_of(s)][i] * x[i, s] for i in stage_segs[s])
            if isinstance(rc[s], int):
                if not rc[s]:
                    hidden.append(w_s)
                continue
            h = model.new_int_var(0, hidden_max, f"hidden_w[{s}]")
            model.add(h == w_s).only_enforce_if(rc[s].Not())
            model.add(h == 0).only_enforce_if(rc[s])
            hidden.append(h)
        model.minimize(problem.w_stage * max_t + problem.w_rank * max_load
                       + problem.w_sum * sum(t) - sum(hidden))
    if hint is not None:
        stage = 0
        for i in range(k):
            for s in range(s_total):
                if (i, s) in x:
                    model.add_hint(x[i, s], s == stage)
            if i in hint.cuts:
                stage += 1
        for (i, s), var in e.items():
            model.add_hint(var, i in hint.cuts and hint.cuts.index(i) == s)
        for s, var in enumerate(rc):
            if not isinstance(var, int):
                model.add_hint(var, hint.recompute[s])

    # Solve.
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = random_seed
    solver.parameters.max_time_in_seconds = time_limit_s
    if deterministic_time is not None:
        solver.parameters.max_deterministic_time = deterministic_time
    t0 = time.perf_counter()
    status = solver.solve(model)
    wall_s = time.perf_counter() - t0

    # Read.
    if status == cp_model.INFEASIBLE and hint is None:
        raise InfeasiblePlanError(
            f"no split of {k} segments into {s_total} stages keeps every rank within its cap "
            f"{list(problem.rank_caps or [])}; raise the cap or use more ranks")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint is None:
            raise PlanError(f"CP-SAT found no partition within its limits (status "
                            f"{solver.status_name(status)}); raise time_limit_s")
        return ChainResult(hint, "HINT", 0, wall_s)
    cuts = tuple(i for (i, _s), var in sorted(e.items()) if solver.boolean_value(var))
    flags = tuple(bool(v) if isinstance(v, int) else solver.boolean_value(v) for v in rc)
    answer = ChainAnswer(cuts, flags, problem.objective(cuts, flags))
    bound = min(answer.objective, int(math.ceil(solver.best_objective_bound - 1e-9)))
    name = solver.status_name(status)
    if hint_stage is not None:
        name, bound = "FEASIBLE", 0
    return ChainResult(answer, name, bound, wall_s)
