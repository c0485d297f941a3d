"""The banded chain DPs (solver.chain_dp) answer exactly as the full K x K tables did
(tests/solver/oracles/chain_dp_full.py): same values, cuts and recompute flags, ties included."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopart.core.errors import PlanError
from autopart.solver import chain_dp
from autopart.solver._closed_form import in_flight, objective_weights
from autopart.solver.chain import ChainProblem
from autopart.solver.chain_dp import chain_dp_hint, chain_min_max, chain_min_sum
from tests.solver.oracles import chain_dp_full as full

KINDS = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2),
         ("interleaved_1f1b", 3)]
EXAMPLES = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw: st.DrawFn) -> ChainProblem:
    """A ChainProblem of up to 16 segments, ties likely (small integer costs), often with caps
    tight enough that the parameter state bounds a stage's span (a band narrower than
    ``K - S + 1``), sometimes with as many stages as segments."""
    kind, v = draw(st.sampled_from(KINDS))
    p = draw(st.integers(1, 4 if v == 1 else 2))
    s = p * v
    m = p * draw(st.integers(1, 3)) if v > 1 else draw(st.integers(1, 6))
    k = draw(st.integers(s, s + 10))

    def ints(lo: int, hi: int, n: int) -> list[int]:
        return draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))

    seg_time, state, saved = ints(0, 12, k), ints(0, 60, k), ints(0, 20, k)
    w_stage, w_rank, w_sum = objective_weights(kind, p, m, v)
    # the state of about half the longest span (K - S + 1 segments) and some activations
    share = sum(state) * max(2, (k - s + 1) // 2) // k + 3 * max(saved) + 20
    caps = draw(st.none() | st.just(ints(40, 260, p)) | st.just(ints(share, 2 * share, p)))
    return ChainProblem(
        seg_time=tuple(seg_time), seg_fwd=tuple(ints(0, 5, k)),
        seg_bwd_weight=tuple(t // 2 for t in seg_time) if kind == "zero_bubble" else None,
        seg_split=tuple(ints(0, 3, k)) if kind == "zero_bubble" else None,
        cut_out=tuple(ints(0, 3, k - 1)), cut_in=tuple(ints(0, 3, k - 1)),
        num_ranks=p, stages_per_rank=v,
        speed=draw(st.none() | st.just(tuple(draw(st.sampled_from((1.0, 1.5)))
                                              for _ in range(p)))),
        w_stage=w_stage, w_rank=w_rank, w_sum=w_sum, seg_state=tuple(state),
        seg_saved=tuple(saved), cut_bytes=tuple(ints(0, 10, k - 1)),
        first_in_bytes=draw(st.integers(0, 10)), last_out_bytes=draw(st.integers(0, 10)),
        in_flight=in_flight(kind, p, m, v), outputs_held=draw(st.booleans()),
        rank_caps=None if caps is None else tuple(c * v for c in caps),
        recompute=draw(st.sampled_from(("none", "all", "auto"))),
        optimize=draw(st.sampled_from(("speed", "speed", "memory"))))


@EXAMPLES
@given(problems())
def test_banded_dps_equal_the_full_tables(prob: ChainProblem) -> None:
    assert chain_dp_hint(prob) == full.chain_dp_hint(prob)
    least = chain_min_max(prob)
    assert least == full.chain_min_max(prob)
    if prob.stages_per_rank > 1:
        with pytest.raises(PlanError, match="one stage per rank"):
            chain_min_sum(prob)
        return
    horizons = [None] if least is None else [None, least - 1, least, least + 2, least + 9]
    for horizon in horizons:
        assert chain_min_sum(prob, horizon) == full.chain_min_sum(prob, horizon)


def _hand(num_ranks: int, caps: tuple[int, ...] | None) -> ChainProblem:
    # six segments of state 10 each, 1F1B-like in-flight counts (p - s), no activations
    k = 6
    return ChainProblem(seg_time=(5, 1, 1, 1, 1, 5), seg_fwd=(0,) * k, cut_out=(0,) * (k - 1),
                        cut_in=(0,) * (k - 1), num_ranks=num_ranks, seg_state=(10,) * k,
                        seg_saved=(0,) * k, cut_bytes=(0,) * (k - 1),
                        in_flight=tuple(num_ranks - s for s in range(num_ranks)),
                        rank_caps=caps, recompute="none")


def test_band_width_is_the_stage_window_and_the_state_bound() -> None:
    # K - S + 1 without caps; with a cap of 25 bytes no stage holds three segments' state (30)
    assert chain_dp._window(_hand(2, None), 1) == 5
    assert chain_dp._window(_hand(2, (25, 25)), 1) == 2
    assert chain_dp._window(_hand(2, (50, 25)), 2) == 2   # the largest cap, divided
    assert chain_dp._window(_hand(2, (5, 5)), 1) == 1     # nothing fits; the band keeps 1
    assert chain_dp._window(_hand(6, None), 1) == 1       # as many stages as segments
    # 3 ranks, caps 25: two segments a stage, the 5s alone: (0 | 1 2 | 3 4 | 5) is 4 stages,
    # so 3 stages need (0 1 | 2 3 | 4 5), t = (6, 2, 6)
    prob = _hand(3, (25,) * 3)
    answer = chain_dp_hint(prob)
    assert answer is not None and answer.cuts == (1, 3) and answer.objective == 6
    assert answer == full.chain_dp_hint(prob)
    assert chain_dp_hint(_hand(2, (25, 25))) is None  # six segments of 10 need three stages


def test_a_narrower_band_reuses_the_last_wider_one() -> None:
    # the same arrays (key) at widths 5 then 2 then 5: the narrower is sliced from the wider
    wide, narrow = _hand(2, (10**6,) * 2), _hand(2, (25, 25))
    assert chain_dp._arrays_key(wide) == chain_dp._arrays_key(narrow)
    for prob in (wide, narrow, _hand(2, (30, 30)), wide):
        assert chain_dp_hint(prob) == full.chain_dp_hint(prob)
        assert chain_min_max(prob) == full.chain_min_max(prob)
