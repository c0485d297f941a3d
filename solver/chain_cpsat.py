"""The full ChainProblem as a CP-SAT model: stage times, recompute, memory caps, ZB-H1's hidden W."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from autopart.core.errors import InfeasiblePlanError
from autopart.solver._contiguous_stages import (
    ChainModel,
    add_cut_hint,
    best_bound,
    build_chain_model,
    read_cuts,
    solve_model,
)
from autopart.solver.chain import ChainAnswer, ChainProblem

__all__ = ["ChainResult", "SearchLimitError", "solve_chain_cpsat"]


class SearchLimitError(InfeasiblePlanError):
    """CP-SAT stopped at its limits without an answer and there was no feasible hint: the
    chain problem may have one (nothing is proved infeasible). An
    :class:`InfeasiblePlanError`, so that whatever tries another option when nothing fits
    (another subproblem, layout or recompute policy) does so here too."""


@dataclass(frozen=True, slots=True)
class ChainResult:
    """What one solve of a :class:`ChainProblem` returned (CP-SAT's, or the solver's search
    around it: :func:`autopart.solver._refinement.search` tightens ``bound`` and sets ``method``).

    Attributes:
        answer: the best cuts and recompute flags found (their objective included).
        status: CP-SAT status name (``"OPTIMAL"`` or ``"FEASIBLE"``), or ``"HINT"`` when CP-SAT
            returned nothing in its limits and the hint is kept; ``"OPTIMAL"`` also when a
            bound proves the answer optimal.
        bound: a lower bound on the optimum (integer units): CP-SAT's best bound (0 when it
            covers a band only) unless ``method`` names another.
        wall_s: solver wall time, seconds.
        method: how the answer and bound were found: ``"cp-sat"``, or ``SEARCH+SOURCE-bound``
            (search ``cp-sat``, ``cp-sat-band`` or ``dp``; bound source ``threshold``,
            ``stage-time`` or ``relaxation``, see :mod:`autopart.solver.chain_bound`).
    """

    answer: ChainAnswer
    status: str
    bound: int
    wall_s: float
    method: str = "cp-sat"

    @property
    def objective(self) -> int:
        """The answer's objective (integer units)."""
        return self.answer.objective


