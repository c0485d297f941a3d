"""The profiler's per-call timer: warm-up, repeats and the long-call rule."""

from __future__ import annotations

import types

import pytest
import torch

import autopart.profiler.timer as timer
from autopart.profiler.timer import time_calls, time_samples

CPU = torch.device("cpu")


_NOW = [0.0]  # the fake clock's time, s


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timer reads a clock that only the thunks advance: each "sleeps" exactly its
    duration, so the verdicts never depend on how busy the machine is."""
    monkeypatch.setattr(timer, "time", types.SimpleNamespace(perf_counter=lambda: _NOW[0]))


def _sleeper(durations_s: list[float], calls: list[int]):
    """A factory whose n-th thunk takes ``durations_s[n]`` on the fake clock and returns n."""
    def factory():
        n = len(calls)
        calls.append(n)

        def thunk() -> int:
            _NOW[0] += durations_s[n]
            return n
        return thunk
    return factory


def test_short_calls_take_warmup_then_repeats():
    calls: list[int] = []
    samples, last = time_samples(CPU, _sleeper([0.0] * 5, calls), warmup=1, repeats=3,
                                 long_us=1e6)
    assert len(calls) == 4 and len(samples) == 3 and last == 3


def test_a_long_first_call_is_warmup_and_the_faster_of_two_more_is_the_sample():
    calls: list[int] = []
    # first call long (a cold call), then a stalled call and a normal one
    samples, last = time_samples(CPU, _sleeper([0.08, 0.06, 0.02], calls), warmup=1,
                                 repeats=5, long_us=50_000)
    assert len(calls) == 3, "a long first call stops after two more calls"
    assert last == 2
    assert len(samples) == 1
    assert samples[0] == pytest.approx(20_000), "the stalled 60 ms call and the first are not it"


def test_time_calls_is_the_median_of_the_samples():
    us, _ = time_calls(CPU, _sleeper([0.0, 0.01, 0.03, 0.02], []), warmup=1, repeats=3)
    assert us == pytest.approx(20_000)  # the median of 10, 30 and 20 ms
