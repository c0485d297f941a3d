"""Lower bounds on a ChainProblem's optimum, and the threshold search that certifies an answer.

Three bounds, each valid for every answer that fits the caps (so the optimum is never below):

- :func:`relaxation_bound`: perfect balance, no sends, no recompute, every W hidden.
- :func:`stage_time_bound`: the same with the largest stage time replaced by the exact least
  one under the memory caps (:func:`autopart.solver.chain_dp.chain_min_max`), which counts the
  recompute that memory forces; for any ``stages_per_rank``.
- :func:`threshold_search`: one stage per rank, speed objective. The objective is then
  ``a * max_s t_s + sum_s (w_sum t_s - W_s)`` with ``a = w_stage + w_rank``; the least sum
  over answers whose stage times all stay within ``T``, ``G(T)``
  (:func:`autopart.solver.chain_dp.chain_min_sum`), does not grow with ``T``. An answer whose
  largest stage time lies in ``[lo, hi]`` therefore costs at least ``a * lo + G(hi)``:
  bisecting ``[least max t, largest max t that can still beat the incumbent]`` gives a bound
  that closes on the optimum, and every ``G(T)`` evaluated comes with an answer, so the
  incumbent improves on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.core.errors import PlanError
from autopart.solver.chain import ChainAnswer, ChainProblem
from autopart.solver.chain_dp import chain_min_max, chain_min_sum

__all__ = ["ThresholdResult", "relaxation_bound", "stage_time_bound", "threshold_search"]


@dataclass(frozen=True, slots=True)
class ThresholdResult:
    """What :func:`threshold_search` found.

    Attributes:
        answer: the best answer seen (the incumbent, or a DP answer that beats it).
        bound: a lower bound on the objective of every answer that fits (integer units).
        evaluations: how many ``G(T)`` dynamic programs ran.
    """

    answer: ChainAnswer
    bound: int
    evaluations: int

    @property
    def gap(self) -> float:
        """``(objective - bound) / objective`` (0 when the objective is 0)."""
        obj = self.answer.objective
        return (obj - self.bound) / obj if obj > 0 else 0.0


def _fastest(prob: ChainProblem) -> tuple[list[int], int]:
    """Each segment's time on its fastest rank, and the most W time any answer can hide."""
    fast = [min(prob.seg_time_on(r)[i] for r in range(prob.num_ranks))
            for i in range(prob.num_segments)]
    # at most every segment's W is hidden (stage 0's is not, nor those of stages whose
    # backward does not split: ChainProblem.hides_weight)
    hidden = sum(max(prob.seg_bwd_weight_on(r)[i] for r in range(prob.num_ranks))
                 for i in range(prob.num_segments))
    return fast, hidden


