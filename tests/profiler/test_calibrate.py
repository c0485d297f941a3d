"""Whole-graph calibration of a profile, and the two-batch profile of profile_model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from autopart.core.capture import capture
from autopart.planning import profile_model
from autopart.profiler import profile_graph
from autopart.profiler.batch_points import batch_points, scaled_batch_points, with_host_times_of
from autopart.profiler.calibrate import (
    calibrate_to_segments,
    calibrate_to_whole_graph,
    segment_cuts,
    segment_times,
    whole_graph_times,
)
from autopart.solver import find_candidates


def _bn_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.randn(8, 16)


def test_whole_graph_times_leave_the_model_as_it_was() -> None:
    model, x = _bn_model()
    model.train()
    captured = capture(model, (x,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    fwd_us, bwd_us = whole_graph_times(captured, captured.flatten_inputs((x,), {}), "cpu",
                                       budget_s=0.05)
    assert fwd_us > 0 and bwd_us > 0
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():  # running statistics included
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_calibration_keeps_the_node_shares_and_matches_the_whole_graph() -> None:
    model, x = _bn_model()
    captured = capture(model, (x,))
    costs = profile_graph(captured, captured.flatten_inputs((x,), {}))
    scaled = calibrate_to_whole_graph(costs, 1000.0, 3000.0)
    assert scaled.total_fwd_us() == pytest.approx(1000.0)
    assert scaled.total_bwd_us() == pytest.approx(3000.0)
    big = max(range(len(costs.nodes)), key=lambda i: costs.nodes[i].fwd_us)
    assert scaled.nodes[big].fwd_us / 1000.0 == pytest.approx(
        costs.nodes[big].fwd_us / costs.total_fwd_us())
    assert calibrate_to_whole_graph(costs, 0.0, 0.0) == costs  # nothing measured: unchanged


def test_the_two_profiled_microbatches() -> None:
    # the smallest microbatch, and m = 2 x ranks (else m = ranks)
    assert batch_points(32, (1, 2, 4, 8, 16), 2) == (16, 4)
    assert batch_points(32, (1, 2, 4, 8, 16), 4) == (16, 8)
    assert batch_points(32, (1, 2, 4, 8, 16), 8) == (16, 8)
    assert batch_points(8, (1, 2, 4), 2) == (4, 2)
    assert batch_points(8, (1, 2, 4), 1) == (4, 2)
    assert batch_points(4, (1, 2), 2) is None  # one microbatch size below the batch
    assert batch_points(32, None, 2) is None  # m fixed: profiled at the microbatch


def test_the_microbatches_measured_beside_the_two_points() -> None:
    # candidates of at least 2 x ranks microbatches, other than the two points, at most
    # four, nearest the larger point
    assert scaled_batch_points(32, (1, 2, 4, 8, 16), 2, (16, 4)) == (8,)
    assert scaled_batch_points(16, (1, 2, 4, 8), 2, (8, 4)) == ()
    assert scaled_batch_points(256, (1, 2, 4, 8, 16, 32, 64, 128), 4, (128, 8)) == (16, 32, 64)
    assert scaled_batch_points(96, (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48), 2, (48, 4)) \
        == (6, 8, 12, 16)
    assert scaled_batch_points(32, None, 2, (16, 4)) == ()


def test_profile_model_measures_the_other_pipeline_microbatches_segment_by_segment(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    _quiet(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                            for _ in range(4)])
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    kw = {"devices": ["cpu", "cpu"], "loss_fn": nn.functional.mse_loss, "example_target": y,
          "split_cost": False}
    prof = profile_model(model, (x,), cache=True, **kw)
    assert prof.costs.low_batch_size == 2  # points m = 16 and 4; m = 8 measured as well
    (scale,) = prof.costs.batch_scales
    assert scale.batch_size == 4 and len(scale.fwd) == len(scale.positions) + 1
    # measured ratios: positive and finite (their size depends on the machine's load; the
    # scaling itself is checked on fixed times below)
    assert all(f > 0 and math.isfinite(f) for f in (*scale.fwd, *scale.bwd))
    again = profile_model(model, (x,), cache=True, **kw)
    assert "scaled_batch_times" in again.from_cache
    assert again.costs.batch_scales == prof.costs.batch_scales
    assert all(p.grad is None for p in model.parameters())


def _quiet(monkeypatch, session_busy: str | None = None) -> None:  # type: ignore[no-untyped-def]
    """The machine taken as quiet for the profile cache (whatever its load now), and for
    the numbers the session caches on a profile as ``session_busy`` says."""
    import autopart.profiler.cache as cache_mod
    import autopart.profiler.profile_state as session_mod

    monkeypatch.setattr(cache_mod, "machine_busy", lambda: None)
    monkeypatch.setattr(session_mod, "machine_busy", lambda: session_busy)


@pytest.mark.parametrize("busy", [None, "load average 9.0 on 2 CPUs"])
def test_timings_taken_on_a_busy_machine_are_not_cached(tmp_path, monkeypatch,
                                                        busy: str | None) -> None:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    _quiet(monkeypatch, session_busy=busy)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                            for _ in range(2)])
    x = torch.randn(16, 16)
    kw = {"devices": ["cpu", "cpu"], "loss_fn": nn.functional.mse_loss, "example_target": x,
          "split_cost": False, "cache": True}
    if busy:
        with pytest.warns(RuntimeWarning, match="used but not cached"):
            profile_model(model, (x,), **kw)
    else:
        profile_model(model, (x,), **kw)
    cached = [json.loads(f.read_text()) for f in tmp_path.glob("profile-*.json")]
    measures = [k for d in cached for k in d.get("measures", {})]
    # the profiles are cached either way; the larger batch point's segment times only
    # when they were timed on a quiet machine
    assert cached
    assert any(k.startswith("segment0_fwd_us@") for k in measures) == (busy is None)


def test_profile_model_reads_node_times_off_two_microbatches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 4))
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    prof = profile_model(model, (x,), devices=["cpu", "cpu"], loss_fn=nn.functional.mse_loss,
                         example_target=y, cache=False, split_cost=False)
    assert prof.costs.low_batch_size == 2  # 16 rows, at most 8 microbatches of 2
    assert len(prof.costs.low_times) == len(prof.costs.nodes)
    assert "batch_points_s" in prof.timings_s
    single = profile_model(model, (x,), devices=["cpu", "cpu"], cache=False, split_cost=False,
                           low_batch=False)
    assert single.costs.low_batch_size == 0 and "batch_points_s" not in single.timings_s
    fixed = profile_model(model, (x,), devices=["cpu", "cpu"], cache=False, split_cost=False,
                          num_microbatches=4)
    assert fixed.costs.low_batch_size == 0
    assert all(p.grad is None for p in model.parameters())


def _deep(depth: int = 6) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU()]
    return nn.Sequential(*layers).train(), torch.randn(8, 16)


def test_segment_times_run_every_segment_and_leave_the_model_as_it_was() -> None:
    model, x = _deep()
    captured = capture(model, (x,))
    flat = captured.flatten_inputs((x,), {})
    costs = profile_graph(captured, flat)
    # two cut candidates a third and two thirds down the graph: fixed by the graph, not by
    # the measured times (segment_cuts on them gave one cut under load, two times one
    # candidate; test_segment_cuts_split_the_profiled_time_evenly checks that choice)
    positions = [q for q in find_candidates(costs, 3).positions if 0 < q < len(costs.nodes)]
    cuts = (positions[len(positions) // 3], positions[2 * len(positions) // 3])
    assert cuts[0] < cuts[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    times = segment_times(captured, flat, "cpu", cuts, budget_s=0.05)
    assert len(times) == 3
    # every segment has a linear layer: a forward and a backward each
    assert all(f > 0 and b > 0 for f, b in times)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():  # running statistics included
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_segment_cuts_split_the_profiled_time_evenly() -> None:
    model, x = _deep(8)
    captured = capture(model, (x,))
    costs = profile_graph(captured, captured.flatten_inputs((x,), {}))
    positions = find_candidates(costs, 3).positions
    prefix = [0.0]
    for nd in costs.nodes:
        prefix.append(prefix[-1] + nd.fwd_us + nd.bwd_us)
    cuts = segment_cuts(costs, positions, 4)
    assert 1 <= len(cuts) <= 3 and list(cuts) == sorted(set(cuts))
    # the candidates nearest 1/4, 2/4 and 3/4 of the time
    assert set(cuts) == {min(positions, key=lambda q: abs(prefix[q] - k * prefix[-1] / 4))
                         for k in (1, 2, 3)}
    assert segment_cuts(costs, positions, 1) == ()
    assert segment_cuts(costs, (), 4) == ()


def test_segment_calibration_scales_each_segment_to_its_own_times() -> None:
    model, x = _deep(4)
    captured = capture(model, (x,))
    costs = profile_graph(captured, captured.flatten_inputs((x,), {}))
    n = len(costs.nodes)
    cuts = (n // 2,)
    scaled = calibrate_to_segments(costs, cuts, [(100.0, 300.0), (50.0, 70.0)])
    first, second = scaled.nodes[:n // 2], scaled.nodes[n // 2:]
    assert sum(nd.fwd_us for nd in first) == pytest.approx(100.0)
    assert sum(nd.bwd_us for nd in first) == pytest.approx(300.0)
    assert sum(nd.fwd_us for nd in second) == pytest.approx(50.0)
    assert sum(nd.bwd_us for nd in second) == pytest.approx(70.0)
    big = max(range(n // 2), key=lambda i: costs.nodes[i].fwd_us)  # shares kept in a segment
    assert scaled.nodes[big].fwd_us / 100.0 == pytest.approx(
        costs.nodes[big].fwd_us / sum(nd.fwd_us for nd in costs.nodes[:n // 2]))
    assert [nd.saved_bytes for nd in scaled.nodes] == [nd.saved_bytes for nd in costs.nodes]
    with pytest.raises(ValueError, match="1 segment times for 2 segments"):
        calibrate_to_segments(costs, cuts, [(1.0, 1.0)])


def _with_host(costs, f: float, i: float, w: float):  # type: ignore[no-untyped-def]
    return dataclasses.replace(costs, nodes=tuple(
        dataclasses.replace(nd, host_fwd_us=f * (k + 1), host_bwd_input_us=i * (k + 1),
                            host_bwd_weight_us=w * (k + 1)) for k, nd in enumerate(costs.nodes)))


def test_segment_calibration_scales_host_issue_times_to_the_segments_issue() -> None:
    model, x = _deep(4)
    captured = capture(model, (x,))
    flat = captured.flatten_inputs((x,), {})
    costs = _with_host(profile_graph(captured, flat), 10.0, 6.0, 4.0)
    n = len(costs.nodes)
    cuts = (n // 2,)
    times = [(100.0, 300.0), (50.0, 70.0)]
    scaled = calibrate_to_segments(costs, cuts, times, [(40.0, 90.0), (20.0, 0.0)])
    first, second = scaled.nodes[:n // 2], scaled.nodes[n // 2:]
    assert sum(nd.host_fwd_us for nd in first) == pytest.approx(40.0)
    assert sum(nd.host_bwd_input_us + nd.host_bwd_weight_us for nd in first) == pytest.approx(90.0)
    assert sum(nd.host_fwd_us for nd in second) == pytest.approx(20.0)
    # a zero target (nothing measured) leaves that side as the profile had it
    assert [nd.host_bwd_input_us for nd in second] == [nd.host_bwd_input_us
                                                       for nd in costs.nodes[n // 2:]]
    # I and W keep their shares; device times are the same as without host times
    assert first[1].host_bwd_input_us / first[1].host_bwd_weight_us == pytest.approx(6.0 / 4.0)
    assert [nd.fwd_us for nd in scaled.nodes] == [
        nd.fwd_us for nd in calibrate_to_segments(costs, cuts, times).nodes]
    # without host times on the nodes, segment host times change nothing
    plain = profile_graph(captured, flat)
    assert not calibrate_to_segments(plain, cuts, times, [(1.0, 1.0)] * 2).has_host_times
    with pytest.raises(ValueError, match="1 segment host times for 2 segments"):
        calibrate_to_segments(costs, cuts, times, [(1.0, 1.0)])


def test_segment_times_give_no_host_times_on_the_cpu() -> None:
    model, x = _deep(2)
    captured = capture(model, (x,))
    flat = captured.flatten_inputs((x,), {})
    host: list[tuple[float, float]] = []
    times = segment_times(captured, flat, "cpu", (), min_repeats=1, budget_s=0.0, host=host)
    assert len(times) == 1 and host == []


def test_the_two_batch_line_takes_the_smallest_microbatchs_host_times() -> None:
    model, x = _deep(2)
    captured = capture(model, (x,))
    costs = profile_graph(captured, captured.flatten_inputs((x,), {}))
    full, low = _with_host(costs, 50.0, 30.0, 20.0), _with_host(costs, 5.0, 3.0, 2.0)
    line = with_host_times_of(full, low)
    assert [nd.host_times for nd in line.nodes] == [nd.host_times for nd in low.nodes]
    assert [nd.fwd_us for nd in line.nodes] == [nd.fwd_us for nd in full.nodes]
    assert with_host_times_of(costs, low) is costs  # no host times there: as it was
