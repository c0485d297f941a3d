"""Selection of the plan: exact costs, baselines, simulator replays, preference order and ties.

Every refined answer is costed exactly in closed form; the baseline partitioners are
costed the same way under 1F1B, v = 1 at the chosen m (recomputing every stage if that is
what makes them fit); the ``max_simulated`` best are replayed by the schedule simulator and the
best by the target's preference order (:func:`_key`) becomes the plan, with the solver's
report, the baselines, the Pareto frontier and the physical lower bounds. When nothing fits,
:func:`_memory_error` names the smallest peak found and what would fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from importlib.metadata import version

from autopart.core.cluster import Cluster
from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.core.plan import SCHEDULE_KINDS, BaselineReport, Plan, SolverReport
from autopart.core.schedule import splits_backward
from autopart.solver._candidate import TIE_TOLERANCE, Candidate, evaluate
from autopart.solver._cost_model import TIME_UNITS_PER_US
from autopart.solver._plan_build import build_plan, lower_bounds, pareto
from autopart.solver._problem_grid import (
    Setup,
    Subproblem,
    chain_problem,
    runs_microbatches,
    setup,
)
from autopart.solver.chain_cpsat import ChainResult
from autopart.solver.chain_dp import chain_dp_hint
from autopart.solver.recompute_choice import choose_kept

__all__ = ["choose"]

_GIB = 2**30
#: Above this many actions per replay only the final choice and no baseline is simulated.
_SIMULATE_ABOVE = 8192


def choose(st: Setup, solved: list[Subproblem], wall: float) -> Plan:
    """The plan of the best fitting candidate among ``solved`` and the baselines.

    Args:
        st: the solve's setup.
        solved: the subproblems with an answer (:func:`autopart.solver._refinement.search`).
        wall: CP-SAT wall time spent, seconds (reported as ``solver.wall_s``).

    Raises:
        InfeasiblePlanError: no candidate fits the memory cap: neither the search's answers,
            the baselines, nor the partition of least peak (:func:`_least_peak`, taken where
            it alone fits; not looked for where ``solved`` is empty and the options do not
            ask for an explanation, ``explain_infeasible=False``).
    """
    model, options, p, caps = st.model, st.options, st.p, st.caps
    evaluated = [evaluate(model, st.cands, s.kind, p, s.v, s.m, s.answer, caps, sub=s)
                 for s in solved]
    if options.optimize == "memory" and evaluated:
        key = _key("memory")
        evaluated += [_polish(st, c) for c in sorted(evaluated, key=key)[:_POLISHED]]
    base_reports, base_cands = _baselines(st, evaluated)
    # A baseline may replace the solver's answer only where its setting (1F1B, v = 1, its
    # recompute) is one the options allow.
    allowed = (options.schedule_kind in (None, base_cands[0].kind if base_cands else None)
               and options.stages_per_rank in (None, 1) and options.num_stages in (None, p)
               and not options.split_backward)
    pool = [c for c in evaluated if c.fits] + [
        c for c in base_cands if c.fits and allowed
        and options.recompute in (None, any(c.recompute))]
    if not pool:
        # the chain problem prices memory more simply than the exact costs: where none of
        # the searched answers fits, the partition of least peak still may. Where the search
        # has no answer at all (no chain problem has one under its caps), that partition is
        # searched only to explain the refusal: every (kind, v, m) solved again and costed,
        # which took 33 of the 76 s of a layout search of a 1T GPT on 8192 GPUs (72 layouts,
        # none of them then fitting)
        least = _least_peak(st) if solved or options.explain_infeasible else None
        if least is None or not least.fits:
            raise _memory_error(st, least)
        pool = [least]
    key = _key(options.optimize)
    pool.sort(key=key)
    n_sim = options.max_simulated if pool[0].m * p * pool[0].v <= _SIMULATE_ABOVE else 1
    measured = st.costs.source.startswith("measured")
    final = [c.simulated() for c in _to_simulate(pool, n_sim, options.optimize, measured)]
    # "op": each recomputing candidate keeps what fits under its ranks' caps, on a model of
    # its own kept nodes
    kept_on = {id(c): (m, c) for m, c in (
        choose_kept(model, c, st.caps, options.optimize)
        if model.recompute_policy == "op" and model.training and any(c.recompute)
        else (model, c) for c in final)}
    final = [c for _, c in kept_on.values()]
    final = [c for c in final if c.fits] or final
    best = _pick(final, options.optimize, measured)
    model = kept_on[id(best)][0]
    frontier = pareto(evaluated + base_cands + final)
    sub = best.sub
    report = _report(sub.result if isinstance(sub, Subproblem) else None, st, wall, best)
    versions = {**options.library_versions, "ortools": version("ortools")}
    plan = build_plan(st.costs, st.cluster, model, st.cands, best, options.optimize,
                      options.batch_size, dict(sorted(versions.items())), report,
                      tuple(base_reports), frontier)
    return replace(plan, lower_bounds=lower_bounds(model, plan, p))


#: Under ``"memory"``, how many of the best answers :func:`_polish` refines, and its budget
#: of exact evaluations for each.
_POLISHED = 3
_POLISH_EVALUATIONS = 4000


def _polish(st: Setup, cand: Candidate) -> Candidate:
    """``cand`` refined on the exact costs by coordinate descent (memory target): each cut in
    turn moves to the candidate position between its neighbours, and the two stages it
    separates take the recompute flags (when the options leave recompute to the solver),
    that lower the ranks' peaks most (compared largest first, then the step time); then each
    stage's flag alone is flipped where that helps; until a round changes nothing or the
    evaluation budget is spent. Last, each recomputing stage stops recomputing where that
    lowers :func:`_key` (a faster step at the same largest peak). Exhaustive for one cut
    (two stages).

    The chain problems price memory with a simpler model than :func:`evaluate`, and their
    optimum can miss the exact one.
    """
    model, p, n = st.model, st.p, len(st.model.costs.nodes)

    def key(c: Candidate) -> tuple[object, ...]:
        # every rank's peak, largest first, then the step: a move that leaves the largest
        # peak as it is but loads a rank below it is no step down (taken on the step time
        # alone, such moves led a 4-rank GPT-2's descent to a largest peak 45 % above the
        # one it reached otherwise)
        return (sorted(c.peaks, reverse=True), round(c.step_us, 6))

    allowed = st.cands.positions
    flip = st.options.recompute is None and model.training
    best, evaluations = cand, 0

    def trial(positions: tuple[int, ...], rc: tuple[bool, ...]) -> Candidate:
        nonlocal evaluations
        evaluations += 1
        return evaluate(model, None, cand.kind, p, cand.v, cand.m, positions, st.caps,
                        sub=cand.sub, recompute=rc)

    changed = True
    while changed and evaluations < _POLISH_EVALUATIONS:
        changed = False
        for j in range(len(best.positions)):
            pos = best.positions
            lo = pos[j - 1] if j else 0
            hi = pos[j + 1] if j + 1 < len(pos) else n
            rc0 = best.recompute
            # the two stages the cut separates may also change their recompute with it
            flags = ([(a, b) for a in (False, True) for b in (False, True)] if flip
                     else [(rc0[j], rc0[j + 1])])
            for q in allowed:
                if not lo < q < hi or evaluations >= _POLISH_EVALUATIONS:
                    continue
                for a, b in flags:
                    if q == pos[j] and (a, b) == (rc0[j], rc0[j + 1]):
                        continue
                    c = trial((*pos[:j], q, *pos[j + 1:]), (*rc0[:j], a, b, *rc0[j + 2:]))
                    if key(c) < key(best):
                        best, changed = c, True
        for s in range(len(best.recompute)) if flip else ():
            rc = tuple(not f if i == s else f for i, f in enumerate(best.recompute))
            c = trial(best.positions, rc)
            if key(c) < key(best):
                best, changed = c, True
    # then the step at that largest peak: each stage's flag turned off where no rank's peak
    # rises above the largest
    final = _key("memory")
    for s in range(len(best.recompute)) if flip else ():
        if best.recompute[s] and evaluations < _POLISH_EVALUATIONS:
            c = trial(best.positions, tuple(f and i != s for i, f in enumerate(best.recompute)))
            if final(c) < final(best):
                best = c
    return best


def _key(optimize: str) -> Callable[[Candidate], tuple[float, ...]]:
    """Order of preference: the target, then the other measure, then the total memory of all
    ranks (of two equally fast plans with the same largest peak, e.g. GPipe and 1F1B at
    m = p, the one holding less on the other ranks), then fewer microbatches and stages."""
    order = {k: i for i, k in enumerate(SCHEDULE_KINDS)}
    if optimize == "speed":
        return lambda c: (round(c.step_us, 6), c.max_peak, sum(c.peaks), c.m, c.v, order[c.kind])
    return lambda c: (c.max_peak, round(c.step_us, 6), sum(c.peaks), c.m, c.v, order[c.kind])


def _to_simulate(pool: list[Candidate], n_sim: int, optimize: str,
                 measured: bool) -> list[Candidate]:
    """The ``n_sim`` first of ``pool`` (sorted by :func:`_key`) and, where :func:`_pick`
    breaks ties (speed, measured costs, every replay small enough to simulate), every
    other candidate within :data:`TIE_TOLERANCE` of the fastest: a tie may be won by one
    that is not among the fastest ``n_sim``."""
    if optimize != "speed" or not measured or n_sim == 1:
        return pool[:n_sim]
    limit = pool[0].step_us * (1 + TIE_TOLERANCE)
    return pool[:n_sim] + [c for c in pool[n_sim:] if c.step_us <= limit]


def _pick(final: list[Candidate], optimize: str, measured: bool) -> Candidate:
    """The plan among ``final``: :func:`_key`'s first, except for speed on ``measured``
    costs, where of the candidates within :data:`TIE_TOLERANCE` of the fastest the simplest
    wins — fewer microbatches, then fewer stages per rank, then no split backward
    (zero-bubble pays a measured, noisy split cost), then fewer recomputing stages — and
    then :func:`_key`'s order. Analytical costs carry no timing noise; peak memory depends
    on tensor sizes, not timings."""
    key = _key(optimize)
    if optimize != "speed" or not measured:
        return min(final, key=key)
    fastest = min(c.step_us for c in final)
    near = [c for c in final if c.step_us <= fastest * (1 + TIE_TOLERANCE)]
    return min(near, key=lambda c: (c.m, c.v, splits_backward(c.kind, False), sum(c.recompute),
                                    *key(c)))


def _baselines(st: Setup, evaluated: list[Candidate]) -> tuple[list[BaselineReport], list[Candidate]]:
    """Each baseline under 1F1B, v = 1, at the m of the best candidate (the fastest that
    fits; when none fits, the one with the least peak: its m is the one memory favours).

    A baseline whose peak does not fit the caps is costed again with every stage
    recomputing (DeepSpeed's ``activation_checkpoint_interval``, torchgpipe's
    ``checkpoint="always"``): what its users turn on when memory runs out. It keeps that
    setting if it then fits.
    """
    if not st.baselines:
        return [], []
    model, p, caps = st.model, st.p, st.caps
    fitting = [c for c in evaluated if c.fits]
    if fitting:
        m = min(fitting, key=_key("speed")).m
    else:
        m = min(evaluated, key=_key("memory")).m if evaluated else st.counts[0]
    reports, cands = [], []
    for name, cuts in st.baselines:
        kind = "1f1b" if model.training else "gpipe"
        cand = evaluate(model, None, kind, p, 1, m, cuts, caps, name=name)
        if not cand.fits and model.training:
            again = evaluate(model, None, kind, p, 1, m, cuts, caps, name=name, recompute=True)
            cand = again if again.fits else cand
        if m * p <= _SIMULATE_ABOVE:
            cand = cand.simulated()
        reports.append(BaselineReport(name=name, predicted_step_time_us=round(cand.step_us, 3),
                                      peak_memory_bytes=cand.max_peak,
                                      recompute=any(cand.recompute), fits=cand.fits))
        cands.append(cand)
    return reports, cands


def _report(res: ChainResult | None, st: Setup, wall: float, best: Candidate) -> SolverReport:
    """The plan's ``solver`` section: CP-SAT's status, objective, bound and gap."""
    if res is None:
        name = "baseline" if best.name else "dp"
        return SolverReport(status="FEASIBLE", objective=round(best.step_us, 3),
                            bound=0.0, gap=1.0, wall_s=wall, name=f"cp-sat+{name}")
    scale = 1.0 if st.options.optimize == "memory" else 1.0 / TIME_UNITS_PER_US
    objective, bound = res.objective * scale, res.bound * scale
    gap = (objective - bound) / objective if objective > 0 else 0.0
    # The bound is a lower bound on the chosen (kind, v, m) chain problem's optimum; the
    # method says where it came from (CP-SAT's own, or autopart.solver.chain_bound's).
    return SolverReport(status=res.status, objective=round(objective, 3), bound=round(bound, 3),
                        gap=round(gap, 6), wall_s=wall, name=res.method)


def _least_peak(st: Setup) -> Candidate | None:
    """The candidate with the smallest largest-rank peak over every (kind, v, m) of ``st``:
    each chain solved for memory by the exact DP, without caps."""
    least: Candidate | None = None
    for kind, v in st.configs:
        for m in st.counts:
            if not runs_microbatches(kind, st.p, m):
                continue
            prob = chain_problem(st, kind, v, m)
            seed = chain_dp_hint(replace(prob, rank_caps=None, optimize="memory"))
            if seed is None:
                continue
            cand = evaluate(st.model, st.cands, kind, st.p, v, m, seed, st.caps)
            if least is None or cand.max_peak < least.max_peak:
                least = cand
    return least


def _on(st: Setup, n: int) -> Candidate | None:
    """:func:`_least_peak` on ``n`` devices like rank 0 (same cap); None where the graph has
    too few cut positions for ``n`` stages."""
    cluster = Cluster.uniform(st.cluster.devices[0], [st.cluster.device_names[0]] * n)
    options = replace(st.options, num_stages=None, hint=None)
    try:
        return _least_peak(setup(st.costs, cluster, options))
    except PlanError:
        return None


def _devices_that_fit(st: Setup, lowest: int) -> tuple[int, Candidate] | None:
    """The fewest devices (>= ``lowest``) on which a partition was found that fits the cap, by
    doubling then bisection, each count checked by solving for memory; None when no count up
    to the most stages the graph's cuts allow fits."""
    top = st.cands.num_valid + 1  # the most stages (so ranks) the graph's cuts allow
    if lowest > top:
        return None
    low, n = lowest - 1, lowest
    while True:
        cand = _on(st, n)
        if cand is not None and cand.fits:
            break
        if cand is None or n >= top:
            return None
        low, n = n, min(2 * n, top)
    fits = (n, cand)
    while n - low > 1:
        mid = (low + n) // 2
        cand = _on(st, mid)
        if cand is not None and cand.fits:
            n, fits = mid, (mid, cand)
        else:
            low = mid
    return fits


