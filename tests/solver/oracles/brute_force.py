"""Exact reference for small chain problems: brute force over every cut set and recompute choice."""

from __future__ import annotations

import itertools

from autopart.core.errors import InfeasiblePlanError
from autopart.solver.chain import ChainAnswer, ChainProblem

__all__ = ["solve_brute_force"]


def solve_brute_force(problem: ChainProblem) -> ChainAnswer:
    """Optimal answer to ``problem`` by enumeration: C(K - 1, S - 1) cut sets times every
    recompute assignment the mode allows (2^S for ``"auto"``). For tests on tiny problems.

    Ties keep the first found: lexicographically smallest cuts, then recompute flags with
    ``False`` before ``True``.

    Returns:
        The optimal cuts, recompute flags and objective.

    Raises:
        InfeasiblePlanError: no answer keeps every rank within its cap.
    """
    best: ChainAnswer | None = None
    choices = problem.recompute_choices()
    for cuts in itertools.combinations(range(problem.num_segments - 1), problem.num_stages - 1):
        for rc in choices:
            if not problem.fits(cuts, rc):
                continue
            val = problem.objective(cuts, rc)
            if best is None or val < best.objective:
                best = ChainAnswer(tuple(cuts), tuple(rc), val)
    if best is None:
        raise InfeasiblePlanError(f"no split of {problem.num_segments} segments into "
                                  f"{problem.num_stages} stages fits the rank caps "
                                  f"{problem.rank_caps}")
    return best
