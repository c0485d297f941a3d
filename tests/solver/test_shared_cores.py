"""More CPU ranks than cores: the simulator's processor-sharing replay and the core bound of
the closed form and the solver (hand-worked; no timing)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from autopart.core.errors import PlanError
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.schedule import build_schedule
from autopart.solver import SolveOptions, solve
from autopart.solver._closed_form import closed_form_step_us
from autopart.solver.simulate import StageCosts, core_bound_us, simulate


def _costs(fwd: list[float], bwd: list[float], ranks_per_core: float = 1.0,
           sends: float = 0.0) -> StageCosts:
    """Per stage F and B (all of B input-gradient, no W), blocking sends of ``sends`` µs."""
    n = len(fwd)
    return StageCosts(fwd, bwd, [0.0] * n, [sends] * (n - 1) + [0.0], [0.0] + [sends] * (n - 1),
                      [0] * n, [0] * n, [0] * n, ranks_per_core=ranks_per_core)


def test_core_bound_is_mean_busy_times_ranks_per_core() -> None:
    # 4 ranks on 2 cores, pipeline ranks busy 30 and 20 µs: 2 x 25
    assert core_bound_us([30.0, 20.0], 2.0) == 50.0
    assert core_bound_us([30.0, 20.0], 1.5) == pytest.approx(37.5)
    # a core each (GPU ranks; CPU ranks <= cores): no bound
    assert core_bound_us([30.0, 20.0], 1.0) == 0.0
    assert core_bound_us([30.0, 20.0], 0.5) == 0.0
    assert core_bound_us([], 2.0) == 0.0


def test_one_microbatch_shares_nothing() -> None:
    # 1F1B, p = 2, m = 1, F 10, B 20: only one rank ever runs, so sharing the cores costs
    # nothing: 0F0 [0, 10], 1F0 [10, 20], 1B0 [20, 40], 0B0 [40, 60]
    sched = build_schedule("1f1b", 2, 1)
    own = simulate(sched, _costs([10.0] * 2, [20.0] * 2))
    shared = simulate(sched, _costs([10.0] * 2, [20.0] * 2, ranks_per_core=2.0), record=True)
    assert own.step_time_us == shared.step_time_us == 60.0
    assert shared.core_bound_us == 60.0  # 2 x mean busy 30
    assert shared.busy_us == (30.0, 30.0)
    assert sorted((r, s, k, i, a, b) for r, s, k, i, a, b in shared.timeline) == [
        (0, 0, "B", 0, 40.0, 60.0), (0, 0, "F", 0, 0.0, 10.0),
        (1, 1, "B", 0, 20.0, 40.0), (1, 1, "F", 0, 10.0, 20.0)]


def test_two_microbatches_on_half_a_core_hand_worked() -> None:
    # 1F1B, p = 2, m = 2, F 10, B 20, ranks_per_core 2: one rank running gets a core, two
    # running get half a core each.
    # rank 0: 0F0 0F1 0B0 0B1; rank 1: 1F0 1B0 1F1 1B1
    # t=0   0F0 alone              -> 10
    # t=10  0F1 and 1F0 at 1/2     -> 30
    # t=30  1B0 alone (0B0 waits)  -> 50
    # t=50  0B0 and 1F1 at 1/2     -> 1F1 at 70, 0B0 has 10 left
    # t=70  0B0 and 1B1 at 1/2     -> 0B0 at 90, 1B1 has 10 left
    # t=90  1B1 alone              -> 100; then 0B1 alone -> 120
    sched = build_schedule("1f1b", 2, 2)
    assert simulate(sched, _costs([10.0] * 2, [20.0] * 2)).step_time_us == 90.0
    res = simulate(sched, _costs([10.0] * 2, [20.0] * 2, ranks_per_core=2.0), record=True)
    assert res.step_time_us == pytest.approx(120.0)
    ends = {(s, k, i): b for _, s, k, i, _, b in res.timeline}
    assert ends[(0, "F", 1)] == pytest.approx(30.0) and ends[(1, "F", 0)] == pytest.approx(30.0)
    assert ends[(1, "F", 1)] == pytest.approx(70.0) and ends[(0, "B", 0)] == pytest.approx(90.0)
    assert ends[(1, "B", 1)] == pytest.approx(100.0)
    assert res.busy_us == (60.0, 60.0)  # the work, not the stretched wall time
    assert res.bubble_fraction == pytest.approx(0.5)
    # the closed form: max(1F1B's (m - 1) x 30 + 60 = 90, 2 x mean busy 60) = 120
    c = _costs([10.0] * 2, [20.0] * 2, ranks_per_core=2.0)
    assert closed_form_step_us("1f1b", 2, 2, 1, c) == pytest.approx(120.0)
    # 3 ranks on 2 cores (1.5): two running get 2/3 of a core each
    # t=10 0F1, 1F0 -> 25; 1B0 -> 45; 0B0, 1F1 -> 1F1 at 60 (0B0 has 10 left);
    # 0B0, 1B1 -> 0B0 at 75 (1B1 has 10 left); 1B1 -> 85; 0B1 -> 105
    mid = simulate(sched, _costs([10.0] * 2, [20.0] * 2, ranks_per_core=1.5))
    assert mid.step_time_us == pytest.approx(105.0)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zero_bubble"])
def test_shared_replay_lies_between_its_bounds(kind: str) -> None:
    rng = random.Random(7)
    for _ in range(20):
        p, m = rng.choice([2, 3, 4]), rng.choice([1, 2, 4, 6])
        fwd = [rng.uniform(5, 20) for _ in range(p)]
        bwd = [rng.uniform(5, 40) for _ in range(p)]
        rpc = rng.choice([1.5, 2.0, 3.0])
        sched = build_schedule(kind, p, m)
        own = simulate(sched, _costs(fwd, bwd, sends=2.0)).step_time_us
        res = simulate(sched, _costs(fwd, bwd, rpc, sends=2.0))
        bound = core_bound_us(res.busy_us, rpc)
        # never faster than a core each, nor than the host's work over its cores; never
        # slower than every action stretched by ranks_per_core
        assert res.step_time_us >= max(own, bound) - 1e-6
        assert res.step_time_us <= rpc * own + 1e-6
        assert closed_form_step_us(kind, p, m, 1, _costs(fwd, bwd, rpc, sends=2.0)) <= (
            res.step_time_us * 1.02 + 1e-6)


def test_ranks_with_a_core_each_replay_as_before() -> None:
    sched = build_schedule("1f1b", 3, 4)
    base = _costs([10.0, 12.0, 9.0], [20.0, 25.0, 18.0], sends=1.0)
    for rpc in (0.5, 1.0):
        again = simulate(sched, dataclasses.replace(base, ranks_per_core=rpc))
        assert again.step_time_us == simulate(sched, base).step_time_us
        assert again.core_bound_us == 0.0


def test_bad_ranks_per_core_is_refused() -> None:
    with pytest.raises(PlanError, match="ranks_per_core=0.0 must be > 0"):
        RuntimeDescription(ranks_per_core=0.0)
    with pytest.raises(PlanError, match="ranks_per_core=-1.0 must be > 0"):
        _costs([1.0], [1.0], ranks_per_core=-1.0)


def test_the_solver_prices_shared_cores(build) -> None:  # type: ignore[no-untyped-def]
    # 4 equal nodes (F 10, B 20 at 8 rows), 2 ranks, m = 2 (4 rows per microbatch: F 5,
    # B 10 per node). A core each: 3 nodes then 1 (F 15 / B 30, F 5 / B 10) ties the even
    # cut at 90 (+ the 0.05 µs sends). Sharing the cores, the uneven cut's mean busy
    # (90 + 30) / 2 x 2 = 120 and its replay is longer; the even cut is the hand-worked
    # case above: 120
    costs = build.chain(4)
    opts = SolveOptions(batch_size=8, num_microbatches=2, schedule_kind="1f1b",
                        stages_per_rank=1, time_limit_s=5)
    own = solve(costs, build.cluster(2), opts)
    shared = solve(costs, build.cluster(2), dataclasses.replace(
        opts, runtime=RuntimeDescription(name="distributed", issue_threads=None,
                                         ranks_per_core=2.0)))
    assert len(shared.cuts) == 1 and shared.stages[0].predicted_fwd_us == pytest.approx(10.0)
    assert own.predicted_step_time_us == pytest.approx(90.1)
    assert shared.predicted_step_time_us == pytest.approx(120.2)


def test_the_plans_lower_bound_counts_the_shared_cores(build) -> None:  # type: ignore[no-untyped-def]
    # 4 nodes of F 10 + B 20 at 8 rows: 120 µs of work a step at any m, over 2 ranks 60;
    # with 2 ranks per core 120, which the hand-worked plan above reaches
    costs = build.chain(4)
    opts = SolveOptions(batch_size=8, num_microbatches=2, schedule_kind="1f1b",
                        stages_per_rank=1, time_limit_s=5)
    own = solve(costs, build.cluster(2), opts)
    shared = solve(costs, build.cluster(2), dataclasses.replace(
        opts, runtime=RuntimeDescription(ranks_per_core=2.0)))
    assert own.lower_bounds.step_time_us == pytest.approx(60.0)
    assert shared.lower_bounds.step_time_us == pytest.approx(120.0)
    assert shared.predicted_step_time_us >= shared.lower_bounds.step_time_us


def test_time_sharing_slows_compute_only_on_shared_cores(build) -> None:  # type: ignore[no-untyped-def]
    # the hand-worked plan above (even cut, 2 ranks on 2 per core: 120 µs + 0.2 µs of sends)
    # with every action's compute 1.5x longer: 180 + the same sends; with a core each the
    # factor changes nothing (90.1 as above)
    costs = build.chain(4)
    opts = SolveOptions(batch_size=8, num_microbatches=2, schedule_kind="1f1b",
                        stages_per_rank=1, time_limit_s=5)
    slowed = RuntimeDescription(name="distributed", issue_threads=None, ranks_per_core=2.0,
                                time_sharing_factor=1.5)
    shared = solve(costs, build.cluster(2), dataclasses.replace(opts, runtime=slowed))
    assert shared.stages[0].predicted_fwd_us == pytest.approx(15.0)
    assert shared.predicted_step_time_us == pytest.approx(180.2)
    own = solve(costs, build.cluster(2), dataclasses.replace(
        opts, runtime=dataclasses.replace(slowed, ranks_per_core=1.0)))
    assert own.predicted_step_time_us == pytest.approx(90.1)


def test_a_time_sharing_factor_below_one_is_refused() -> None:
    with pytest.raises(PlanError, match="time_sharing_factor=0.9 must be >= 1"):
        RuntimeDescription(time_sharing_factor=0.9)
