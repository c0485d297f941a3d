"""solve(costs, cluster, options) -> Plan: cuts, microbatches, interleaving, schedule and recompute.

The public entry. Its three steps live in their own modules, in data-flow order:
:mod:`~autopart.solver._problem_grid` (candidates, one chain problem and seed per (kind, v, m)),
:mod:`~autopart.solver._refinement` (CP-SAT on the most promising, and bounds) and
:mod:`~autopart.solver._selection` (exact costs, baselines, simulator, the plan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autopart.core.cluster import Cluster
from autopart.core.costgraph import CostGraph
from autopart.core.errors import InfeasiblePlanError
from autopart.core.plan import Plan
from autopart.core.recompute_policy import SELECTIVE_KEPT_NODE_OPS
from autopart.solver._problem_grid import setup, subproblems
from autopart.solver._refinement import search
from autopart.solver._selection import choose
from autopart.solver.chain_cpsat import SearchLimitError
from autopart.solver.options import SolveOptions

__all__ = ["SolveOptions", "solve", "better_plan", "auto_recompute"]


def solve(costs: CostGraph, cluster: Cluster, options: SolveOptions) -> Plan:
    """Choose cuts, microbatch count m, stages per rank v, schedule kind and recompute.

    The search, for every allowed (kind, v, m):

    1. A :class:`~autopart.solver.chain.ChainProblem` over the cut candidates: segment times at
       the microbatch size, P2P sends, memory that follows the schedule (parameter state,
       activations x in-flight microbatches of that kind, recompute keeping only stage
       inputs), per-rank caps, and the kind's closed-form step time as a linear objective.
    2. An exact min-max DP seeds it (:func:`~autopart.solver.chain_dp.chain_dp_hint`). The
       ``max_cpsat_solves`` most promising seeds are refined on the full objective, with
       per-stage recompute decisions: with one stage per rank by the threshold search of
       :mod:`autopart.solver.chain_bound` (exact DPs over the largest stage time, until its
       bound is within 0.1 % of its answer or 16 DPs ran), then by CP-SAT where that can still pay. On big
       subproblems (more than ``_BAND_ABOVE`` segment x stage pairs) at most ``_BIG_SOLVES``
       are refined, and CP-SAT, when it runs, only searches a band of +-2 stages around the
       seed for a shorter deterministic time. The plan's ``solver.bound`` is the tightest
       valid lower bound on the chosen (kind, v, m) chain problem's optimum, and
       ``solver.name`` says which (``"cp-sat"``, ``"dp+threshold-bound"``,
       ``"cp-sat-band+relaxation-bound"`` ...: see
       :class:`~autopart.solver.chain_cpsat.ChainResult`).
    3. Every answer is costed exactly (tied parameters on every stage reading them, per-stage
       transient) in closed form; the ``max_simulated`` best are replayed by the schedule
       simulator, whose step time and per-rank peaks are what the plan reports.

    ``"speed"`` keeps the fastest fitting candidate (ties: smaller m, then the earlier kind);
    ``"memory"`` the smallest largest-rank peak, then time. Baseline partitioners
    (:mod:`autopart.solver.baselines`) are evaluated under 1F1B, v = 1 at the chosen m
    (with every stage recomputing if that is what makes them fit) and reported; a faster
    fitting baseline is taken instead.

    Args:
        costs: per-node costs, profiled at ``costs.batch_size``.
        cluster: the devices; stage s runs on rank ``s % p`` (the V schedules ``zbv`` and
            ``dualpipev``: rank r runs stages r and 2p - 1 - r).
        options: see :class:`SolveOptions`.

    Returns:
        A complete plan; equal inputs give equal plans except for ``solver.wall_s``.

    Raises:
        PlanError: bad options (see :class:`SolveOptions`).
        InfeasiblePlanError: too few cut positions for the stages, or nothing fits the memory
            cap; the message names the smallest peak found and the cap or device count needed.
    """
    if options.recompute_policy == "auto":
        return auto_recompute(
            lambda policy: solve(costs, cluster, replace(options, recompute_policy=policy)),
            options.optimize)
    if options.recompute_policy == "op" and options.training:
        return _solve_op(costs, cluster, options)
    return _searched(costs, cluster, options)


def _searched(costs: CostGraph, cluster: Cluster, options: SolveOptions,
              kept_nodes: frozenset[str] = frozenset()) -> Plan:
    """The three steps, recomputing stages priced keeping ``kept_nodes`` under ``"op"``.

    Raises:
        InfeasiblePlanError: nothing fits (:func:`autopart.solver._selection.choose`).
        SearchLimitError: nothing fits and some subproblem ended at CP-SAT's limits, so
            more search might find a plan (an ``InfeasiblePlanError``, naming the options
            to raise)."""
    st = setup(costs, cluster, options, kept_nodes=kept_nodes)
    solved, wall, stopped = search(st, subproblems(st))
    try:
        plan: Plan = choose(st, solved, wall)
    except InfeasiblePlanError as exc:
        if not stopped:
            raise
        # what fits may be among the subproblems CP-SAT left unanswered
        raise SearchLimitError(
            f"{stopped} subproblem(s) ended at CP-SAT's limits with nothing that fits, and "
            f"nothing else fits: raise SolveOptions.deterministic_time (now "
            f"{options.deterministic_time}) or time_limit_s (now {options.time_limit_s} s) "
            f"before concluding that nothing fits. {exc}") from exc
    return plan


def _solve_op(costs: CostGraph, cluster: Cluster, options: SolveOptions) -> Plan:
    """``recompute_policy="op"``: the partition searched twice, with recomputing stages
    priced keeping what ``"selective"`` keeps (a guess of what the choice will keep, which
    decides which cuts the search finds) and keeping nothing (the cuts ``"full"`` finds),
    each search's best candidates then keeping what fits
    (:mod:`autopart.solver.recompute_choice`); the better of the two plans by the objective
    (:func:`better_plan`). The choice starts from nothing kept, so it can keep less than the
    guess, or more; and since keeping nothing is ``"full"``'s plan (a stage keeping nothing
    runs plain checkpointing, priced so: ``CostModel.checkpoints_selectively``), ``"op"`` is
    never slower
    than ``"full"`` under the same cap (the guess alone was not: on a 9-node chain under a cap
    halfway between the two policies' peaks, 314.6 against ``"full"``'s 304.3 µs; the search
    keeping nothing found 280.9, ``tests/solver/test_op_recompute.py``).

    Raises the search's ``InfeasiblePlanError`` where nothing fits keeping nothing."""
    selective = frozenset(nd.name for nd in costs.nodes if nd.op in SELECTIVE_KEPT_NODE_OPS)
    plain = _searched(costs, cluster, options)
    try:
        guessed = _searched(costs, cluster, options, selective)
    except InfeasiblePlanError:
        return plain
    return better_plan(guessed, plain, options.optimize)


