"""Node times from two profiled batches: the CostGraph fields, the line through two points,
and the cost model that reads it (no torch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopart.core.batch_lines import segment_scales, through_two_batches
from autopart.core.costgraph import BatchScale, CostGraph
from autopart.core.errors import PlanError
from autopart.solver._cost_model import CostModel
from tests.solver.oracles.stage_estimate import stage_estimates


def _times(g: CostGraph, scale: float) -> CostGraph:
    return replace(g, nodes=tuple(replace(n, fwd_us=n.fwd_us * scale,
                                          bwd_input_us=n.bwd_input_us * scale,
                                          bwd_weight_us=n.bwd_weight_us * scale)
                                  for n in g.nodes))


def test_the_line_through_two_smaller_batches_gives_the_full_batchs_times(build) -> None:
    full = build.chain(4, fwd=100.0, bwd=200.0, batch_size=16)
    # at 2 rows: 20 µs forward (a fixed 10 + 5 per row), at 4 rows: 30 µs
    low = replace(_times(full, 0.2), batch_size=2)
    high = replace(_times(full, 0.3), batch_size=4)
    g = through_two_batches(full, low, high)
    assert g.low_batch_size == 2 and g.low_times[0] == pytest.approx((20.0, 20.0, 20.0))
    # 10 + 5 x 16 = 90 µs forward at the full batch; bytes stay the full batch's
    assert g.nodes[0].fwd_us == pytest.approx(90.0)
    assert g.nodes[0].bwd_input_us == pytest.approx(90.0)
    assert g.nodes[0].output_bytes == full.nodes[0].output_bytes
    model = CostModel(g, build.cluster(2), batch_size=16, training=True, state_factor=2.0)
    for m, rows in ((8, 2), (4, 4), (2, 8)):  # t(b) = 10 + 5 b per part, 4 nodes x 3 parts
        assert model.time_us(0, 4, model.ratio(m)) == pytest.approx(4 * 3 * (10 + 5 * rows))
        assert model.part_us("fwd", 0, 4, model.ratio(m)) == pytest.approx(4 * (10 + 5 * rows))
    est = stage_estimates(model, [2], 4)
    assert est[0].fwd_us == pytest.approx(2 * 30.0) and est[0].bwd_us == pytest.approx(2 * 60.0)


def test_a_time_lower_at_the_larger_batch_is_held_flat(build) -> None:
    full = build.chain(2, fwd=100.0, bwd=200.0, batch_size=16)
    low = replace(_times(full, 0.3), batch_size=2)
    high = replace(_times(full, 0.2), batch_size=4)  # noise: lower at the larger batch
    g = through_two_batches(full, low, high)
    assert g.nodes[0].fwd_us == pytest.approx(30.0)
    model = CostModel(g, build.cluster(2), batch_size=16, training=False, state_factor=0.0)
    assert model.time_us(0, 2, model.ratio(2)) == pytest.approx(60.0)


def test_without_a_second_batch_the_single_profile_is_scaled_as_before(build) -> None:
    g = build.chain(3, fwd=100.0, bwd=200.0, batch_size=16)
    model = CostModel(g, build.cluster(2, overhead_us=10.0), batch_size=16, training=True,
                      state_factor=2.0)
    # per node: forward 10 + 90 b/b0, backward (one op) 10 + 190 b/b0
    assert model.time_us(0, 3, model.ratio(4)) == pytest.approx(3 * (10 + 90 / 4 + 10 + 190 / 4))
    est = stage_estimates(model, [1], 4)
    assert est[0].fwd_us == pytest.approx(10 + 90 / 4)


def test_paired_profiles_must_be_the_same_graph_at_smaller_batches(build) -> None:
    full = build.chain(3, batch_size=16)
    low = replace(build.chain(3, batch_size=2))
    with pytest.raises(PlanError, match="increasing and below the full batch"):
        through_two_batches(full, replace(low, batch_size=8), replace(low, batch_size=4))
    with pytest.raises(PlanError, match="differs from the one at batch 16"):
        through_two_batches(full, low, replace(build.chain(4), batch_size=4))
    with pytest.raises(PlanError, match="differs from the one at batch 16"):
        full.with_low_batch(build.chain(2, batch_size=2))
    with pytest.raises(PlanError, match="must be smaller"):
        full.with_low_batch(replace(low, batch_size=16))


def test_the_second_batch_survives_json_and_is_validated(build) -> None:
    full = build.chain(2, batch_size=16)
    g = full.with_low_batch(replace(_times(full, 0.25), batch_size=4))
    assert CostGraph.from_dict(g.to_dict()) == g
    old = full.to_dict()
    del old["low_batch_size"], old["low_times"]  # a profile cached before the fields existed
    assert CostGraph.from_dict(old) == full
    with pytest.raises(PlanError, match="low_times needs one"):
        replace(g, low_times=g.low_times[:1])
    with pytest.raises(PlanError, match="low_batch_size must be in"):
        replace(g, low_batch_size=32)


def test_a_backwards_measured_peak_at_two_batches_splits_into_fixed_and_per_row(build) -> None:
    # a node whose backward held 1200 bytes at 16 rows and 500 at 2 (its kernel's weight
    # copies: a fixed 400, plus 50 per row): at 4 rows it needs 400 + 200 + its 4-row
    # output's gradient (100 x 4 / 16 = 25), more than the gradients' formula says
    full = build.chain(1, fwd=100.0, bwd=200.0, out=100, param_bytes=300, batch_size=16)
    full = replace(full, nodes=(replace(full.nodes[0], transient_bytes=160,
                                        backward_peak_bytes=1200),))
    low = replace(full, batch_size=2, nodes=(replace(full.nodes[0], backward_peak_bytes=500),))
    g = full.with_low_batch(low)
    assert g.low_backward_peaks == (500,)
    assert CostGraph.from_dict(g.to_dict()) == g
    with pytest.raises(PlanError, match="low_backward_peaks needs one"):
        replace(g, low_backward_peaks=(500, 1))
    model = CostModel(g, build.cluster(1), batch_size=16, training=True, state_factor=2.0)
    assert model.transient_bytes(0, 1, model.ratio(4)) == 400 + 50 * 4 + 25
    # a node whose gradients need more (the loss's working set, folded into the last node):
    # those at 4 rows, not those plus the weight's gradient, which the measured peaks hold
    lossy = CostModel(replace(g, nodes=(replace(g.nodes[0], transient_bytes=4000),)),
                      build.cluster(1), batch_size=16, training=True, state_factor=2.0)
    assert lossy.transient_bytes(0, 1, lossy.ratio(4)) == 1000
    # one profile only: the gradients (160 x 4 / 16) and the weight's 300-byte new gradient
    one = CostModel(full, build.cluster(1), batch_size=16, training=True, state_factor=2.0)
    assert one.transient_bytes(0, 1, one.ratio(4)) == 40 + 300


def _two_point(build, n: int = 4) -> CostGraph:
    """A chain of ``n`` nodes at 16 rows whose parts take 10 + 5 b µs at b rows."""
    full = build.chain(n, fwd=100.0, bwd=200.0, batch_size=16)
    return through_two_batches(full, replace(_times(full, 0.2), batch_size=2),
                               replace(_times(full, 0.3), batch_size=4))


def test_a_measured_microbatch_replaces_the_line_there_segment_by_segment(build) -> None:
    g = _two_point(build)
    # at 8 rows the line says 50 µs per part; segment [0, 2) measured 80 / 150 µs (forward /
    # backward, i.e. 0.8 and 0.75 of the line's 100 / 200), segment [2, 4) 120 / 200
    scale = segment_scales(g, 8, (2,), [(80.0, 150.0), (120.0, 200.0)])
    assert scale.fwd == pytest.approx((0.8, 1.2)) and scale.bwd == pytest.approx((0.75, 1.0))
    scaled = replace(g, batch_scales=(scale,))
    model = CostModel(scaled, build.cluster(2), batch_size=16, training=True, state_factor=2.0)
    r = model.ratio(2)  # 8 rows
    assert model.part_us("fwd", 0, 2, r) == pytest.approx(80.0)
    assert model.part_us("bwd_input", 0, 2, r) + model.part_us("bwd_weight", 0, 2, r) \
        == pytest.approx(150.0)
    assert model.time_us(0, 4, r) == pytest.approx(80 + 150 + 120 + 200)
    est = stage_estimates(model, [1], 2)
    assert est[0].fwd_us == pytest.approx(40.0) and est[1].bwd_us == pytest.approx(75 + 200)
    # other microbatches keep the line
    line = CostModel(g, build.cluster(2), batch_size=16, training=True, state_factor=2.0)
    for m in (4, 8):
        assert model.time_us(0, 4, model.ratio(m)) == pytest.approx(
            line.time_us(0, 4, line.ratio(m)))
    # not training: forward only
    fwd_only = CostModel(scaled, build.cluster(2), batch_size=16, training=False,
                         state_factor=0.0)
    assert fwd_only.time_us(0, 4, r) == pytest.approx(200.0)


def test_the_loss_stays_on_its_line_in_a_segments_scale(build) -> None:
    g = _two_point(build, 2)
    # the loss's 30 / 40 µs at 8 rows are in the graph's last node but not in the segment
    # times measured there; the segments measured exactly the line's nodes otherwise
    lossy = replace(g, nodes=(g.nodes[0], replace(g.nodes[1], fwd_us=g.nodes[1].fwd_us + 30,
                                                  bwd_input_us=g.nodes[1].bwd_input_us + 40)))
    lossy = replace(lossy, low_times=(g.low_times[0], (g.low_times[1][0] + 30,
                                                       g.low_times[1][1] + 40,
                                                       g.low_times[1][2])))
    scale = segment_scales(lossy, 8, (), [(100.0, 200.0)], loss=(30.0, 40.0))
    assert scale.fwd == pytest.approx((1.0,)) and scale.bwd == pytest.approx((1.0,))


def test_batch_scales_survive_json_and_are_validated(build) -> None:
    g = replace(_two_point(build), batch_scales=(BatchScale(8, (2,), (0.9, 1.1), (1.0, 0.95)),))
    assert CostGraph.from_dict(g.to_dict()) == g
    assert g.scale_at(8) is g.batch_scales[0] and g.scale_at(4) is None
    with pytest.raises(PlanError, match="one forward and one backward factor > 0"):
        BatchScale(8, (2,), (0.9,), (1.0, 1.0))
    with pytest.raises(PlanError, match="one forward and one backward factor > 0"):
        BatchScale(8, (2,), (0.9, 0.0), (1.0, 1.0))
    with pytest.raises(PlanError, match="positions ascending"):
        BatchScale(8, (3, 2), (1.0,) * 3, (1.0,) * 3)
    with pytest.raises(PlanError, match="need a second profiled batch"):
        replace(build.chain(4, batch_size=16), batch_scales=g.batch_scales)
    with pytest.raises(PlanError, match="one scale per batch"):
        replace(g, batch_scales=g.batch_scales * 2)
    with pytest.raises(PlanError, match="2 segments"):
        segment_scales(g, 8, (2,), [(1.0, 1.0)])
