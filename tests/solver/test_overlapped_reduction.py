"""ZeRO-0's gradient all-reduce overlapped with each stage's last backward: the tail the cost
model prices (against hand counts), the layout search that records it in the plan, and the
SC'21 pricing (after the flush) kept behind the switch."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autopart.core.errors import PlanError
from autopart.core.layout import grad_bucket_elements
from autopart.core.runtime_model import RuntimeDescription
from autopart.solver.collectives import all_reduce_us
from autopart.solver.data_parallel import bucket_sizes, overlapped_reduction_us
from autopart.solver.layout_search import solve_layout
from tests.solver.test_layout_search import DEV, TOPO, _gpt, _layout, _options


def _flat(us_per_byte: float, fixed: float = 0.0):  # type: ignore[no-untyped-def]
    return lambda nbytes: fixed + us_per_byte * nbytes


def test_bucket_sizes_are_full_but_the_last() -> None:
    assert bucket_sizes(0, 10) == []
    assert bucket_sizes(25, 10) == [10, 10, 5]
    assert bucket_sizes(20, 10) == [10, 10]


def test_megatron_core_bucket_size() -> None:
    # max(40e6, 1e6 x dp) elements (Megatron-Core's DistributedDataParallelConfig)
    assert grad_bucket_elements(8) == 40_000_000
    assert grad_bucket_elements(64) == 64_000_000
    with pytest.raises(PlanError, match="dp=0"):
        grad_bucket_elements(0)


def test_one_stage_hides_all_but_what_outruns_its_backward() -> None:
    # one stage, backward 100 µs, 4 buckets of 10 elements (4 bytes each) ready at 25, 50,
    # 75, 100 µs into it (time -100 .. 0); each takes 30 µs: 25 -> 55, 55 -> 85, 85 -> 115,
    # 115 -> 145, i.e. 45 µs after the schedule's end
    got = overlapped_reduction_us([160], [40], [0], [100.0], _flat(30 / 40), split_backward=False,
                                  bucket_elements=10)
    assert got == pytest.approx((45.0,))
    # buckets faster than the backward: only the last one's time is exposed
    got = overlapped_reduction_us([160], [40], [0], [100.0], _flat(5 / 40), split_backward=False,
                                  bucket_elements=10)
    assert got == pytest.approx((5.0,))


def test_a_split_backward_exposes_the_whole_reduction() -> None:
    got = overlapped_reduction_us([160], [40], [0], [100.0], _flat(5 / 40), split_backward=True,
                                  bucket_elements=10)
    assert got == pytest.approx((20.0,))


def test_later_stages_finish_earlier_and_hide_behind_the_drain() -> None:
    # two stages on two ranks, backward 100 µs each: stage 1's last backward ends at -100,
    # so its one bucket (40 elements, 150 µs) ends at +50; stage 0's (10 µs) at +10
    got = overlapped_reduction_us([40, 160], [10, 40], [0, 1], [100.0, 100.0],
                                  lambda b: 10.0 if b < 100 else 150.0, split_backward=False,
                                  bucket_elements=40)
    assert got == pytest.approx((10.0, 50.0))
    # two stages of one rank (interleaved): one link, buckets in the order they are ready:
    # stage 1's at -100 runs to +50, then stage 0's (ready at 0) to +200
    got = overlapped_reduction_us([160, 160], [40, 40], [0, 0], [100.0, 100.0],
                                  _flat(150 / 160), split_backward=False, bucket_elements=40)
    assert got == pytest.approx((200.0,))


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(PlanError, match="one per stage"):
        overlapped_reduction_us([1, 2], [1], [0, 1], [1.0, 1.0], _flat(1.0),
                                split_backward=False, bucket_elements=4)


def _serialized_gap(plan) -> float:  # type: ignore[no-untyped-def]
    # what the flush-then-reduce pricing adds over the pipeline: one all-reduce of the
    # fullest rank's gradients on the dp link (TOPO: 4 GPUs per host, tp 1 x dp 2 inside one)
    held = max(sum(plan.stages[s].param_bytes for s in r.stage_indices) for r in plan.ranks)
    return all_reduce_us(held, 2, TOPO.intra_host_bandwidth_bytes_per_s, TOPO.intra_host_latency_us)


def test_the_layout_search_prices_the_overlap_and_records_it() -> None:
    costs = _gpt(4, scale=50.0)
    opts = _options(schedule_kind="1f1b", num_microbatches=4)
    overlapped = solve_layout(costs, DEV, opts, _layout(4, tp=1, pp=2, dp=2, zero_stage=0))
    flushed = solve_layout(costs, DEV, opts, _layout(4, tp=1, pp=2, dp=2, zero_stage=0,
                                                     overlap_grad_reduce=False))
    assert overlapped.overlap_grad_reduce and not flushed.overlap_grad_reduce
    assert [c.position for c in overlapped.cuts] == [c.position for c in flushed.cuts]
    assert flushed.predicted_step_time_us == pytest.approx(
        overlapped.predicted_step_time_us - _exposed(overlapped) + _serialized_gap(flushed),
        abs=1e-2)
    assert overlapped.predicted_step_time_us <= flushed.predicted_step_time_us


def _big(costs, k: int):  # type: ignore[no-untyped-def]
    """``costs`` with every parameter ``k`` times larger (the same compute)."""
    return replace(costs, nodes=tuple(replace(nd, param_bytes=nd.param_bytes * k)
                                      for nd in costs.nodes),
                   param_sizes={p: b * k for p, b in costs.param_sizes.items()},
                   param_numel={p: n * k for p, n in costs.param_numel.items()})


def test_stages_of_several_buckets_hide_all_but_the_last() -> None:
    # 2000x the parameters: rank 0 holds ~88M elements, 3 buckets of <= 4e7 at dp 2, the first
    # two reduced during its last backward; the flushed pricing pays all three after it
    costs = _big(_gpt(4, scale=50.0), 2000)
    opts = _options(schedule_kind="1f1b", num_microbatches=4)
    overlapped = solve_layout(costs, DEV, opts, _layout(4, tp=1, pp=2, dp=2, zero_stage=0))
    flushed = solve_layout(costs, DEV, opts, _layout(4, tp=1, pp=2, dp=2, zero_stage=0,
                                                     overlap_grad_reduce=False))
    assert overlapped.overlap_grad_reduce
    saved = flushed.predicted_step_time_us - overlapped.predicted_step_time_us
    assert saved > 0.5 * _serialized_gap(flushed)


def _exposed(plan) -> float:  # type: ignore[no-untyped-def]
    # the tail by hand: each rank's one bucket (the stages are far below 4e7 elements) is
    # ready when its last backward ends; stage 1's ends one stage-0 backward before the end
    ring = {r.rank: all_reduce_us(sum(plan.stages[s].param_bytes for s in r.stage_indices), 2,
                                  TOPO.intra_host_bandwidth_bytes_per_s,
                                  TOPO.intra_host_latency_us) for r in plan.ranks}
    return max(ring[0], ring[1] - plan.stages[0].predicted_bwd_us, 0.0)


def test_zero_1_to_3_and_cpu_ranks_keep_the_reduction_after_the_flush() -> None:
    costs = _gpt(4, scale=50.0)
    opts = _options(schedule_kind="1f1b", num_microbatches=4)
    sharded = solve_layout(costs, DEV, opts, _layout(4, tp=1, pp=2, dp=2, zero_stage=1))
    assert not sharded.overlap_grad_reduce
    # CPU ranks: gloo reduces on the ranks' own cores, so the overlap hides nothing and the
    # step is priced as the flushed one (the plan still runs the overlapped reduction)
    cpu = replace(opts, runtime=RuntimeDescription(collectives_share_compute=True))
    on_cpu = solve_layout(costs, DEV, cpu, _layout(4, tp=1, pp=2, dp=2, zero_stage=0))
    flushed = solve_layout(costs, DEV, cpu, _layout(4, tp=1, pp=2, dp=2, zero_stage=0,
                                                    overlap_grad_reduce=False))
    assert on_cpu.overlap_grad_reduce
    assert on_cpu.predicted_step_time_us == pytest.approx(flushed.predicted_step_time_us)


def test_a_plan_refuses_overlap_without_zero_0_replicas() -> None:
    plan = solve_layout(_gpt(2), DEV, _options(schedule_kind="1f1b", num_microbatches=2),
                        _layout(4, tp=1, pp=2, dp=2, zero_stage=2))
    with pytest.raises(PlanError, match="overlap_grad_reduce=True with dp=2 and zero_stage=2"):
        replace(plan, overlap_grad_reduce=True)
    d = plan.to_dict()
    del d["overlap_grad_reduce"]  # a plan written before the field loads as flushed
    assert type(plan).from_dict(d).overlap_grad_reduce is False
    assert math.isfinite(plan.predicted_step_time_us)