def _memory_error(st: Setup, least: Candidate | None) -> InfeasiblePlanError:
    """Name the smallest peak any configuration reaches without a cap (``least``,
    :func:`_least_peak` of ``st``), and what would fit: the cap on these devices, and a
    device count checked by solving (or that none fits, with the cap that would on the most
    devices the graph allows)."""
    model, caps, p = st.model, st.caps, st.p
    if not st.options.explain_infeasible:
        return InfeasiblePlanError(f"no partition onto {p} ranks fits the memory cap of "
                                   f"{min(caps)} bytes ({min(caps) / _GIB:.3f} GiB); solve with "
                                   "explain_infeasible=True for the smallest peak and what fits, "
                                   "or raise the cap, use more devices or allow recompute")
    if least is None:  # pragma: no cover - a chain always has some answer without caps
        return InfeasiblePlanError("no partition fits the memory cap")
    state_total = sum(model.state_bytes.values())
    cap = min(caps)
    # the parameter state alone, spread evenly, bounds the device count from below
    lowest = max(math.ceil(state_total / max(cap, 1)), p + 1)
    more = _devices_that_fit(st, lowest)
    if more is not None:
        n, cand = more
        verdict = (f"{n} devices fit (checked: largest predicted peak {cand.max_peak} bytes, "
                   f"{cand.kind}, num_microbatches={cand.m})")
    else:
        top = st.cands.num_valid + 1
        widest = _on(st, top) if top > p else None
        n, floor = (top, widest.max_peak) if widest is not None and \
            widest.max_peak < least.max_peak else (p, least.max_peak)
        verdict = (f"but no number of devices fits this cap (the graph's cuts allow at most "
                   f"{top} stages): raise the cap to at least {floor} bytes "
                   f"({math.ceil(floor / _GIB * 1000) / 1000:.3f} GiB), which fits on {n} devices")
    rank = max(range(p), key=lambda r: least.peaks[r])
    return InfeasiblePlanError(
        f"no partition onto {p} ranks fits the memory cap: the smallest predicted peak is "
        f"{least.max_peak} bytes ({least.max_peak / _GIB:.3f} GiB, rank {rank}, "
        f"{least.kind}, v={least.v}, num_microbatches={least.m}, recompute="
        f"{sum(least.recompute)}/{len(least.recompute)} stages) but the cap is {cap} bytes "
        f"({cap / _GIB:.3f} GiB); use a memory cap of at least {least.max_peak} bytes "
        f"({math.ceil(least.max_peak / _GIB * 1000) / 1000:.3f} GiB), or more devices (at "
        f"least {lowest}: the parameter state alone is {state_total} bytes) — {verdict}; or "
        "allow recompute")
