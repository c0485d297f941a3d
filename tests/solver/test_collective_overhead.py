"""The fixed cost per collective: the runtime's points, tp collectives and dp collectives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.core.errors import PlanError
from autopart.core.runtime_model import RuntimeDescription
from autopart.solver.data_parallel import data_parallel_cost
from autopart.solver.tensor_parallel_costs import shard_costs
from tests.solver.test_tensor_parallel_costs import _block


def test_points_are_read_off_a_line_held_at_its_ends() -> None:
    rt = RuntimeDescription(collective_overhead_points=((1000.0, 300.0), (100.0, 500.0)))
    assert rt.collective_overhead_points == ((100.0, 500.0), (1000.0, 300.0))  # sorted
    assert rt.collective_overhead_at(0.0) == 500.0  # held below the first work
    assert rt.collective_overhead_at(550.0) == pytest.approx(400.0)
    assert rt.collective_overhead_at(5000.0) == 300.0  # and beyond the last
    assert RuntimeDescription().collective_overhead_at(123.0) == 0.0
    assert RuntimeDescription(collective_overhead_points=((7.0, 9.0),)
                              ).collective_overhead_at(1e6) == 9.0


@pytest.mark.parametrize("points", [((-1.0, 5.0),), ((1.0, -5.0),), ((1.0, 2.0), (1.0, 3.0)),
                                    ((float("nan"), 1.0),)])
def test_bad_points_are_refused(points: tuple[tuple[float, float], ...]) -> None:
    with pytest.raises(PlanError, match="collective_overhead_points"):
        RuntimeDescription(collective_overhead_points=points)


def test_every_tp_collective_pays_the_fixed_cost_once() -> None:
    costs = _block()
    kw = {"bandwidth_bytes_per_s": 1e9, "latency_us": 1.0, "op_overhead_us": 5.0}
    plain = shard_costs(costs, 4, **kw)
    seen: list[float] = []

    def overhead(work_us: float) -> float:
        seen.append(work_us)
        return 100.0

    priced = shard_costs(costs, 4, collective_overhead=overhead, **kw)
    extra = {a.name: (b.fwd_us - a.fwd_us, b.bwd_input_us - a.bwd_input_us,
                      b.bwd_weight_us - a.bwd_weight_us)
             for a, b in zip(plain.nodes, priced.nodes, strict=True)}
    # forward: proj's all-reduce and the head's all-gather; backward: the "f" all-reduces of
    # qkv's input and of the head's input
    assert extra["proj"] == (100.0, 0.0, 0.0)
    assert extra["head"] == (100.0, 100.0, 0.0)
    assert extra["qkv"] == (0.0, 100.0, 0.0)
    assert extra["ln"] == extra["attn"] == extra["add"] == (0.0, 0.0, 0.0)
    # the work between two collectives: the split graph's time over its 4 collectives
    split_total = sum(nd.fwd_us + nd.bwd_input_us + nd.bwd_weight_us for nd in plain.nodes)
    ring_total = 2 * 12.0 + 12.0 + 9.0  # proj and the two "f" all-reduces, the head's gather
    assert seen[0] == pytest.approx((split_total - ring_total) / 4)


def test_the_low_batch_times_get_the_same_collectives() -> None:
    costs = _block()
    low = tuple((nd.fwd_us / 2, nd.bwd_input_us / 2, nd.bwd_weight_us / 2) for nd in costs.nodes)
    costs = replace(costs, batch_size=2, low_batch_size=1, low_times=low)
    kw = {"bandwidth_bytes_per_s": 1e9, "latency_us": 1.0, "op_overhead_us": 0.0}
    tp2 = shard_costs(costs, 2, collective_overhead=lambda work: 10.0 + work / 1000, **kw)
    by = {nd.name: i for i, nd in enumerate(costs.nodes)}
    # the low batch's split times: qkv 3 x 26.25, attention 11.25 + 2 x 21.25, proj
    # 3 x 11.25, head 3 x 51.25, ln 7.5, add 4.5: 332 µs over 4 collectives, 83 µs each
    fixed_low = 10.0 + 83.0 / 1000
    # proj: its split low forward, then the all-reduce of its 2000 bytes at the low batch
    # (2 x 1/2 x 2000 B / 1 GB/s = 2 µs, + 2 steps of 1 µs) and the fixed cost
    assert tp2.low_times[by["proj"]][0] == pytest.approx(11.25 + 4.0 + fixed_low)
    assert tp2.low_times[by["qkv"]][1] == pytest.approx(26.25 + 4.0 + fixed_low)
    assert tp2.low_times[by["ln"]] == low[by["ln"]]


def test_dp_collectives_pay_the_fixed_cost_each() -> None:
    kw = {"dp": 2, "bandwidth_bytes_per_s": 1e9, "latency_us": 0.0}
    for zero, per_step, per_mb in ((0, 1, 0), (1, 2, 0), (2, 0, 2), (3, 0, 3)):
        a = data_parallel_cost(4000, zero_stage=zero, **kw)
        b = data_parallel_cost(4000, zero_stage=zero, overhead_us=50.0, **kw)
        assert b.per_step_us - a.per_step_us == pytest.approx(50.0 * per_step)
        assert b.per_microbatch_us - a.per_microbatch_us == pytest.approx(50.0 * per_mb)
    assert data_parallel_cost(4000, zero_stage=0, overhead_us=50.0, dp=1,
                              bandwidth_bytes_per_s=1e9, latency_us=0.0).step_us(4) == 0.0
    with pytest.raises(PlanError, match="overhead_us"):
        data_parallel_cost(4000, zero_stage=0, overhead_us=-1.0, **kw)


def test_zero0_pays_its_buckets_copies() -> None:
    kw = {"dp": 2, "bandwidth_bytes_per_s": 1e9, "latency_us": 0.0}
    plain = data_parallel_cost(4000, zero_stage=0, **kw)
    packed = data_parallel_cost(4000, zero_stage=0, copy_bytes_per_s=2e9, **kw)
    # pack, divide, copy back: 3 x 4000 B at 2 GB/s
    assert packed.per_step_us - plain.per_step_us == pytest.approx(6.0)
    # FSDP2 (ZeRO 1-3): the all-gather copies the shard in and the whole out, the
    # reduce-scatter the gradients in and the shard out: 2 x 1.5 x 4000 B at 2 GB/s; one
    # replica packs nothing
    zero1 = data_parallel_cost(4000, zero_stage=1, copy_bytes_per_s=2e9, **kw)
    assert zero1.per_step_us - data_parallel_cost(4000, zero_stage=1, **kw).per_step_us == \
        pytest.approx(6.0)
    # per layer unit: the fixed cost and the ring steps once per unit and collective
    units = data_parallel_cost(4000, zero_stage=3, dp=2, bandwidth_bytes_per_s=1e9,
                               latency_us=1.0, overhead_us=10.0, units=3)
    one = data_parallel_cost(4000, zero_stage=3, dp=2, bandwidth_bytes_per_s=1e9,
                             latency_us=1.0, overhead_us=10.0)
    assert units.per_microbatch_us - one.per_microbatch_us == pytest.approx(3 * 2 * (10 + 1))
    with pytest.raises(PlanError, match="units=0"):
        data_parallel_cost(4000, zero_stage=3, units=0, **kw)
    assert data_parallel_cost(4000, zero_stage=0, copy_bytes_per_s=2e9, dp=1,
                              bandwidth_bytes_per_s=1e9, latency_us=0.0).per_step_us == 0.0
    with pytest.raises(PlanError, match="copy_bytes_per_s"):
        RuntimeDescription(copy_bytes_per_s=-1.0)


def test_the_tp_ops_own_copies_are_charged_at_the_copy_rate() -> None:
    costs = _block()
    kw = {"bandwidth_bytes_per_s": 1e9, "latency_us": 1.0, "op_overhead_us": 5.0}
    plain = shard_costs(costs, 4, **kw)
    copied = shard_costs(costs, 4, copy_bytes_per_s=1e9, **kw)  # 1000 bytes: 1 µs
    extra = {a.name: (b.fwd_us - a.fwd_us, b.bwd_input_us - a.bwd_input_us)
             for a, b in zip(plain.nodes, copied.nodes, strict=True)}
    # qkv: "f" clones ln's 4000-byte output in forward; its backward all-reduce clones the
    # gradient. proj: the forward all-reduce's clone. head: the gathered 8000-byte logits'
    # concatenation and its input's "f" clone in forward; backward, its 2000-byte slice of
    # the logits' gradient and the all-reduce's clone of its input's gradient
    assert extra["qkv"] == pytest.approx((4.0, 4.0))
    assert extra["proj"] == pytest.approx((4.0, 0.0))
    assert extra["head"] == pytest.approx((12.0, 6.0))
    assert extra["ln"] == extra["attn"] == extra["add"] == (0.0, 0.0)
