"""The fixed cost per collective among CPU ranks: measured in real gloo processes, and carried
into a profile's runtime (no bound on the figures: they follow the machine's load)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autopart import layout_planning, planning
from autopart.core.errors import ProfileError
from autopart.options import CompileOptions
from autopart.planning import profile_model
from autopart.profiler import collective_probe
from autopart.profiler.collective_probe import UNITS, ProbeFigures, measure_collective_overhead


def test_two_gloo_processes_give_a_point_per_work_size() -> None:
    got = measure_collective_overhead(2, ranks_per_core=1.0)
    for points in (got.collective_points, got.transfer_points):
        assert len(points) == len(UNITS)
        works = [w for w, _ in points]
        assert all(w > 0 for w in works) and all(us >= 0 for _, us in points)
        assert works[-1] > works[0]  # 200 units of work take longer than one
    assert got.bandwidth_bytes_per_s > 0 and got.copy_bytes_per_s > 0


def test_the_probes_ring_steps_are_taken_off_never_below_zero(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def processes(module: str, args: list[str], **kw: object) -> dict[str, object]:
        calls.append((module, args, kw["ranks"]))
        return {"points": [[100.0, 500.0], [900.0, 40.0]],
                "transfer_points": [[100.0, 300.0], [900.0, 20.0]],
                "bandwidth_bytes_per_s": 2.5e9, "copy_bytes_per_s": 3e9}

    monkeypatch.setattr(collective_probe, "run_rank_pair", processes)
    got = measure_collective_overhead(4, ranks_per_core=2.0, ring_us=60.0, link_us=30.0)
    assert got.collective_points == ((100.0, 440.0), (900.0, 0.0))
    assert got.transfer_points == ((100.0, 270.0), (900.0, 0.0))
    assert (got.bandwidth_bytes_per_s, got.copy_bytes_per_s) == (2.5e9, 3e9)
    assert calls == [("autopart.profiler.collective_probe", ["4", "2", "2.0"], 4)]


@pytest.mark.parametrize("world, group", [(1, 2), (3, 2), (4, 1)])
def test_a_bad_world_or_group_is_refused(world: int, group: int) -> None:
    with pytest.raises(ProfileError, match="collective probe"):
        measure_collective_overhead(world, group_size=group)


def _cpu_profile(ranks: int) -> layout_planning.Profile:
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return profile_model(net, (torch.randn(4, 8),), devices=["cpu"] * ranks)


def test_a_profile_gets_the_points_and_a_failed_probe_warns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    profile = _cpu_profile(2)
    seen: list[tuple[int, float, float]] = []

    def fake(world: int, *, ranks_per_core: float, ring_us: float,
             link_us: float) -> ProbeFigures:
        seen.append((world, ranks_per_core, ring_us, link_us))
        return ProbeFigures(((100.0, 900.0), (4000.0, 1200.0)), ((100.0, 700.0),), 1.5e9,
                            4e9)

    monkeypatch.setattr(planning, "measure_collective_overhead", fake)
    monkeypatch.setattr(planning, "cpu_ranks_per_core", lambda world: world / 2)
    got = planning.with_collective_overhead(profile, 4)
    assert got.runtime.collective_overhead_points == ((100.0, 900.0), (4000.0, 1200.0))
    assert got.runtime.collective_overhead_at(2050.0) == pytest.approx(1050.0)
    assert got.runtime.transfer_wait_points == ((100.0, 700.0),)
    assert got.runtime.transfer_cost_at(5.0) == max(700.0, profile.runtime.transfer_overhead_us)
    assert got.runtime.collective_bandwidth_bytes_per_s == 1.5e9
    assert got.runtime.copy_bytes_per_s == 4e9
    # the layout search's tp and dp collectives run at it, the pipeline's sends at the link;
    # never faster than the link (this machine's, measured: the figures are taken from it so
    # that the verdict does not follow how fast the link measured today)
    spec = got.cluster().devices[0]
    link = spec.link_bandwidth_bytes_per_s
    topo = layout_planning.layout_request(CompileOptions(tp=2), 4, spec, None,
                                          link / 3).topology
    assert topo.link(2)[0] == pytest.approx(link / 3)
    assert topo.intra_host_bandwidth_bytes_per_s == link
    capped = layout_planning.layout_request(CompileOptions(tp=2), 4, spec, None,
                                            3 * link).topology
    assert capped.link(2)[0] == pytest.approx(link)
    unmeasured = layout_planning.layout_request(CompileOptions(tp=2), 4, spec).topology
    assert unmeasured.link(2)[0] == spec.link_bandwidth_bytes_per_s
    (world, per_core, ring, link), = seen
    assert (world, per_core) == (4, 2.0) and ring > link > 0  # the 16 KiB message
    seen.clear()
    # one rank, an odd world and GPU ranks are left alone, without a probe
    assert planning.with_collective_overhead(profile, 1) is profile
    assert planning.with_collective_overhead(profile, 3) is profile
    gpu = dataclasses.replace(profile, devices=("cuda:0", "cuda:1"))
    assert planning.with_collective_overhead(gpu, 2) is gpu
    assert seen == []

    def broken(world: int, **_: float) -> tuple[tuple[float, float], ...]:
        raise ProfileError("timing gloo collectives in 2 processes failed: boom")

    monkeypatch.setattr(planning, "measure_collective_overhead", broken)
    with pytest.warns(RuntimeWarning, match="no fixed cost per collective"):
        assert planning.with_collective_overhead(profile, 2) is profile