def auto_recompute(solve_with: Callable[[str], Plan], optimize: str) -> Plan:
    """``recompute_policy="auto"``: ``solve_with("full")``; where that plan recomputes a
    stage, ``solve_with("op")`` too, and the better of the two by the objective
    (:func:`better_plan`). ``"op"`` searches the cuts as ``"selective"`` prices them and then
    keeps what fits, so its plan is at least as fast as ``"selective"``'s (up to the
    knapsack's rounding); it recomputes less than ``"full"``, so it is faster and holds
    more: where nothing fits with ``"full"`` nothing fits with it either (the first call's
    ``InfeasiblePlanError`` is raised), and where only ``"full"`` fits its plan is kept.
    :func:`solve`, :func:`autopart.solver.layout_search.solve_layout` and
    ``autopart.planning.solve_auto_recompute`` decide it so."""
    full = solve_with("full")
    if not any(st.recompute for st in full.stages):
        return full
    try:
        op = solve_with("op")
    except InfeasiblePlanError:
        return full
    return better_plan(full, op, optimize)


def better_plan(first: Plan, second: Plan, optimize: str) -> Plan:
    """The better of two plans by the objective: ``"speed"`` the faster (then the smaller
    largest-rank peak), ``"memory"`` the smaller largest-rank peak (then the faster);
    ``first`` on a tie."""
    def key(plan: Plan) -> tuple[float, ...]:
        peak = max(r.peak_memory_bytes for r in plan.ranks)
        return ((peak, plan.predicted_step_time_us) if optimize == "memory"
                else (plan.predicted_step_time_us, peak))

    return min((first, second), key=key)
