"""Refinement of the seeded subproblems: threshold search, CP-SAT, and bounds on their optimum.

Subproblems are ranked by the exact cost of their DP seed; the ``max_cpsat_solves`` best are
refined on the full objective (per-stage recompute included): one stage per rank (speed) by
the threshold search of :mod:`autopart.solver.chain_bound`, whose bound is exact up to its
stopping gap and which leaves CP-SAT out where it cannot pay; then CP-SAT. Big subproblems
(more than ``_BAND_ABOVE`` segment x stage pairs) are refined for at most ``_BIG_SOLVES`` of
them, and CP-SAT searches those only in a band of +-2 stages around their seed for a shorter
deterministic time, so its own bound is not used for them.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from autopart.core.errors import InfeasiblePlanError
from autopart.solver._candidate import evaluate
from autopart.solver._problem_grid import Setup, Subproblem
from autopart.solver.chain import ChainProblem
from autopart.solver.chain_bound import relaxation_bound, stage_time_bound, threshold_search
from autopart.solver.chain_cpsat import ChainResult, SearchLimitError, solve_chain_cpsat
from autopart.solver.chain_dp import chain_dp_hint
from autopart.solver.options import SolveOptions

__all__ = ["search", "is_big"]

#: Above this many x[i, s] pairs CP-SAT searches a band of +-2 stages around the seed.
_BAND_ABOVE = 20_000
#: How many such big subproblems are refined, and CP-SAT's deterministic time on each: on
#: big graphs CP-SAT's presolve and hint loading alone take most of that time, and the
#: threshold search already proves its answer optimal (``benchmarks/solver_scale``).
_BIG_SOLVES = 2
_BIG_DETERMINISTIC_TIME = 1.0
#: A big subproblem whose threshold-search gap is at most this skips CP-SAT's banded search.
_BIG_ENOUGH_GAP = 0.01
#: The threshold search's budget (DPs) and the gap at which it stops.
_THRESHOLD_EVALUATIONS = 16
_THRESHOLD_GAP = 1e-3


def search(st: Setup, subs: list[Subproblem]) -> tuple[list[Subproblem], float, int]:
    """Refine the most promising subproblems (threshold search, CP-SAT).

    Args:
        st: the solve's setup.
        subs: every seeded subproblem (:func:`autopart.solver._problem_grid.subproblems`).

    Returns:
        The subproblems with an answer (refined, else their seed), best seed first, the
        wall time spent refining, seconds, and how many refinements stopped at CP-SAT's
        limits with nothing that fits. Equal chain problems are solved once; a subproblem
        CP-SAT proves infeasible, or finds no answer to within its limits without a seed
        that fits, is dropped, and the next seed is refined in its place (at most
        ``2 * max_cpsat_solves`` refinements).
    """
    options = st.options
    wall = 0.0
    scored = sorted(range(len(subs)), key=lambda i: _seed_score(st, subs[i]))
    solved: list[Subproblem] = []
    results: dict[ChainProblem, ChainResult | None] = {}
    big_solves = slots = tried = stopped = 0
    for i in scored:
        sub = subs[i]
        # the max_cpsat_solves best seeds have a slot each; one whose refinement gets no
        # answer passes its slot to the next seed, up to twice that many solves in all
        if slots < options.max_cpsat_solves and tried < 2 * options.max_cpsat_solves:
            slots += 1
            if sub.problem in results or not is_big(sub) or big_solves < _BIG_SOLVES:
                if sub.problem not in results:
                    big_solves += is_big(sub)
                    tried += 1
                    try:
                        res: ChainResult | None = _tightened(st, sub, _refine(sub, options))
                    except InfeasiblePlanError as exc:
                        # nothing fits, or CP-SAT found nothing in its limits (and no seed
                        # fits): the other subproblems (m, v, schedule) may have answers
                        stopped += isinstance(exc, SearchLimitError)
                        res = None
                    results[sub.problem] = res
                    wall += res.wall_s if res is not None else 0.0
                res = results[sub.problem]
                if res is None:
                    slots -= 1
                    continue
                sub = replace(sub, result=res)
        if sub.result is None and sub.seed is None:
            continue
        solved.append(sub)
    return solved, wall, stopped


#: How many times an answer over a rank's cap on the exact evaluation is searched again.
_TIGHTEN_ROUNDS = 3


def _tightened(st: Setup, sub: Subproblem, res: ChainResult) -> ChainResult:
    """``res``, or where its answer is over a rank's cap on the exact evaluation
    (:func:`autopart.solver._candidate.evaluate`), the answer to ``sub`` with each such
    rank's chain cap lowered to its cap less what the exact evaluation added to the chain's
    figure for that answer (which the answer then no longer fits), searched again (at most
    ``_TIGHTEN_ROUNDS`` times; the last answer is kept where none fits).

    The chain problem prices a stage's memory more simply than the exact evaluation (no
    receive or gradient buffers, one transient for every rank), and can find an answer
    that fits it but not the exact costs. That answer is then dropped when the candidates
    are costed, and the subproblem offered nothing: on a 6-layer GPT-2 under a cap, the
    ``"op"`` policy's search answered a cut whose last rank was 1.9 MiB over, and its plan
    fell back to a baseline's cuts, 11 % slower than the full policy's plan. The bound
    kept is the first search's (the lowered caps only remove answers)."""
    prob = sub.problem
    if not st.caps or prob.rank_caps is None:
        return res
    first = res
    for _ in range(_TIGHTEN_ROUNDS):
        cand = evaluate(st.model, st.cands, sub.kind, prob.num_ranks, sub.v, sub.m, res.answer,
                        st.caps, sub=sub)
        if cand.fits:
            break
        # a rank over its cap may hold, by the chain's pricing, at most its cap less what the
        # exact evaluation adds to the chain's figure for this answer
        chain = prob.rank_memory(res.answer.cuts, res.answer.recompute)
        prob = replace(prob, rank_caps=tuple(
            max(min(c, cap - (peak - mem)), 0) if peak > cap else c
            for c, cap, peak, mem in zip(prob.rank_caps, st.caps, cand.peaks, chain,
                                         strict=True)))
        try:
            again = _refine(replace(sub, problem=prob, seed=chain_dp_hint(prob)), st.options)
        except InfeasiblePlanError:
            break
        res = replace(again, wall_s=res.wall_s + again.wall_s)
    if res is first:
        return res
    bound = min(first.bound, res.objective)
    return replace(res, bound=bound, status="OPTIMAL" if bound >= res.objective
                   else "FEASIBLE")


