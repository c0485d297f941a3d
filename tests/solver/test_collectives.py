"""Ring collectives, host links and ZeRO's per-GPU state and collectives against hand-worked numbers."""

from __future__ import annotations

import pytest

from autopart.core.errors import PlanError
from autopart.core.topology import TOPOLOGY_PRESETS, HostTopology, host_topology, topology_for_device
from autopart.solver.collectives import all_gather_us, all_reduce_us, reduce_scatter_us
from autopart.solver.data_parallel import (
    data_parallel_cost,
    held_state_multiplier,
    state_multiplier,
)


def test_ring_all_reduce_hand_worked() -> None:
    # 1 GB over 8 ranks at 100 GB/s: 2 * 7/8 * 1e9 / 1e11 s = 17.5 ms
    assert all_reduce_us(1e9, 8, 100e9) == pytest.approx(17_500.0)
    # plus 2 * (8 - 1) steps of 5 µs
    assert all_reduce_us(1e9, 8, 100e9, 5.0) == pytest.approx(17_570.0)


def test_reduce_scatter_and_all_gather_hand_worked() -> None:
    # 1 GB over 4 ranks at 50 GB/s: 3/4 * 1e9 / 5e10 s = 15 ms, plus 3 steps of 2 µs
    assert reduce_scatter_us(1e9, 4, 50e9, 2.0) == pytest.approx(15_006.0)
    assert all_gather_us(1e9, 4, 50e9, 2.0) == pytest.approx(15_006.0)
    assert all_reduce_us(1e9, 4, 50e9, 2.0) == pytest.approx(30_012.0)


def test_one_rank_or_no_bytes_costs_nothing() -> None:
    assert all_reduce_us(1e9, 1, 1e9, 9.0) == 0.0
    assert reduce_scatter_us(0, 8, 1e9, 9.0) == 0.0


@pytest.mark.parametrize("args", [(-1, 2, 1e9, 0.0), (1, 0, 1e9, 0.0), (1, 2, 0.0, 0.0),
                                  (1, 2, 1e9, -1.0)])
def test_bad_collective_arguments(args: tuple[float, int, float, float]) -> None:
    with pytest.raises(PlanError, match="need bytes >= 0"):
        all_reduce_us(*args)


def test_dgx_a100_links() -> None:
    topo = host_topology("DGX-A100")
    assert topo.gpus_per_host == 8
    # tp 8 stays inside the host: NVLink 300 GB/s each way at 80 % bus efficiency
    assert topo.link(8) == (pytest.approx(240e9), 1.0)
    # a group spanning two hosts crosses InfiniBand: 25 GB/s per GPU at 80 %
    assert topo.link(16) == (pytest.approx(20e9), 5.0)
    assert TOPOLOGY_PRESETS["dgx-h100"].inter_host_bandwidth_bytes_per_s == 50e9


def test_topology_errors_and_fallback() -> None:
    with pytest.raises(PlanError, match="unknown host topology 'dgx-z'.*dgx-a100"):
        host_topology("dgx-z")
    with pytest.raises(PlanError, match="gpus_per_host must be >= 1"):
        HostTopology("x", 0, 1e9, 1e9)
    with pytest.raises(PlanError, match="collective_efficiency"):
        HostTopology("x", 8, 1e9, 1e9, collective_efficiency=1.5)
    assert topology_for_device("a100-80gb", 1.0, 1.0).name == "dgx-a100"
    cpu = topology_for_device("cpu", 1e10, 2.0)
    assert cpu.gpus_per_host == 1 and cpu.link(1) == (pytest.approx(0.8e10), 2.0)


def test_state_multiplier_hand_count() -> None:
    # bf16 weights (1x), bf16 gradients (1x), fp32 master + two Adam moments (6x), dp = 4
    assert state_multiplier(0, 4, 6.0) == 8.0          # 16 bytes per 2-byte parameter
    assert state_multiplier(1, 4, 6.0) == 1 + 1 + 1.5  # optimizer state / 4
    assert state_multiplier(2, 4, 6.0) == 1 + 7 / 4    # + gradients / 4
    assert state_multiplier(3, 4, 6.0) == 8 / 4        # everything / 4
    assert state_multiplier(1, 1, 6.0) == 8.0          # one replica shards nothing
    with pytest.raises(PlanError, match="zero_stage=4 is not a ZeRO stage; valid: 0"):
        state_multiplier(4, 2, 2.0)


