"""The CP-SAT core of the chain model: stage membership, cut variables, contiguity, hint, solve.

A chain of K segments is split into S contiguous, non-empty stages. :func:`build_chain_model`
makes the variables and constraints that say so, over the (segment, stage) pairs a time
horizon (and optionally a band around a hint) allows; :func:`add_cut_hint` seeds them with a
cut set; :func:`solve_model` runs CP-SAT deterministically and :func:`read_cuts` /
:func:`best_bound` read the answer. The full chain problem
(:func:`autopart.solver.chain_cpsat.solve_chain_cpsat`, and the tests' min-max partition
oracle) adds its stage costs and objective on top, in the OR-Tools samples' order (data,
variables, constraints, objective, solve, read).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from autopart.core.errors import InfeasiblePlanError

__all__ = ["ChainModel", "build_chain_model", "add_cut_hint", "solve_model", "read_cuts",
           "best_bound"]


@dataclass(frozen=True, slots=True, eq=False)
class ChainModel:
    """A CP-SAT model of K segments in S contiguous stages, ready for costs and an objective.

    Attributes:
        model: the CP-SAT model.
        num_segments: K.
        num_stages: S.
        x: ``x[i, s]`` = segment i is in stage s (only the allowed pairs exist).
        e: ``e[i, s]`` = the cut after segment i ends stage s (and i + 1 starts s + 1).
        segs: per stage s, the segments i that have ``x[i, s]``.
        outs: per stage s, the cuts i that have ``e[i, s]`` (its outgoing cut).
        ins: per stage s, the cuts i that have ``e[i, s - 1]`` (its incoming cut).
    """

    model: cp_model.CpModel
    num_segments: int
    num_stages: int
    x: dict[tuple[int, int], cp_model.IntVar]
    e: dict[tuple[int, int], cp_model.IntVar]
    segs: list[list[int]]
    outs: list[list[int]]
    ins: list[list[int]]

    def stage_sum(self, s: int, seg: Sequence[int], out: Sequence[int],
                  into: Sequence[int]) -> Any:
        """Stage s's sum of ``seg`` over its segments, ``out`` of its outgoing cut and ``into``
        of its incoming cut (a linear expression; each list indexed by segment or cut)."""
        x, e = self.x, self.e
        return (sum(seg[i] * x[i, s] for i in self.segs[s])
                + sum(out[i] * e[i, s] for i in self.outs[s])
                + sum(into[i] * e[i, s - 1] for i in self.ins[s]))


def build_chain_model(prefix: Sequence[int], num_stages: int, horizon: int, *,
                      hint_stage: Sequence[int] | None = None,
                      band: int | None = None) -> ChainModel:
    """Variables ``x``, ``e`` and the constraints that make every stage contiguous and non-empty.

    Stage s may hold segment i only if segments ``0 .. i`` fit in stages ``0 .. s`` and
    segments ``i .. K-1`` in stages ``s .. S-1``, each within ``horizon`` (a bound on every
    stage's cost in an optimal answer), and, with ``band``, only if ``|s - hint_stage[i]| <=
    band`` (a large-neighbourhood search around a hint).

    Args:
        prefix: prefix sums of a lower bound on each segment's cost, length K + 1.
        num_stages: S, ``1 <= S <= K``.
        horizon: the largest stage cost an answer of interest can have (same units).
        hint_stage: the stage of each segment in a hint (with ``band``).
        band: how many stages segment i may sit from ``hint_stage[i]``; ``None``: any.

    Raises:
        InfeasiblePlanError: some segment has no stage within the horizon and band.
    """
    k, s_total = len(prefix) - 1, num_stages

    def allowed(i: int, s: int) -> bool:
        if hint_stage is not None and band is not None and abs(s - hint_stage[i]) > band:
            return False
        return prefix[i + 1] <= (s + 1) * horizon and prefix[k] - prefix[i] <= (s_total - s) * horizon

    model = cp_model.CpModel()
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
    stages = range(s_total)
    lonely = [i for i in range(k) if not any((i, s) in x for s in stages)]
    if lonely:  # pragma: no cover - the horizon is an answer's cost, so each i has a stage
        raise InfeasiblePlanError(f"no stage can hold segment {lonely[0]} within the hint's "
                                  "horizon")

    # Each segment is in exactly one stage.
    for i in range(k):
        model.add_exactly_one(x[i, s] for s in stages if (i, s) in x)
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
    return ChainModel(
        model=model, num_segments=k, num_stages=s_total, x=x, e=e,
        segs=[[i for i in range(k) if (i, s) in x] for s in stages],
        outs=[[i for i in range(k - 1) if (i, s) in e] for s in stages],
        ins=[[i for i in range(k - 1) if (i, s - 1) in e] for s in stages])


def add_cut_hint(chain: ChainModel, cuts: Sequence[int]) -> None:
    """Hint ``x`` and ``e`` with the answer whose ascending cut indices are ``cuts``."""
    stage = 0
    for i in range(chain.num_segments):
        for s in range(chain.num_stages):
            if (i, s) in chain.x:
                chain.model.add_hint(chain.x[i, s], s == stage)
        if i in cuts:
            stage += 1
    for (i, s), var in chain.e.items():
        chain.model.add_hint(var, i in cuts and list(cuts).index(i) == s)


def solve_model(model: cp_model.CpModel, *, time_limit_s: float,
                deterministic_time: float | None, num_workers: int,
                random_seed: int) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus, float]:
    """Run CP-SAT on ``model``.

    Args:
        model: the model.
        time_limit_s: wall-clock limit, seconds.
        deterministic_time: CP-SAT's deterministic time limit (reproducible); ``None``: none.
        num_workers: search workers (1: deterministic).
        random_seed: CP-SAT's seed.

    Returns:
        The solver (to read values from), its status and the wall time, seconds.
    """
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = random_seed
    solver.parameters.max_time_in_seconds = time_limit_s
    if deterministic_time is not None:
        solver.parameters.max_deterministic_time = deterministic_time
    t0 = time.perf_counter()
    status = solver.solve(model)
    return solver, status, time.perf_counter() - t0


def read_cuts(chain: ChainModel, solver: cp_model.CpSolver) -> tuple[int, ...]:
    """The ascending cut indices of the solver's answer."""
    return tuple(i for (i, _s), var in sorted(chain.e.items()) if solver.boolean_value(var))


def best_bound(solver: cp_model.CpSolver, objective: int) -> int:
    """CP-SAT's lower bound on an integer objective, rounded up, at most ``objective``."""
    return min(objective, int(math.ceil(solver.best_objective_bound - 1e-9)))