@dataclass(frozen=True, slots=True)
class _Data:
    """Per-rank coefficients and the bounds the model's domains and pruning use.

    Attributes:
        seg_t, seg_f, seg_w, seg_x: per rank, segment time, recompute forward, W (ZB-H1)
            time and what a split backward adds (ZB-H1, stages after the first).
        prefix: prefix sums of each segment's fastest time, length K + 1.
        upper: an upper bound on any stage time (every segment and send on the slowest rank).
        horizon: a bound on every stage's time in an answer at least as good as the hint.
        hidden_max: the most W time the objective can take off.
    """

    seg_t: dict[int, list[int]]
    seg_f: dict[int, list[int]]
    seg_w: dict[int, list[int]]
    seg_x: dict[int, list[int]]
    prefix: list[int]
    upper: int
    horizon: int
    hidden_max: int

    @classmethod
    def of(cls, problem: ChainProblem, hint: ChainAnswer | None) -> _Data:
        k, p = problem.num_segments, problem.num_ranks
        seg_t = {r: problem.seg_time_on(r) for r in range(p)}
        seg_f = {r: problem.seg_fwd_on(r) for r in range(p)}
        seg_w = {r: problem.seg_bwd_weight_on(r) for r in range(p)}
        seg_x = {r: problem.seg_split_on(r) for r in range(p)}
        prefix = [0]
        for c in (min(seg_t[r][i] for r in range(p)) for i in range(k)):
            prefix.append(prefix[-1] + c)
        upper = sum(max(seg_t[r][i] + max(seg_f[r][i], seg_x[r][i]) for r in range(p))
                    for i in range(k)) + sum(
            problem.cut_out) + sum(problem.cut_in)
        horizon = upper
        w_max = problem.w_stage + problem.w_rank
        # the most W time the objective can take off (ZB-H1), so the horizon stays valid
        hidden_max = sum(max(seg_w[r][i] for r in range(p)) for i in range(k))
        if hint is not None and problem.optimize == "speed" and w_max > 0:
            horizon = min(upper, (hint.objective + hidden_max - problem.w_sum * prefix[k]) // w_max)
        return cls(seg_t, seg_f, seg_w, seg_x, prefix, upper, horizon, hidden_max)


def solve_chain_cpsat(problem: ChainProblem, hint: ChainAnswer | None = None, *,
                      time_limit_s: float = 10.0, deterministic_time: float | None = None,
                      num_workers: int = 1, random_seed: int = 0,
                      band: int | None = None) -> ChainResult:
    """Solve a :class:`ChainProblem` exactly with CP-SAT (see its docstring for the model).

    Variables: ``x[i, s]`` segment i in stage s, ``e[i, s]`` the cut after segment i closes
    stage s, ``rc[s]`` stage s recomputes, ``t[s]`` stage time, ``mem[s]`` stage memory. The
    objective is linear in ``max t``, ``max rank load``, ``sum t`` and (ZB-H1) the hidden
    ``W`` of the stages after the first. With a feasible hint its value bounds every stage's
    time, which prunes ``x`` to a band.

    Args:
        problem: the chain problem.
        hint: a starting answer (e.g. :func:`autopart.solver.chain_dp.chain_dp_hint`).
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
        SearchLimitError: CP-SAT found nothing within its limits and there is no feasible
            hint.
    """
    # Data.
    k, s_total = problem.num_segments, problem.num_stages
    if hint is not None and not problem.fits(hint.cuts, hint.recompute):
        hint = None
    data = _Data.of(problem, hint)
    hint_stage = ([sum(1 for c in hint.cuts if c < i) for i in range(k)]
                  if hint is not None and band is not None else None)

    # Variables.
    # x[i, s] = segment i is in stage s; e[i, s] = the cut after segment i ends stage s (with
    # the constraints that make the stages contiguous: see _contiguous_stages.build_chain_model).
    chain = build_chain_model(data.prefix, s_total, data.horizon, hint_stage=hint_stage,
                              band=band)
    model = chain.model
    # rc[s] = stage s recomputes its forward in backward (constant unless mode "auto").
    rc: list[Any] = []
    for s in range(s_total):
        rc.append(model.new_bool_var(f"rc[{s}]") if problem.recompute == "auto"
                  else int(problem.recompute == "all"))
    # t[s] = stage time; max_t, max_load = the objective's max terms.
    t = [model.new_int_var(0, data.upper, f"t[{s}]") for s in range(s_total)]
    max_t = model.new_int_var(0, data.upper, "max_t")
    max_load = model.new_int_var(0, data.upper * problem.stages_per_rank, "max_load")

    # Constraints.
    _add_stage_times(problem, chain, data, rc, t, max_t, max_load)
    mem, mem_upper = _add_memory(problem, chain, rc)

    # Objective.
    if problem.optimize == "memory":
        max_mem = model.new_int_var(0, mem_upper * problem.stages_per_rank, "max_mem")
        for r in range(problem.num_ranks):
            model.add(sum(mem[s] for s in problem.stages_on(r)) <= max_mem)
        model.minimize(max_mem)
    else:
        hidden = _hidden_weight(problem, chain, data, rc)
        model.minimize(problem.w_stage * max_t + problem.w_rank * max_load
                       + problem.w_sum * sum(t) - sum(hidden))
    if hint is not None:
        add_cut_hint(chain, hint.cuts)
        for s, var in enumerate(rc):
            if not isinstance(var, int):
                model.add_hint(var, hint.recompute[s])

    # Solve.
    solver, status, wall_s = solve_model(model, time_limit_s=time_limit_s,
                                         deterministic_time=deterministic_time,
                                         num_workers=num_workers, random_seed=random_seed)

    # Read.
    return _read(problem, chain, rc, solver, status, wall_s, hint, banded=hint_stage is not None)


def _read(problem: ChainProblem, chain: ChainModel, rc: list[Any], solver: cp_model.CpSolver,
          status: cp_model.CpSolverStatus, wall_s: float, hint: ChainAnswer | None, *,
          banded: bool) -> ChainResult:
    """The answer CP-SAT found, or the hint where it found none in its limits.

    Raises:
        InfeasiblePlanError: CP-SAT proved that no answer fits the caps (and there is no hint).
        SearchLimitError: CP-SAT found nothing in its limits and there is no hint.
    """
    if status == cp_model.INFEASIBLE and hint is None:
        raise InfeasiblePlanError(
            f"no split of {problem.num_segments} segments into {problem.num_stages} stages "
            f"keeps every rank within its cap {list(problem.rank_caps or [])}; raise the cap "
            "or use more ranks")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if hint is None:
            raise SearchLimitError(
                f"CP-SAT found no partition within its limits (status "
                f"{solver.status_name(status)}); raise SolveOptions.deterministic_time "
                f"(CP-SAT's deterministic limit per solve) or time_limit_s")
        return ChainResult(hint, "HINT", 0, wall_s)
    cuts = read_cuts(chain, solver)
    flags = tuple(bool(v) if isinstance(v, int) else solver.boolean_value(v) for v in rc)
    answer = ChainAnswer(cuts, flags, problem.objective(cuts, flags))
    if banded:  # CP-SAT's bound holds for the band only
        return ChainResult(answer, "FEASIBLE", 0, wall_s)
    return ChainResult(answer, solver.status_name(status), best_bound(solver, answer.objective),
                       wall_s)


def _add_stage_times(problem: ChainProblem, chain: ChainModel, data: _Data, rc: list[Any],
                     t: list[Any], max_t: Any, max_load: Any) -> None:
    """``t[s]`` = segments (+ recompute's forward, + what a split backward adds where it
    splits) + outgoing and incoming cut charges; ``max_t`` >= every ``t[s]``, ``max_load`` >=
    every rank's sum of them."""
    model, x = chain.model, chain.x
    for s in range(chain.num_stages):
        r = problem.rank_of(s)
        base = chain.stage_sum(s, data.seg_t[r], problem.cut_out, problem.cut_in)
        fwd = sum(data.seg_f[r][i] * x[i, s] for i in chain.segs[s])
        split = (sum(data.seg_x[r][i] * x[i, s] for i in chain.segs[s])
                 if problem.seg_split is not None else 0)
        # with recompute (1) and without (0): the extra terms
        extra = [split if problem.hides_weight(s, False) else 0,
                 fwd + (split if problem.hides_weight(s, True) else 0)]
        if isinstance(rc[s], int):
            model.add(t[s] == base + extra[rc[s]])
        else:
            model.add(t[s] == base + extra[1]).only_enforce_if(rc[s])
            model.add(t[s] == base + extra[0]).only_enforce_if(rc[s].Not())
        model.add(t[s] <= max_t)
    p = problem.num_ranks
    for r in range(p):
        model.add(sum(t[s] for s in problem.stages_on(r)) <= max_load)


def _add_memory(problem: ChainProblem, chain: ChainModel,
                rc: list[Any]) -> tuple[list[Any], int]:
    """``mem[s]`` >= state + crossing in/out + in-flight activations (or inputs, recomputing);
    every rank's sum within its cap. Returns ``mem`` (empty without memory data) and the
    domain bound of each ``mem[s]``."""
    if not problem.has_memory:
        return [], 0
    model, x, e = chain.model, chain.x, chain.e
    k, s_total, p = problem.num_segments, problem.num_stages, problem.num_ranks
    cross = list(problem.cut_bytes or [0] * (k - 1))
    state = list(problem.seg_state or [0] * k)
    saved = list(problem.seg_saved or [0] * k)
    rc_kept = list(problem.seg_rc_kept or [0] * k)
    mem_upper = (sum(state) + 2 * (sum(cross) + problem.first_in_bytes + problem.last_out_bytes)
                 + max(problem.in_flight or (1,)) * (sum(saved) + 2 * sum(cross)
                                                     + problem.first_in_bytes
                                                     + problem.last_out_bytes + sum(rc_kept))
                 + sum(saved))
    mem: list[Any] = []
    for s in range(s_total):
        kk = problem.in_flight_of(s)
        cin_b = (sum(cross[i] * e[i, s - 1] for i in chain.ins[s]) if s > 0
                 else problem.first_in_bytes)
        cout_b = (sum(cross[i] * e[i, s] for i in chain.outs[s]) if s < s_total - 1
                  else problem.last_out_bytes)
        act = sum(saved[i] * x[i, s] for i in chain.segs[s])
        # a recomputing stage: inputs and (selective policy) kept outputs per microbatch in
        # flight; in one microbatch's backward its saved set instead of its kept outputs
        kept_s = sum(rc_kept[i] * x[i, s] for i in chain.segs[s])
        again = kk * (cin_b + kept_s) + act - kept_s
        base = sum(state[i] * x[i, s] for i in chain.segs[s]) + cin_b + cout_b
        var = model.new_int_var(0, mem_upper, f"mem[{s}]")
        kept = act + cout_b if problem.outputs_held else act  # see ChainProblem.outputs_held
        if isinstance(rc[s], int):
            model.add(var >= base + (again if rc[s] else kk * kept))
        else:
            model.add(var >= base + kk * kept).only_enforce_if(rc[s].Not())
            model.add(var >= base + again).only_enforce_if(rc[s])
        mem.append(var)
    if problem.rank_caps is not None:
        for r in range(p):
            model.add(sum(mem[s] for s in problem.stages_on(r)) <= problem.rank_caps[r])
    return mem, mem_upper


def _hidden_weight(problem: ChainProblem, chain: ChainModel, data: _Data,
                   rc: list[Any]) -> list[Any]:
    """The W time each stage takes off the objective: its W where its backward splits and it
    is not stage 0 (:meth:`ChainProblem.hides_weight`), with or without recompute."""
    model, x = chain.model, chain.x
    hidden: list[Any] = []
    for s in range(chain.num_stages):
        split, whole = problem.hides_weight(s, False), problem.hides_weight(s, True)
        if not (split or whole):
            continue
        w_s = sum(data.seg_w[problem.rank_of(s)][i] * x[i, s] for i in chain.segs[s])
        if isinstance(rc[s], int):
            if problem.hides_weight(s, bool(rc[s])):
                hidden.append(w_s)
            continue
        h = model.new_int_var(0, data.hidden_max, f"hidden_w[{s}]")
        model.add(h == (w_s if split else 0)).only_enforce_if(rc[s].Not())
        model.add(h == (w_s if whole else 0)).only_enforce_if(rc[s])
        hidden.append(h)
    return hidden
