"""Ranks that share one device: the most they hold at once on the replayed times, hand-worked
(no profile, no timing)."""

from __future__ import annotations

import pytest

from autopart.core.errors import PlanError
from autopart.core.schedule import Action, build_schedule
from autopart.solver.simulate import StageCosts, rank_peaks, simulate
from autopart.solver.simulate_memory import device_peaks


def _costs(p: int, static: int = 100, saved: int = 10, extra: int = 50,
           ranks_per_core: float = 1.0) -> StageCosts:
    return StageCosts([1.0] * p, [1.0] * p, [1.0] * p, [0.0] * p, [0.0] * p, [static] * p,
                      [saved] * p, [extra] * p, [0] * p, [0] * p, [0] * p,
                      ranks_per_core=ranks_per_core)


def test_two_ranks_hand_worked() -> None:
    sched = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    timeline = [(0, 0, "F", 0, 0.0, 1.0), (1, 1, "F", 0, 1.0, 2.0), (1, 1, "B", 0, 2.0, 3.0),
                (0, 0, "B", 0, 3.0, 4.0)]
    c = _costs(2)
    # each rank: 100 static, 110 after its F, 160 during its B (110 + 50), 100 after it
    assert rank_peaks(sched, c) == (160, 160)
    # t = 2: rank 0 holds 110 (after its F), rank 1 is in its B (160): 270, not 160 + 160
    assert device_peaks(sched, c, timeline, [[0, 1]]) == (270,)
    assert device_peaks(sched, c, timeline, [[0], [1]]) == (160, 160)
    # an action that takes no time still counts at its instant
    instant = [*timeline[:2], (1, 1, "B", 0, 2.0, 2.0), timeline[3]]
    assert device_peaks(sched, c, instant, [[0, 1]]) == (270,)
    # both backwards at once: each rank holds its 110, and one working set (50) comes on
    # top, as the ranks of one device run one action at a time; never the sum, 320
    together = [*timeline[:2], (1, 1, "B", 0, 3.0, 4.0), timeline[3]]
    assert device_peaks(sched, c, together, [[0, 1]]) == (270,)
    # a larger working set on rank 1 is the one on top
    big = StageCosts([1.0] * 2, [1.0] * 2, [1.0] * 2, [0.0] * 2, [0.0] * 2, [100] * 2,
                     [10] * 2, [50, 80], [0] * 2, [0] * 2, [0] * 2)
    assert device_peaks(sched, big, together, [[0, 1]]) == (300,)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("per_core", [1.0, 4.0])
def test_a_group_never_exceeds_its_ranks_peaks_summed_and_a_rank_alone_is_its_peak(
        kind: str, per_core: float) -> None:
    sched = build_schedule(kind, 4, 8, 1)
    c = _costs(4, ranks_per_core=per_core)
    res = simulate(sched, c, record=True)
    alone = device_peaks(sched, c, res.timeline, [[0], [1], [2], [3]])
    assert alone == res.peak_memory_bytes
    (group,) = device_peaks(sched, c, res.timeline, [[0, 1, 2, 3]])
    assert max(res.peak_memory_bytes) <= group <= sum(res.peak_memory_bytes)
    if kind != "gpipe":  # backwards do not all fall together: less than the sum
        assert group < sum(res.peak_memory_bytes)


def test_a_timeline_without_the_action_is_refused() -> None:
    sched = [[Action(0, "F", 0)]]
    with pytest.raises(PlanError, match="record=True"):
        device_peaks(sched, _costs(1), [], [[0]])
    with pytest.raises(PlanError, match="rank 3 of a device group"):
        device_peaks(sched, _costs(1), [(0, 0, "F", 0, 0.0, 1.0)], [[3]])
