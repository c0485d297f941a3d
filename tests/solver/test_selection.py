"""The tie-break between candidates whose predicted step times are within the noise."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from autopart.solver import _selection
from autopart.solver._selection import TIE_TOLERANCE, _pick, _to_simulate


def cand(kind: str, m: int, step_us: float, *, v: int = 1, recompute: int = 0,
         peak: int = 100) -> Any:
    """What _pick and _key read of a candidate."""
    return SimpleNamespace(kind=kind, m=m, v=v, step_us=step_us, max_peak=peak,
                           peaks=(peak, peak), recompute=(True,) * recompute + (False,) * 2)


@pytest.mark.parametrize(("cands", "winner"), [
    # zero-bubble predicted 1 % faster: a tie, the plan without the noisy split wins
    ([cand("zero_bubble", 4, 100.0), cand("1f1b", 4, 101.0)], ("1f1b", 4)),
    # 3 % faster is outside the tolerance: the faster wins
    ([cand("zero_bubble", 4, 100.0), cand("1f1b", 4, 103.0)], ("zero_bubble", 4)),
    # fewer microbatches win a tie, more stages per rank lose one
    ([cand("1f1b", 8, 100.0), cand("1f1b", 4, 101.5)], ("1f1b", 4)),
    ([cand("interleaved_1f1b", 4, 100.0, v=2), cand("1f1b", 4, 101.0)], ("1f1b", 4)),
    # less recompute wins a tie
    ([cand("1f1b", 4, 100.0, recompute=2), cand("1f1b", 4, 101.0, recompute=1)], ("1f1b", 4)),
    # equal in all of that: the key's order (less memory) decides
    ([cand("gpipe", 4, 100.0, peak=200), cand("1f1b", 4, 100.0, peak=150)], ("1f1b", 4)),
])
def test_ties_within_the_noise_go_to_the_simpler_plan(cands: list[Any],
                                                     winner: tuple[str, int]) -> None:
    best = _pick(cands, "speed", measured=True)
    assert (best.kind, best.m) == winner
    assert _pick(cands[::-1], "speed", measured=True) is best  # order does not matter


def test_analytical_costs_and_memory_target_take_the_best_as_predicted() -> None:
    cands = [cand("zero_bubble", 8, 100.0, peak=300), cand("1f1b", 4, 101.0, peak=200)]
    assert _pick(cands, "speed", measured=False).kind == "zero_bubble"  # no timing noise
    assert _pick(cands, "memory", measured=True).kind == "1f1b"  # the smaller peak


def test_candidates_within_the_tolerance_are_simulated_too() -> None:
    pool = [cand("zero_bubble", 8, 100.0), cand("zero_bubble", 16, 100.5),
            cand("1f1b", 4, 100.0 * (1 + TIE_TOLERANCE)), cand("1f1b", 2, 110.0)]
    assert _to_simulate(pool, 2, "speed", True) == pool[:3]
    assert _to_simulate(pool, 2, "speed", False) == pool[:2]
    assert _to_simulate(pool, 1, "speed", True) == pool[:1]  # too big to simulate more
    assert _selection.TIE_TOLERANCE < 0.03  # below the 3 % a chosen plan may trail the fastest
