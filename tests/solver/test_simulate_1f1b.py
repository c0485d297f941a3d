"""The 1F1B replay without action lists equals the generic replay (step, busy time), and the
closed-form peaks the candidate keeps equal the replay's there."""

from __future__ import annotations

import random

import pytest

from autopart.core.errors import PlanError
from autopart.core.schedule import build_schedule
from autopart.solver._closed_form import closed_form_peaks, in_flight
from autopart.solver.simulate import StageCosts, simulate, simulate_1f1b


def _costs(rng: random.Random, p: int) -> StageCosts:
    def times(hi: float) -> list[float]:
        return [rng.choice([0.0, rng.uniform(0, hi)]) for _ in range(p)]

    return StageCosts(fwd_us=times(10), bwd_input_us=times(20), bwd_weight_us=times(5),
                      send_fwd_us=times(2), send_bwd_us=times(2),
                      static_bytes=[rng.randrange(100) for _ in range(p)],
                      saved_bytes=[rng.randrange(50) for _ in range(p)],
                      backward_extra_bytes=[rng.randrange(30) for _ in range(p)])


@pytest.mark.parametrize("seed", range(4))
def test_equal_to_the_generic_replay(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        p, m = rng.randint(1, 9), rng.randint(1, 24)
        c = _costs(rng, p)
        got = simulate(build_schedule("1f1b", p, m), c)
        step, busy = simulate_1f1b(p, m, c)
        assert step == got.step_time_us
        assert busy == got.busy_us
        assert list(got.peak_memory_bytes) == closed_form_peaks(c, in_flight("1f1b", p, m, 1), p)


def test_costs_it_does_not_replay_are_refused() -> None:
    c = _costs(random.Random(0), 3)
    with pytest.raises(PlanError, match="3 stages for 2 ranks"):
        simulate_1f1b(2, 4, c)