def relaxation_bound(prob: ChainProblem) -> int:
    """A lower bound on ``prob``'s objective valid for every answer: each stage and rank
    carries at least its share of the fastest segment times, communication counted as 0,
    and (ZB-H1) every segment's weight-gradient time taken off.

    A relaxation of that one (kind, v, m) closed-form objective (perfect balance, no sends, no
    recompute), not a bound over other microbatch counts or kinds and not the simulator's step
    time. Under ``optimize="memory"``: the state bytes spread evenly over the ranks."""
    if prob.optimize == "memory":
        return -(-sum(prob.seg_state or (0,)) // prob.num_ranks)
    fast, hidden = _fastest(prob)
    total = sum(fast)
    per_stage = max(-(-total // prob.num_stages), max(fast))
    return (prob.w_stage * per_stage + prob.w_rank * -(-total // prob.num_ranks)
            + prob.w_sum * total - hidden)


def stage_time_bound(prob: ChainProblem) -> int | None:
    """:func:`relaxation_bound` with ``max_s t_s`` (and the largest rank load, which is at
    least it) raised to :func:`~autopart.solver.chain_dp.chain_min_max`: no answer that fits
    has a smaller largest stage time, sends and forced recompute included. Speed objective.

    Returns:
        The bound (integer units), or None when no answer fits the caps.
    """
    least = chain_min_max(prob)
    if least is None:
        return None
    fast, hidden = _fastest(prob)
    total = sum(fast)
    per_stage = max(-(-total // prob.num_stages), max(fast), least)
    load = max(-(-total // prob.num_ranks), least)
    return prob.w_stage * per_stage + prob.w_rank * load + prob.w_sum * total - hidden


def threshold_search(prob: ChainProblem, incumbent: ChainAnswer | None = None, *,
                     max_evaluations: int = 16, rel_gap: float = 1e-3) -> ThresholdResult | None:
    """Bound (and improve) ``prob``'s optimum by bisection on the largest stage time.

    One stage per rank and the speed objective only (see the module docstring for the
    argument). Intervals ``[lo, hi]`` of the largest stage time are kept with the bound
    ``a * lo + G(hi)``; the lowest is split at its middle until the bound is within
    ``rel_gap`` of the best objective found or ``max_evaluations`` DPs have run. Intervals
    whose bound reaches the incumbent are dropped. Deterministic.

    Args:
        prob: the chain problem (``stages_per_rank == 1``, ``optimize == "speed"``).
        incumbent: an answer to beat (e.g. the min-max DP seed); ignored when it does not fit.
        max_evaluations: the most ``G(T)`` DPs (each O(K^2 S); at least 2 run); default 16.
        rel_gap: stop once ``(best - bound) / best`` is at most this; default 0.001.

    Returns:
        The best answer and the bound, or None when no answer fits the caps.

    Raises:
        PlanError: ``stages_per_rank > 1`` or ``optimize="memory"``.
    """
    if prob.stages_per_rank != 1 or prob.optimize != "speed":
        raise PlanError(f"threshold_search needs one stage per rank and optimize='speed', not "
                        f"stages_per_rank={prob.stages_per_rank}, optimize={prob.optimize!r}")
    a = prob.w_stage + prob.w_rank
    lo = chain_min_max(prob)
    if lo is None:
        return None
    best = incumbent if incumbent is not None and prob.fits(incumbent.cuts,
                                                           incumbent.recompute) else None
    evaluations = 0
    g_at: dict[int | None, int] = {}

    def g(horizon: int | None) -> int:
        nonlocal best, evaluations
        if horizon not in g_at:
            found = chain_min_sum(prob, horizon)
            evaluations += 1
            assert found is not None, "a horizon at or above the least max t always has answers"
            g_at[horizon], answer = found
            if best is None or answer.objective < best.objective:
                best = answer
        return g_at[horizon]

    g_inf = g(None)
    assert best is not None
    if a == 0:  # no max term: G(infinity) is the optimum itself
        return ThresholdResult(best, min(best.objective, g_inf), evaluations)
    # An answer with max t > hi costs more than a * hi + G(inf) >= the incumbent.
    hi = (best.objective - g_inf) // a
    intervals: list[tuple[int, int]] = [(lo, hi)] if hi >= lo else []

    def bound_of(iv: tuple[int, int]) -> int:
        return a * iv[0] + g(iv[1])

    while True:
        # every interval's bound first: computing one may improve the incumbent, against which
        # all are then kept or dropped (filtering as they were computed kept an interval that
        # an earlier one's new incumbent had already beaten, and returned its bound, above
        # that incumbent's objective)
        bounds = [bound_of(iv) for iv in intervals]
        intervals = [iv for iv, b in zip(intervals, bounds, strict=True) if b < best.objective]
        if not intervals:
            return ThresholdResult(best, best.objective, evaluations)
        low_iv = min(intervals, key=lambda iv: (bound_of(iv), iv))
        bound = bound_of(low_iv)
        if (best.objective - bound <= rel_gap * best.objective or evaluations >= max_evaluations
                or low_iv[0] == low_iv[1]):
            return ThresholdResult(best, bound, evaluations)
        lo_i, hi_i = low_iv
        mid = (lo_i + hi_i) // 2
        intervals.remove(low_iv)
        intervals += [(lo_i, mid), (mid + 1, hi_i)]