def test_held_state_multiplier_hand_count() -> None:
    # float32 AdamW (k = 2, g = 1) at dp = 2: shards (1 + 2) / 2, + sharded grads 1 / 2 at
    # ZeRO 2-3; every stage gathered (1) and its unsharded gradients (1); FSDP2's kept
    # buffers: one (ZeRO-1: 1), the all-gather output and reduce-scatter input (ZeRO 2-3: 2)
    assert held_state_multiplier(0, 2, 2.0) == 4.0
    assert held_state_multiplier(1, 2, 2.0) == 1.5 + 1 + 1 + 1
    assert held_state_multiplier(2, 2, 2.0) == 2.0 + 1 + 1 + 2
    assert held_state_multiplier(3, 2, 2.0) == 2.0 + 1 + 1 + 2
    # fp32 gradients of bf16 weights (g = 2), Adam's 6x, dp = 4: ZeRO-3 (1 + 2 + 6) / 4 +
    # 1 + 2 + (1 + 2); ZeRO-1 (1 + 6) / 4 + 1 + 2 + max(1, 2)
    assert held_state_multiplier(3, 4, 6.0, 2.0) == 9 / 4 + 6
    assert held_state_multiplier(1, 4, 6.0, 2.0) == 7 / 4 + 5
    # one replica shards nothing, whatever the stage
    assert held_state_multiplier(3, 1, 6.0) == 8.0
    with pytest.raises(PlanError, match="zero_stage=5 is not a ZeRO stage; valid: 0"):
        held_state_multiplier(5, 2, 2.0)


def test_data_parallel_cost_hand_worked() -> None:
    # 1 GB of gradients over dp 4 at 20 GB/s: all-reduce 2 * 3/4 * 1e9 / 2e10 s = 75 ms
    z0 = data_parallel_cost(10**9, dp=4, zero_stage=0, bandwidth_bytes_per_s=20e9,
                            latency_us=0.0)
    assert (z0.per_step_us, z0.per_microbatch_us) == (pytest.approx(75_000.0), 0.0)
    # ZeRO-1: one all-gather of the parameters (37.5 ms) and one reduce-scatter of the
    # gradients (37.5 ms) per step
    z1 = data_parallel_cost(10**9, dp=4, zero_stage=1, bandwidth_bytes_per_s=20e9,
                            latency_us=0.0)
    assert (z1.per_step_us, z1.per_microbatch_us) == (pytest.approx(75_000.0), 0.0)
    # ZeRO-2 reshards after every backward: per microbatch an all-gather (37.5 ms) and a
    # reduce-scatter of fp32 gradients of bf16 weights (2 GB: 75 ms); 4 microbatches
    z2 = data_parallel_cost(10**9, dp=4, zero_stage=2, bandwidth_bytes_per_s=20e9,
                            latency_us=0.0, gradient_factor=2.0)
    assert (z2.per_step_us, z2.per_microbatch_us) == (0.0, pytest.approx(112_500.0))
    assert z2.step_us(4) == pytest.approx(450_000.0)
    # ZeRO-3: per microbatch two all-gathers and a reduce-scatter; 4 microbatches
    z3 = data_parallel_cost(10**9, dp=4, zero_stage=3, bandwidth_bytes_per_s=20e9,
                            latency_us=0.0)
    assert z3.per_microbatch_us == pytest.approx(112_500.0)
    assert z3.step_us(4) == pytest.approx(450_000.0)
    # gloo's reduce-scatter reduces the whole buffer: the all-reduce's 75 ms
    gloo = data_parallel_cost(10**9, dp=4, zero_stage=3, bandwidth_bytes_per_s=20e9,
                              latency_us=0.0, reduce_scatter_as_all_reduce=True)
    assert gloo.per_microbatch_us == pytest.approx(150_000.0)
    # one replica: nothing to reduce or gather
    assert data_parallel_cost(10**9, dp=1, zero_stage=3, bandwidth_bytes_per_s=20e9,
                              latency_us=0.0).step_us(4) == 0.0
