"""Tests of the host link measurement: the fit, two real gloo processes, the cache, planning."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autopart.profiler.links as links
from autopart.core.errors import ProfileError
from autopart.devices import cluster_for_devices
from autopart.planning import profile_model
from autopart.profiler.links import LinkFigures, fit_link, measure_host_link

SIZES = (1 << 10, 1 << 20, 8 << 20)


def test_fit_recovers_latency_and_bandwidth() -> None:
    # 50 µs + 2 GB/s, worked out by hand: 1 KiB -> 50.512 µs, 1 MiB -> 574.288, 8 MiB -> 4244.304
    times = tuple(50.0 + n / 2e9 * 1e6 for n in SIZES)
    fit = fit_link(SIZES, times)
    assert fit.latency_us == pytest.approx(50.0, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert fit.transfer_us(1 << 20) == pytest.approx(574.288, abs=1e-3)


def test_a_negative_intercept_is_clamped_to_zero() -> None:
    fit = fit_link((1000, 2000), (1.0, 2.5))  # the line through both crosses below 0
    assert fit.latency_us == 0.0 and fit.bandwidth_bytes_per_s > 0


@pytest.mark.parametrize(("sizes", "times", "match"), [
    ((1000,), (1.0,), "two distinct sizes"),
    ((1000, 2000), (1.0,), "one time per size"),
    ((1000, 2000000), (50.0, 10.0), "do not grow with their size"),
])
def test_fit_rejects_what_it_cannot_fit(sizes: tuple[int, ...], times: tuple[float, ...],
                                        match: str) -> None:
    with pytest.raises(ProfileError, match=match):
        fit_link(sizes, times)


def test_two_gloo_processes_are_timed() -> None:
    # Two real interpreters exchange messages; the verdict never depends on the machine's
    # load: only that each size got a positive time (the fit is tested on fixed times above,
    # and a busy machine's times are a ProfileError there, not a wrong figure).
    sizes = (4096, 4 << 20)
    times = links.run_rank_pair(
        "autopart.profiler.links", [",".join(map(str, sizes)), "3"], what="timing",
        timeout_s=120.0, fix="")
    assert len(times) == len(sizes) and all(t > 0 for t in times)
    try:
        fit = measure_host_link(sizes=sizes, repeats=3)
    except ProfileError as err:  # a busy machine's times do not grow with size
        assert "measure again when it is quiet" in str(err) or "took over" in str(err), err
    else:
        assert fit.sizes == sizes and fit.backend == "gloo"
        assert fit.latency_us >= 0 and fit.bandwidth_bytes_per_s > 0


def test_a_measurement_that_does_not_finish_is_a_profile_error() -> None:
    with pytest.raises(ProfileError, match="took over 0.01 s"):
        measure_host_link(timeout_s=0.01)


def test_a_link_that_cannot_be_timed_falls_back_to_the_preset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> LinkFigures:
        raise ProfileError("timing the link between two gloo processes failed: refused")

    monkeypatch.setattr(links, "measure_host_link", fail)
    links.host_link.cache_clear()
    with pytest.warns(RuntimeWarning, match="refused; planning with the cpu preset"):
        assert links.host_link() is None
    links.host_link.cache_clear()


def test_host_link_is_cached_per_machine_unless_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fake = LinkFigures(80.0, 2.5e9, SIZES, (80.4, 500.0, 3435.0))

    def measure() -> LinkFigures:
        calls.append(1)
        return fake

    monkeypatch.setattr(links, "measure_host_link", measure)
    monkeypatch.setattr(links._cache, "machine_busy", lambda: "load average 9.0 on 2 CPUs")
    links.host_link.cache_clear()
    assert links.host_link() == fake
    links.host_link.cache_clear()
    assert links.host_link() == fake and len(calls) == 2  # busy: measured, not stored
    monkeypatch.setattr(links._cache, "machine_busy", lambda: None)
    links.host_link.cache_clear()
    links.host_link()
    (path,) = (links._cache.cache_dir() / "links").glob("*.json")
    assert json.loads(path.read_text())["latency_us"] == 80.0
    links.host_link.cache_clear()
    assert links.host_link() == fake and len(calls) == 3  # read back from the file
    path.write_text("{not json")
    links.host_link.cache_clear()
    assert links.host_link() == fake and len(calls) == 4  # a damaged file is measured again
    links.host_link.cache_clear()


def test_cpu_ranks_plan_with_the_measured_link(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = LinkFigures(123.0, 1.5e9, SIZES, (123.7, 822.0, 5715.0))
    monkeypatch.setattr(links, "host_link", lambda use_cache=True: fake)
    monkeypatch.setattr("autopart.planning.host_link", lambda use_cache=True: fake)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    profile = profile_model(net, (torch.randn(4, 8),), devices=["cpu", "cpu"])
    assert profile.host_link == fake
    spec = profile.cluster().devices[0]
    assert (spec.link_latency_us, spec.link_bandwidth_bytes_per_s) == (123.0, 1.5e9)
    assert "measured" in spec.source
    assert profile.cluster().transfer_us(1_500_000, 0, 1) == pytest.approx(123.0 + 1000.0)
    one = profile_model(net, (torch.randn(4, 8),), devices=["cpu"])
    assert one.host_link is None  # one rank sends nothing
    nominal = cluster_for_devices(["cpu", "cpu"]).devices[0]
    assert nominal.link_latency_us == 2.0  # the preset, when nothing was measured
