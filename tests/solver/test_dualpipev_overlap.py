"""DualPipe-V's forward-backward pairs with expert parallelism priced as the distributed
runtime runs them (each pair at once, on two threads): a hand count of one pair, the
simulator against the closed form, and the all-to-alls recorded apart by expert_costs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.core.errors import PlanError
from autopart.core.plan_rules import overlaps_expert_exchanges
from autopart.core.schedule import build_schedule
from autopart.solver._closed_form import closed_form_step_us
from autopart.solver.simulate import StageCosts, simulate


def _costs(p: int, exchange: bool) -> StageCosts:
    n = 2 * p
    zeros = [0] * n
    extra = dict(fwd_exchange_us=[4.0] * n, bwd_exchange_us=[6.0] * n) if exchange else {}
    return StageCosts([10.0] * n, [12.0] * n, [8.0] * n, [0.0] * n, [0.0] * n, zeros, zeros,
                      zeros, **extra)


def test_a_pair_takes_the_longer_thread_or_both_computes_by_hand() -> None:
    c = _costs(1, True)
    # F 10 (4 of it all-to-all) beside B 20 (6): computes 6 + 14 = 20, chains 10 and 20
    assert c.pair_us(1, 0) == 20.0
    assert replace(c, fwd_exchange_us=[1.0, 1.0], bwd_exchange_us=[1.0, 1.0]).pair_us(1, 0) == 28.0
    # p = 1, m = 2: 0F0 1F0 0F1 1B0 (not a pair: torch keeps the last rank's first apart)
    # [1F1 + 0B0] 1B1 0I1 0W1 = 10 + 10 + 10 + 20 + pair + 20 + 12 + 8
    sched = build_schedule("dualpipev", 1, 2, 2)
    assert simulate(sched, _costs(1, False)).step_time_us == 120.0
    assert simulate(sched, c).step_time_us == 110.0
    assert closed_form_step_us("dualpipev", 1, 2, 2, c) == 110.0


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 64)])
def test_pairs_shorten_the_replay_and_the_closed_form_follows_it(p: int, m: int) -> None:
    sched = build_schedule("dualpipev", p, m, 2)
    alone, paired = _costs(p, False), _costs(p, True)
    before, after = simulate(sched, alone).step_time_us, simulate(sched, paired).step_time_us
    assert after < before
    # the closed form (the busiest rank's load less what its pairs save, plus the bubble)
    # estimates the replay within 5 % (at p = 8, m = 16: 954 against 912), as without pairs
    closed = closed_form_step_us("dualpipev", p, m, 2, paired)
    assert closed == pytest.approx(after, rel=0.05)
    assert closed < closed_form_step_us("dualpipev", p, m, 2, alone)


def test_exchange_columns_are_for_dualpipev_schedules_only() -> None:
    with pytest.raises(PlanError, match="DualPipe-V schedules only"):
        simulate(build_schedule("zbv", 2, 4, 2), _costs(2, True))


def test_the_runtime_overlaps_only_where_no_other_collective_runs_in_an_action() -> None:
    assert overlaps_expert_exchanges("dualpipev", ep=2)
    assert overlaps_expert_exchanges("dualpipev", ep=2, zero_stage=1)
    assert not overlaps_expert_exchanges("dualpipev", ep=1)
    assert not overlaps_expert_exchanges("zbv", ep=2)
    assert not overlaps_expert_exchanges("dualpipev", ep=2, tp=2)
    assert not overlaps_expert_exchanges("dualpipev", ep=2, cp=2)
    assert not overlaps_expert_exchanges("dualpipev", ep=2, zero_stage=2)


def test_the_layout_search_hides_them_where_collectives_do_not_share_the_cores() -> None:
    from autopart.core.runtime_model import RuntimeDescription
    from autopart.solver import SolveOptions
    from autopart.solver.layout_search import LayoutCandidate, hides_expert_exchanges

    gpu = SolveOptions(batch_size=8)
    cpu = replace(gpu, runtime=RuntimeDescription(collectives_share_compute=True))
    at = LayoutCandidate(1, 2, 2, 0, 0.0, 0, ep=2)
    assert hides_expert_exchanges(at, gpu)
    assert not hides_expert_exchanges(at, cpu)  # CPU ranks run the pairs one after the other
    assert not hides_expert_exchanges(replace(at, zero_stage=3), gpu)
    assert not hides_expert_exchanges(replace(at, ep=1), gpu)