def is_big(sub: Subproblem) -> bool:
    """Whether CP-SAT searches ``sub`` banded (more than ``_BAND_ABOVE`` x[i, s] pairs)."""
    return (sub.problem.num_segments * sub.problem.num_stages > _BAND_ABOVE
            and sub.seed is not None)


def _seed_score(st: Setup, sub: Subproblem) -> tuple[float, int, int]:
    """Rank of a subproblem for CP-SAT: its seed's exact cost (time or peak), then m, v."""
    if sub.seed is None:
        return (math.inf, sub.m, sub.v)
    cand = evaluate(st.model, st.cands, sub.kind, sub.problem.num_ranks, sub.v, sub.m, sub.seed,
                    None, sub=sub)
    primary = cand.step_us if st.options.optimize == "speed" else float(cand.max_peak)
    return (primary, sub.m, sub.v)


def _refine(sub: Subproblem, options: SolveOptions) -> ChainResult:
    """The best answer to ``sub`` and the tightest lower bound on its optimum.

    Speed, one stage per rank: :func:`~autopart.solver.chain_bound.threshold_search` first
    (its answer seeds CP-SAT); CP-SAT is skipped where it cannot pay: the threshold search
    stopped at its own gap (``_THRESHOLD_GAP``, 0.1 %: its answer is within that of the
    optimum, and CP-SAT's few seconds there bought 0.003 % on the 1008B GPT of
    ``benchmarks/megatron_table``), or the subproblem is big (CP-SAT would search a band only)
    and the gap is within ``_BIG_ENOUGH_GAP``. More stages per rank:
    :func:`~autopart.solver.chain_bound.stage_time_bound`. The reported bound is the largest
    of these, :func:`~autopart.solver.chain_bound.relaxation_bound` and CP-SAT's own (when it
    searched the whole problem), and ``method`` names where it came from. Under ``"memory"`` a
    second solve for time with the largest rank held at its minimum."""
    prob = sub.problem
    big = is_big(sub)
    t0 = time.perf_counter()
    hint = sub.seed
    bounds = [(relaxation_bound(prob), "relaxation")]
    thr = None
    if prob.optimize == "speed" and prob.stages_per_rank == 1:
        thr = threshold_search(prob, sub.seed, max_evaluations=_THRESHOLD_EVALUATIONS,
                               rel_gap=_THRESHOLD_GAP)
        if thr is not None:
            hint = thr.answer
            bounds.append((thr.bound, "threshold"))
    elif prob.optimize == "speed":
        stb = stage_time_bound(prob)
        if stb is not None:
            bounds.append((stb, "stage-time"))
    dp_wall = time.perf_counter() - t0
    if thr is not None and thr.gap <= (_BIG_ENOUGH_GAP if big else _THRESHOLD_GAP):
        proven = thr.bound >= thr.answer.objective
        return ChainResult(thr.answer, "OPTIMAL" if proven else "FEASIBLE", thr.bound, dp_wall,
                           method="dp+threshold-bound")
    kw: dict[str, Any] = {"time_limit_s": options.time_limit_s,
                          "deterministic_time": (min(options.deterministic_time,
                                                     _BIG_DETERMINISTIC_TIME) if big
                                                 else options.deterministic_time),
                          "band": 2 if big else None}
    res = solve_chain_cpsat(prob, hint, **kw)
    if hint is not None and hint.objective < res.objective and prob.optimize == "speed":
        res = replace(res, answer=hint)  # CP-SAT stopped before reaching its hint
    # CP-SAT's own bound covers the band only when banded, and nothing when it stopped
    # before searching (status HINT); ties keep CP-SAT's.
    own = [] if big or res.status == "HINT" else [(res.bound, "cp-sat")]
    bound, source = max(own + bounds, key=lambda b: b[0])
    bound = min(bound, res.objective)
    search = "cp-sat-band" if big else "cp-sat"
    res = replace(res, bound=bound, wall_s=res.wall_s + dp_wall,
                  status="OPTIMAL" if bound >= res.objective else res.status,
                  method=search if source == "cp-sat" else f"{search}+{source}-bound")
    if prob.optimize == "memory":
        # Then the step time with the largest rank's memory held at its minimum.
        caps = tuple(min(c, res.objective) for c in prob.rank_caps or (res.objective,)
                     * prob.num_ranks)
        timed = replace(prob, optimize="speed", rank_caps=caps)
        first = replace(res.answer, objective=timed.time_objective(res.answer.cuts,
                                                                    res.answer.recompute))
        second = solve_chain_cpsat(timed, first, **kw)
        res = replace(res, answer=replace(second.answer, objective=res.objective),
                      wall_s=res.wall_s + second.wall_s)
    return res
