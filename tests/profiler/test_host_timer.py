"""The CUDA timer's two figures, on the CPU: a fake host clock and fake CUDA events.

The host clock advances only while a thunk issues its work or a factory sets one up; the
fake device runs each call's kernels once they are issued (at the end of the issue) and the
queue before them is done, for a scripted time; a spin kernel (``torch.cuda._sleep``) holds
it for its cycles at 1,000 cycles per µs; events read that timeline. The verdicts never
depend on the machine's speed or load.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

import autopart.profiler.timer as timer
from autopart.profiler.timer import time_calls, time_samples

CUDA = torch.device("cuda:0")  # a device object only: nothing runs on a GPU


class _Fake:
    """Host clock (s) and a device timeline (ms) that the fake events read."""

    def __init__(self) -> None:
        self.host_s = 0.0
        self.device_ms = 0.0  # when the device's queue is done
        self.syncs = 0
        self.sleeps: list[int] = []

    def event(self, enable_timing: bool = False) -> Any:
        fake = self

        class _Event:
            def record(self) -> None:
                # an event completes once everything issued before it has run
                self.at_ms = max(fake.device_ms, fake.host_s * 1e3)

            def synchronize(self) -> None:
                fake.syncs += 1

            def elapsed_time(self, end: Any) -> float:
                return end.at_ms - self.at_ms
        return _Event()

    def synchronize(self, device: Any = None) -> None:
        self.syncs += 1

    def sleep(self, cycles: int) -> None:
        self.sleeps.append(cycles)
        self.device_ms = max(self.device_ms, self.host_s * 1e3) + cycles / 1e6

    def calls(self, issue_s: list[float], run_ms: list[float], setup_s: float = 1e-4):
        """A factory whose n-th thunk issues for ``issue_s[n]`` host seconds, then its
        kernels run ``run_ms[n]`` on the device; each set-up costs ``setup_s``."""
        made: list[int] = []

        def factory():
            n = len(made)
            made.append(n)
            self.host_s += setup_s  # untimed set-up

            def thunk() -> int:
                self.host_s += issue_s[n]
                # the device starts the kernels once they are issued and the queue is free
                self.device_ms = max(self.device_ms, self.host_s * 1e3) + run_ms[n]
                return n
            return thunk
        return factory, made


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _Fake:
    f = _Fake()
    monkeypatch.setattr(timer, "time", types.SimpleNamespace(perf_counter=lambda: f.host_s))
    monkeypatch.setattr(torch.cuda, "Event", f.event)
    monkeypatch.setattr(torch.cuda, "synchronize", f.synchronize)
    monkeypatch.setattr(torch.cuda, "_sleep", f.sleep)
    monkeypatch.setattr(timer, "_CYCLES_PER_US", {})
    return f


def test_host_time_is_the_issue_alone_and_device_time_comes_from_the_events(fake: _Fake) -> None:
    factory, made = fake.calls(issue_s=[0.9, 0.001, 0.002, 0.003], run_ms=[5.0, 7.0, 8.0, 9.0])
    host: list[float] = []
    samples, last = time_samples(CUDA, factory, warmup=1, repeats=3, host=host)
    assert len(made) == 4 and last == 3
    # host: the thunks' own issue times, µs; not the warm-up, not the 0.1 ms set-ups
    assert host == pytest.approx([1_000.0, 2_000.0, 3_000.0])
    # device: each event pair spans its call's kernels (they start when issued)
    assert samples == pytest.approx([7_000.0, 8_000.0, 9_000.0])
    # a calibration (1e6 cycles: 1 ms, 1 sync), then the timed calls queued behind a wait of
    # 3 x 3 x the warm-up's 900 ms issue, capped at 20 ms
    assert fake.sleeps[-1] == 20_000 * 1_000
    assert fake.syncs == 2, "one synchronize after the last call, none per call"


def test_the_device_time_leaves_out_the_wait_for_the_launch(fake: _Fake) -> None:
    # a small op: 20 µs to issue, 5 µs on the device
    factory, _ = fake.calls(issue_s=[20e-6] * 4, run_ms=[0.005] * 4, setup_s=1e-6)
    host: list[float] = []
    samples, _ = time_samples(CUDA, factory, warmup=1, repeats=3, host=host)
    assert samples == pytest.approx([5.0] * 3), "the kernels alone, queued behind the wait"
    assert host == pytest.approx([20.0] * 3)
    assert fake.sleeps[-1] == 200 * 1_000, "at least 200 µs (3 x 3 x 20 = 180)"
    # the same calls on an idle device, a pair of events each (no host list: as before):
    # each pair also spans the 20 µs the device waited for the launch
    factory, _ = fake.calls(issue_s=[20e-6] * 4, run_ms=[0.005] * 4, setup_s=1e-3)
    samples, _ = time_samples(CUDA, factory, warmup=1, repeats=3)
    assert samples == pytest.approx([25.0] * 3)


def test_host_times_are_appended_only_on_cuda_and_only_when_asked(fake: _Fake) -> None:
    factory, _ = fake.calls(issue_s=[0.001] * 4, run_ms=[1.0] * 4)
    samples, _ = time_samples(CUDA, factory, warmup=1, repeats=3)  # no host list: as before
    assert len(samples) == 3
    host: list[float] = []
    factory, _ = fake.calls(issue_s=[0.001] * 4, run_ms=[1.0] * 4)
    time_samples(torch.device("cpu"), factory, warmup=1, repeats=3, host=host)
    assert host == [], "on the CPU the host runs the op: no separate host time"


def test_a_long_first_call_keeps_the_smaller_host_time(fake: _Fake) -> None:
    factory, made = fake.calls(issue_s=[0.0001, 0.004, 0.002], run_ms=[80.0, 30.0, 20.0])
    host: list[float] = []
    samples, _ = time_samples(CUDA, factory, warmup=1, repeats=5, long_us=50_000, host=host)
    assert len(made) == 3
    assert samples == pytest.approx([20_000.0])
    assert host == pytest.approx([2_000.0])
    assert fake.sleeps[-1] == 600 * 1_000, "after the long first call: 3 x 2 calls x 100 µs"


def test_time_calls_passes_the_host_list_through(fake: _Fake) -> None:
    factory, _ = fake.calls(issue_s=[0.0, 0.003, 0.001, 0.002], run_ms=[1.0] * 4)
    host: list[float] = []
    time_calls(CUDA, factory, 1, 3, host=host)
    assert host == pytest.approx([3_000.0, 1_000.0, 2_000.0])


def test_a_cpu_profile_has_no_host_times() -> None:
    from autopart.core.capture import capture
    from autopart.profiler.measure import profile_graph

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    cap = capture(model, (x,))
    costs = profile_graph(cap, cap.flatten_inputs((x,), {}), repeats=1)
    assert not costs.has_host_times
    assert all(n.host_times is None for n in costs.nodes)
