"""The min-max chain partition as a CP-SAT model: the largest stage cost, with weight caps."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.solver._contiguous_stages import (
    add_cut_hint,
    best_bound,
    build_chain_model,
    read_cuts,
    solve_model,
)
from tests.solver.oracles.partition_dp import check_chain, stage_costs

__all__ = ["CpSatResult", "partition_cpsat", "greedy_cuts"]


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
    caps = _stage_caps(weight_cap, seg_weight, k, s_total)
    wseg = list(seg_weight) if seg_weight is not None else [0] * k
    wcut = list(cut_weight) if cut_weight is not None else [0] * (k - 1)
    hint = greedy_cuts(seg_cost, s_total)
    horizon = sum(seg_cost) + sum(cout) + sum(cin)
    if caps is None or all(w <= c for w, c in zip(stage_costs(wseg, wcut, hint), caps,
                                                  strict=True)):
        horizon = max(stage_costs(seg_cost, cout, hint, cin))  # the greedy answer's: it fits
    prefix = [0, *itertools.accumulate(seg_cost)]

    # Variables.
    # x[i, s] = segment i is in stage s; e[i, s] = the cut after segment i ends stage s (with
    # the constraints that make the stages contiguous: see _contiguous_stages.build_chain_model).
    chain = build_chain_model(prefix, s_total, horizon)
    model = chain.model
    # max_cost = the largest stage cost (the objective).
    max_cost = model.new_int_var(0, horizon, "max_cost")

    # Constraints.
    # Stage cost (segments + outgoing and incoming cut charges) is at most max_cost;
    # stage weight within its cap.
    for s in range(s_total):
        model.add(chain.stage_sum(s, seg_cost, cout, cin) <= max_cost)
        if caps is not None:
            model.add(chain.stage_sum(s, wseg, wcut, wcut) <= caps[s])

    # Objective.
    model.minimize(max_cost)
    add_cut_hint(chain, hint)

    # Solve.
    solver, status, wall_s = solve_model(model, time_limit_s=time_limit_s,
                                         deterministic_time=None, num_workers=num_workers,
                                         random_seed=random_seed)

    # Read.
    if status == cp_model.INFEASIBLE:
        raise InfeasiblePlanError(
            f"no split of {k} segments into {s_total} stages keeps every stage's weight within "
            f"its cap {caps}; raise the cap or use more stages")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise PlanError(f"CP-SAT found no partition within time_limit_s={time_limit_s} "
                        f"(status {solver.status_name(status)}); raise time_limit_s")
    objective = int(round(solver.objective_value))
    return CpSatResult(objective=objective, bound=best_bound(solver, objective),
                       status=solver.status_name(status), wall_s=wall_s,
                       cuts=read_cuts(chain, solver))


def _stage_caps(weight_cap: int | Sequence[int] | None, seg_weight: Sequence[int] | None,
                k: int, s_total: int) -> list[int] | None:
    """One weight cap per stage, or None without caps.

    Raises:
        PlanError: caps without ``seg_weight`` of length K, or neither one cap nor S caps.
    """
    if weight_cap is None:
        return None
    caps = [int(weight_cap)] * s_total if isinstance(weight_cap, int) else list(weight_cap)
    if seg_weight is None or len(seg_weight) != k or len(caps) != s_total:
        raise PlanError("weight_cap needs seg_weight of length K and one cap or S caps")
    return caps
