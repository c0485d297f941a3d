"""Step 2 of solve(): CP-SAT refines the most promising seeded subproblems, with their bounds.

Subproblems are ranked by the exact cost of their DP seed; CP-SAT refines the
``max_cpsat_solves`` best on the full objective (per-stage recompute included). Big ones
(more than ``_BAND_ABOVE`` segment x stage pairs) are searched only in a band of +-2 stages
around their seed, at most ``_BIG_SOLVES`` of them and for a shorter deterministic time; their
bound is then :func:`relaxation_bound`, a relaxation of that one subproblem.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from autopart.core.errors import InfeasiblePlanError
from autopart.solver._evaluate import evaluate
from autopart.solver._subproblems import Setup, Subproblem
from autopart.solver.chain import ChainProblem
from autopart.solver.chain_cpsat import ChainResult, solve_chain_cpsat
from autopart.solver.options import SolveOptions

__all__ = ["search", "is_big", "relaxation_bound"]

#: Above this many x[i, s] pairs CP-SAT searches a band of +-2 stages around the seed.
_BAND_ABOVE = 20_000
#: How many such big subproblems CP-SAT refines, and its deterministic time on each. On the
#: 175B-shaped graph (K = 388 segments, 64 ranks) CP-SAT's presolve and loading of the DP
#: hint alone take about 1 deterministic second (several wall seconds on 2 cores) and 2.0
#: improves the DP seed by < 0.1%, so the big ones get one short, reproducible search.
_BIG_SOLVES = 1
_BIG_DETERMINISTIC_TIME = 1.0


def search(st: Setup, subs: list[Subproblem]) -> tuple[list[Subproblem], float]:
    """CP-SAT on the most promising subproblems.

    Args:
        st: the solve's setup.
        subs: every seeded subproblem (:func:`autopart.solver._subproblems.subproblems`).

    Returns:
        The subproblems with an answer (CP-SAT's, else their seed), best seed first, and the
        CP-SAT wall time spent, seconds. Equal chain problems are solved once; a subproblem
        CP-SAT proves infeasible is dropped.
    """
    options = st.options
    wall = 0.0
    scored = sorted(range(len(subs)), key=lambda i: _seed_score(st, subs[i]))
    solved: list[Subproblem] = []
    results: dict[ChainProblem, ChainResult | None] = {}
    big_solves = 0
    for rank_i, i in enumerate(scored):
        sub = subs[i]
        if rank_i < options.max_cpsat_solves and (sub.problem in results
                                                  or not is_big(sub)
                                                  or big_solves < _BIG_SOLVES):
            if sub.problem not in results:
                big_solves += is_big(sub)
                try:
                    res: ChainResult | None = _refine(sub, options)
                except InfeasiblePlanError:
                    res = None
                results[sub.problem] = res
                wall += res.wall_s if res is not None else 0.0
            res = results[sub.problem]
            if res is None:
                continue
            sub = replace(sub, result=res)
        if sub.result is None and sub.seed is None:
            continue
        solved.append(sub)
    return solved, wall


def is_big(sub: Subproblem) -> bool:
    """Whether CP-SAT searches ``sub`` banded (more than ``_BAND_ABOVE`` x[i, s] pairs)."""
    return (sub.problem.num_segments * sub.problem.num_stages > _BAND_ABOVE
            and sub.seed is not None)


def relaxation_bound(prob: ChainProblem) -> int:
    """A lower bound on ``prob``'s objective valid for every answer: each stage and rank
    carries at least its share of the fastest segment times, communication counted as 0,
    and (ZB-H1) every segment's weight-gradient time taken off.

    It is the bound (and so the gap) a plan reports when its subproblem was solved banded
    (``solver.name == "cp-sat-band+relaxation-bound"``), and whenever it is tighter than
    CP-SAT's own bound: a relaxation of that one (kind, v, m) closed-form objective (perfect
    balance, no sends, no recompute), not a bound over other microbatch counts or kinds and
    not the simulator's step time."""
    if prob.optimize == "memory":
        return -(-sum(prob.seg_state or (0,)) // prob.num_ranks)
    fast = [min(prob.seg_time_on(r)[i] for r in range(prob.num_ranks))
            for i in range(prob.num_segments)]
    total = sum(fast)
    per_stage = max(-(-total // prob.num_stages), max(fast))
    # at most every segment's W is hidden (stage 0's is not, nor those of stages whose
    # backward does not split: ChainProblem.hides_weight)
    hidden = sum(max(prob.seg_bwd_weight_on(r)[i] for r in range(prob.num_ranks))
                 for i in range(prob.num_segments))
    return (prob.w_stage * per_stage + prob.w_rank * -(-total // prob.num_ranks)
            + prob.w_sum * total - hidden)


def _seed_score(st: Setup, sub: Subproblem) -> tuple[float, int, int]:
    """Rank of a subproblem for CP-SAT: its seed's exact cost (time or peak), then m, v."""
    if sub.seed is None:
        return (math.inf, sub.m, sub.v)
    cand = evaluate(st.model, st.cands, sub.kind, sub.problem.num_ranks, sub.v, sub.m, sub.seed,
                    None, sub=sub)
    primary = cand.step_us if st.options.optimize == "speed" else float(cand.max_peak)
    return (primary, sub.m, sub.v)


def _refine(sub: Subproblem, options: SolveOptions) -> ChainResult:
    """One CP-SAT solve of ``sub`` (banded when big) with the tighter of the two bounds;
    under ``"memory"`` a second solve for time with the largest rank held at its minimum."""
    big = is_big(sub)
    kw: dict[str, Any] = {"time_limit_s": options.time_limit_s,
                          "deterministic_time": (min(options.deterministic_time,
                                                     _BIG_DETERMINISTIC_TIME) if big
                                                 else options.deterministic_time),
                          "band": 2 if big else None}
    res = solve_chain_cpsat(sub.problem, sub.seed, **kw)
    if big or res.status == "HINT":
        # CP-SAT's bound covers the band only, or CP-SAT stopped before searching: use the
        # subproblem's relaxation bound instead.
        res = replace(res, bound=min(res.objective, relaxation_bound(sub.problem)))
    else:
        # Both are lower bounds on this subproblem; report the tighter.
        res = replace(res, bound=min(res.objective, max(res.bound, relaxation_bound(sub.problem))))
    if sub.problem.optimize == "memory":
        # Then the step time with the largest rank's memory held at its minimum.
        caps = tuple(min(c, res.objective) for c in sub.problem.rank_caps or (res.objective,)
                     * sub.problem.num_ranks)
        timed = replace(sub.problem, optimize="speed", rank_caps=caps)
        hint = replace(res.answer, objective=timed.time_objective(res.answer.cuts,
                                                                   res.answer.recompute))
        second = solve_chain_cpsat(timed, hint, **kw)
        res = replace(second, status=res.status, bound=res.bound,
                      answer=replace(second.answer, objective=res.objective),
                      wall_s=res.wall_s + second.wall_s)
    return res
