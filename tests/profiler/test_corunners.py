"""Co-runners: forked copies of the process that load the host while a rank's work is timed."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch

from autopart.core.capture import capture
from autopart.profiler import corunners
from autopart.profiler.corunners import available, co_runners, model_step

pytestmark = pytest.mark.skipif(not available(), reason="co-runners need os.fork on Linux")


def test_copies_run_the_work_while_the_block_runs_and_are_gone_after(tmp_path: Path) -> None:
    marks = tmp_path / "marks"

    def work() -> None:
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.01)

    with co_runners(work, 2) as running:
        assert running == 2
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                not marks.exists() or len(set(marks.read_text().split())) < 2):
            time.sleep(0.05)
        pids = {int(p) for p in marks.read_text().split()}
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:  # killed and reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    count = len(marks.read_text().split())
    time.sleep(0.1)
    assert len(marks.read_text().split()) == count  # nothing runs after the block
    with co_runners(work, 0) as running:
        assert running == 0


def test_a_copy_that_fails_ends_quietly_and_the_block_still_runs() -> None:
    def work() -> None:
        raise RuntimeError("a copy's failure never reaches the caller")

    with co_runners(work, 1) as running:
        assert running == 1
        time.sleep(0.05)


def test_model_step_runs_a_forward_and_backward_of_the_captured_graph() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    captured = capture(model, (x,))
    step = model_step(captured, captured.flatten_inputs((x,), {}))
    step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale


def test_model_step_runs_a_graph_captured_with_keyword_inputs() -> None:
    # a capture with keyword inputs (context parallelism adds position_ids) is run from its
    # flat leaves: the exported module's input-spec hook would want the keywords
    torch.manual_seed(0)
    model = _Scaled()
    x, scale = torch.randn(4, 8), torch.full((4, 1), 2.0)
    captured = capture(model, (x,), {"scale": scale})
    model_step(captured, captured.flatten_inputs((x,), {"scale": scale}))()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_time_sharing_factor_is_cpu_time_beside_the_world_over_a_core_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # each call of the work "takes" the CPU time the patched clock hands out: 10 ms beside
    # cores - 1 = 1 copy, 12 ms beside world - 1 = 3 copies -> 1.2
    running: list[int] = []

    @contextlib.contextmanager
    def fake_co_runners(work, count):  # type: ignore[no-untyped-def]
        running.append(count)
        yield count

    ticks = iter(range(10_000))

    def clock() -> float:  # successive calls: start, end, start, end, ...
        i = next(ticks)
        per_call = 0.012 if running[-1] == 3 else 0.010
        return (i // 2) * 1.0 + (i % 2) * per_call

    monkeypatch.setattr(corunners, "co_runners", fake_co_runners)
    monkeypatch.setattr(corunners, "available", lambda: True)
    monkeypatch.setattr(corunners.time, "thread_time", clock)
    got = corunners.time_sharing_factor(lambda: None, world=4, cores=2, calls=5, rounds=2)
    assert got == pytest.approx(1.2)
    assert running == [1, 3, 1, 3]  # alternated, a core each first


def test_time_sharing_factor_is_one_with_a_core_each_and_never_below_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert corunners.time_sharing_factor(lambda: None, world=2, cores=2) == 1.0
    with pytest.raises(ValueError, match="cores=0"):
        corunners.time_sharing_factor(lambda: None, world=2, cores=0)

    @contextlib.contextmanager
    def none(work, count):  # type: ignore[no-untyped-def]
        yield count

    monkeypatch.setattr(corunners, "co_runners", none)
    monkeypatch.setattr(corunners, "available", lambda: True)
    # a faster call beside more copies (noise) is not a speed-up: clipped to 1.0
    ticks = iter(range(10_000))
    monkeypatch.setattr(corunners.time, "thread_time", lambda: float(next(ticks)))
    assert corunners.time_sharing_factor(lambda: None, world=3, cores=2, calls=3) == 1.0


def test_measuring_the_time_sharing_factor_leaves_the_models_gradients_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the measurement runs the model's forward and backward in this process; under torchrun
    # the profiling rank then builds its stages from the same parameters, whose gradients a
    # step must start from (a pp 2 x dp 2 test's tied embedding came out wrong without this)
    from autopart.profiler import session as session_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    captured = capture(model, (x,))
    model[0].weight.grad = torch.ones(8, 8)  # a gradient the caller holds stays as it was
    stats = model[1].running_mean.clone()
    rng = torch.random.get_rng_state()

    def run_once(work, world, cores):  # type: ignore[no-untyped-def]
        work()
        return 1.25

    class Store:
        hits: set[str] = set()
        stored: dict[str, float] = {}

        def load(self, name: str) -> float | None:
            return None

        def store(self, name: str, value: float, *, busy: object = True) -> None:
            self.stored[name] = value

    monkeypatch.setattr(session_module, "time_sharing_factor", run_once)
    store = Store()
    got = session_module._time_sharing_cached(
        store, captured, captured.flatten_inputs((x,), {}), 4, 2)  # type: ignore[arg-type]
    assert got == 1.25 and list(store.stored.values()) == [1.25]
    assert torch.equal(model[0].weight.grad, torch.ones(8, 8))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "0.weight")
    assert torch.equal(model[1].running_mean, stats)
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_the_time_sharing_factor_is_cached_by_the_load_before_its_co_runners_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the co-runners alone lift the load average above the cores (3.5 on 2 CPUs here): judged
    # after the measurement, the factor was never cached and every profile for more ranks
    # than cores measured it again
    from autopart.profiler import profile_state
    from autopart.profiler import session as session_module

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    captured = capture(model, (x,))
    load = {"now": None}
    monkeypatch.setattr(profile_state, "machine_busy", lambda: load["now"])

    def measure(work, world, cores):  # type: ignore[no-untyped-def]
        load["now"] = "load average 3.5 on 2 CPUs"  # what the co-runners leave behind
        return 1.1

    class Store:
        hits: set[str] = set()

        def __init__(self) -> None:
            self.stored: list[tuple[str, float, object]] = []

        def load(self, name: str) -> float | None:
            return None

        def store(self, name: str, value: float, *, busy: object = True) -> None:
            self.stored.append((name, value, busy))

    monkeypatch.setattr(session_module, "time_sharing_factor", measure)
    quiet, loaded = Store(), Store()
    session_module._time_sharing_cached(quiet, captured, captured.flatten_inputs((x,), {}), 4,
                                        2)  # type: ignore[arg-type]
    assert [s[1:] for s in quiet.stored] == [(1.1, None)]  # quiet before: stored
    session_module._time_sharing_cached(loaded, captured, captured.flatten_inputs((x,), {}),
                                        4, 2)  # type: ignore[arg-type]
    assert [s[1:] for s in loaded.stored] == [(1.1, "load average 3.5 on 2 CPUs")]
