"""Segment calibration's clock on the CPU with a fake CUDA device: a part's device time is
its kernels alone once its issue time is known (queued behind a device wait), its wall time
on the CPU. Fake host clock and events: no verdict depends on the machine."""

from __future__ import annotations

import types

import pytest
import torch

import autopart.profiler.calibrate as calibrate
import autopart.profiler.timer as timer
from tests.profiler.test_host_timer import _Fake


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _Fake:
    f = _Fake()
    clock = types.SimpleNamespace(perf_counter=lambda: f.host_s)
    monkeypatch.setattr(calibrate, "time", clock)
    monkeypatch.setattr(timer, "time", clock)
    monkeypatch.setattr(torch.cuda, "Event", f.event)
    monkeypatch.setattr(torch.cuda, "synchronize", f.synchronize)
    monkeypatch.setattr(torch.cuda, "_sleep", f.sleep)
    monkeypatch.setattr(timer, "_CYCLES_PER_US", {0: 1_000.0})
    return f


def _part(f: _Fake, issue_s: float, run_ms: float):
    def fn() -> str:
        f.host_s += issue_s  # the host issues the part's ops ...
        f.device_ms = max(f.device_ms, f.host_s * 1e3) + run_ms  # ... the device runs them
        return "out"
    return fn


def test_a_known_issue_time_leaves_the_launch_gap_out(fake: _Fake) -> None:
    clock = calibrate._SegmentClock(torch.device("cuda:0"))
    # the warm-up: no issue time known, the least wait (200 µs) cannot cover 5 ms of issue,
    # so the events span the wait for the launch too
    us, out = clock.time(("F", 0), _part(fake, 5e-3, 2.0))
    assert out == "out" and us == pytest.approx(5_000.0 + 2_000.0 - 200.0)
    assert clock.issued_us[("F", 0)] == pytest.approx(5_000.0)
    # next: a 15 ms wait queued first, so the device starts the part's kernels only after
    # they were all issued: the events span the 2 ms of kernels alone
    us, _ = clock.time(("F", 0), _part(fake, 5e-3, 2.0))
    assert us == pytest.approx(2_000.0)
    assert fake.sleeps[-1] == 15_000 * 1_000


def test_long_issues_are_capped_and_the_cpu_takes_wall_time(fake: _Fake) -> None:
    clock = calibrate._SegmentClock(torch.device("cuda:0"))
    clock.issued_us[("B", 3)] = 1e6  # a second of issue: the wait is capped at 200 ms
    clock.time(("B", 3), _part(fake, 1e-3, 1.0))
    assert fake.sleeps[-1] == 200_000 * 1_000
    cpu = calibrate._SegmentClock(torch.device("cpu"))
    us, _ = cpu.time(("F", 0), _part(fake, 3e-3, 0.0))
    assert us == pytest.approx(3_000.0) and cpu.issued_us == {}


def test_the_clock_keeps_the_last_parts_issue_time(fake: _Fake) -> None:
    clock = calibrate._SegmentClock(torch.device("cuda:0"))
    clock.time(("F", 0), _part(fake, 4e-3, 1.0))
    assert clock.last_issue_us == pytest.approx(4_000.0)
    clock.time(("B", 0), _part(fake, 9e-3, 1.0))
    assert clock.last_issue_us == pytest.approx(9_000.0)
    assert clock.issued_us[("F", 0)] == pytest.approx(4_000.0)
