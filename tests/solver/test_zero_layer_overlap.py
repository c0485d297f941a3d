"""ZeRO 2-3 with one FSDP unit per layer on GPUs: the gathers prefetched one unit ahead and
the reduce-scatters launched at each unit's post-backward, priced by what they leave exposed
(hand-counted timelines), and the layout search pricing a plan that way where the runtime's
collectives run beside compute (after the flush on CPU ranks)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.core.errors import PlanError
from autopart.core.runtime_model import RuntimeDescription
from autopart.core.topology import HostTopology
from autopart.solver.data_parallel import UnitSegment, layer_units_exposed_us
from autopart.solver.layout_search import solve_layout
from tests.solver.test_layout_search import DEV, _gpt, _layout, _options

#: root (embeddings) -> layer 1 -> layer 2 -> root (head): forward / backward µs
SEGMENTS = [UnitSegment(0, 1.0, 2.0), UnitSegment(1, 10.0, 20.0), UnitSegment(2, 10.0, 20.0),
            UnitSegment(0, 1.0, 2.0)]
GATHER = [5.0, 4.0, 4.0]
SCATTER = [6.0, 3.0, 3.0]


def test_zero3_timeline_by_hand() -> None:
    # forward: root's gather 0-5 (waited), layer 1's prefetched 5-9 (waited at 6 -> 9),
    # layer 2's 9-13 under layer 1 (9-19): 30 µs for 22 of compute -> 8 exposed.
    # backward: root's gather 0-5, layer 2's 5-9 (the root's head runs 5-7, waits to 9),
    # layer 1's 9-13 under layer 2 (9-29), layer 2's reduce-scatter 29-32 under layer 1
    # (29-49), layer 1's 49-52, the root's embedding 49-51, its reduce-scatter 52-58: 58
    # for 44 of compute -> 14
    assert layer_units_exposed_us(SEGMENTS, GATHER, SCATTER, zero_stage=3, root=0) == \
        pytest.approx((8.0, 14.0))


def test_zero2_gathers_only_in_the_forward() -> None:
    # backward: no gathers; layer 2's scatter 22-25, layer 1's 42-45, the root's 45-51
    # against compute ending at 44 -> 7
    assert layer_units_exposed_us(SEGMENTS, GATHER, SCATTER, zero_stage=2, root=0) == \
        pytest.approx((8.0, 7.0))


def test_slow_links_expose_every_layer_and_fast_ones_only_the_edges() -> None:
    layers = [UnitSegment(u, 10.0, 20.0) for u in range(8)]
    fast = layer_units_exposed_us(layers, [1.0] * 8, [1.0] * 8, zero_stage=3, root=None)
    # the first layer's gather in each pass and the last reduce-scatter
    assert fast == pytest.approx((1.0, 2.0))
    slow = layer_units_exposed_us(layers, [30.0] * 8, [30.0] * 8, zero_stage=3, root=None)
    # forward: gathers back to back, 30 apart, the last layer starts at 8 x 30 = 240 and ends
    # at 250 against 80 of compute
    assert slow[0] == pytest.approx(170.0)
    # backward: one queue of 8 gathers and 8 scatters: at least their 480 µs
    assert slow[1] >= 480.0 - 160.0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(PlanError, match="ZeRO 2-3"):
        layer_units_exposed_us(SEGMENTS, GATHER, SCATTER, zero_stage=1, root=0)
    with pytest.raises(PlanError, match="must index them"):
        layer_units_exposed_us(SEGMENTS, GATHER[:2], SCATTER[:2], zero_stage=3, root=0)


def _slow_topology(bandwidth: float) -> HostTopology:
    return HostTopology("test-host", 4, bandwidth, bandwidth, 1.0, 4.0, 1.0, "made up for tests")


@pytest.mark.parametrize("zero", [2, 3])
def test_layout_search_prices_the_overlap_on_gpus_and_not_on_cpu_ranks(zero: int) -> None:
    costs = _gpt(4, scale=50.0)
    opts = _options(schedule_kind="1f1b", num_microbatches=4)
    layout = replace(_layout(4, tp=1, pp=1, dp=4, zero_stage=zero),
                     topology=_slow_topology(2e8))
    gpu = solve_layout(costs, DEV, opts, layout)
    cpu = solve_layout(costs, DEV, replace(opts, runtime=RuntimeDescription(
        collectives_share_compute=True)), layout)
    assert gpu.zero_layer_units and cpu.zero_layer_units
    compute = sum(st.predicted_fwd_us + st.predicted_bwd_us for st in gpu.stages) * 4
    # the per-layer overlap hides part of what the serialized pricing charges, never all
    assert compute < gpu.predicted_step_time_us < cpu.predicted_step_time_us
    # a link fast enough hides all but a microbatch's first gathers and last scatters
    fast = solve_layout(costs, DEV, opts, replace(layout, topology=_slow_topology(1e13)))
    assert fast.predicted_step_time_us - compute < 0.02 * compute
    # the baselines (other schedules of the same layout) pay the same exposed collectives
    for b in gpu.baselines:
        assert b.predicted_step_time_us >= compute


def test_a_split_schedule_is_weighed_against_the_layer_units_it_gives_up() -> None:
    # pp 2 x dp 2, ZeRO-1 on GPUs: with layer units the pipeline search would pick
    # DualPipe-V, which runs one FSDP unit per stage (its reduce-scatters then after the
    # flush). The layout's plan is the better of the split schedules so priced and the
    # schedules that keep the layer units (interleaved 1F1B here, 2 % faster); the search
    # used to take DualPipe-V's whole-stage price as it came.
    costs = _gpt(4, scale=50.0)
    layout = replace(_layout(4, tp=1, pp=2, dp=2, zero_stage=1), topology=_slow_topology(1e9))
    opts = _options(8)
    plan = solve_layout(costs, DEV, opts, layout)
    whole = solve_layout(costs, DEV, replace(opts, schedule_kind="dualpipev"), layout)
    kept = solve_layout(costs, DEV, replace(opts, split_backward=False), layout)
    assert not whole.zero_layer_units and kept.zero_layer_units
    assert plan.zero_layer_units and plan.schedule_kind == "interleaved_1f1b"
    assert plan.predicted_step_time_us == kept.predicted_step_time_us \
        < whole.predicted_step_time_us


def test_split_backward_picks_the_schedules_by_how_they_run_the_backward() -> None:
    split = {"zero_bubble", "zbv", "dualpipev"}
    whole = {kind for kind, _ in _options(8, split_backward=False).configurations(4)}
    assert whole and not whole & split
    assert {kind for kind, _ in _options(8, split_backward=True).configurations(4)} == split
    assert {k for k, _ in _options(8).configurations(4)} == whole | split
    with pytest.raises(PlanError, match="split_backward=False leaves in"):
        _options(8, schedule_kind="zero_bubble", split_backward=False)
    with pytest.raises(PlanError, match="split_backward=True leaves in"):
        _options(8, schedule_kind="1f1b", split_backward=True)
