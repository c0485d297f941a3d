"""fuse=True as a priced choice: the profile calibrated to compiled segments' times."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autopart
from autopart.core.capture import capture
from autopart.planning import plan_model, profile_model
from autopart.profiler import batch_points
from autopart.profiler.batch_points import FUSED
from autopart.profiler.calibrate import segment_times


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                            for _ in range(4)])
    return model, torch.randn(8, 32)


class _FixedTimes:
    """Stands in for ``segment_times``: records each call's cuts and ``fuse``, and returns
    fixed times, segment k taking ``(1e5 (k + 1), 3e5 (k + 1))`` µs: far from any eager
    node sum of these tiny models, so that a plan priced on them shows it."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def times(self, positions: Any) -> list[tuple[float, float]]:
        return [(1e5 * (k + 1), 3e5 * (k + 1)) for k in range(len(positions) + 1)]

    def __call__(self, captured: Any, flat: Any, device: str, positions: Any, *,
                 fuse: bool = False, **_: Any) -> list[tuple[float, float]]:
        self.calls.append((tuple(positions), fuse))
        return self.times(positions)


@pytest.fixture
def fixed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> _FixedTimes:
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    fake = _FixedTimes()
    monkeypatch.setattr(batch_points, "segment_times", fake)
    return fake


def _methods(cache: Path) -> list[str]:
    return [json.loads(p.read_text())["key"]["method"] for p in cache.glob("profile-*.json")]


def test_fuse_reaches_the_calibration_and_the_cache_key(fixed: _FixedTimes,
                                                        tmp_path: Path) -> None:
    model, x = _mlp()
    kw: dict[str, Any] = {"devices": ["cpu"], "num_microbatches": 2, "cache": True}
    eager = profile_model(model, (x,), **kw)
    assert fixed.calls == []  # one local rank, eager stages: the per-node profile as it was
    fused = profile_model(model, (x,), fuse=True, **kw)
    assert fixed.calls and all(fuse for _, fuse in fixed.calls)
    methods = _methods(tmp_path)
    assert len(methods) == 2 and sum(FUSED in m for m in methods) == 1
    assert fused.costs.total_fwd_us() != pytest.approx(eager.costs.total_fwd_us())
    calls = len(fixed.calls)
    again = profile_model(model, (x,), fuse=True, **kw)  # read from the cache: no compiling
    assert "profile" in again.from_cache and len(fixed.calls) == calls
    assert again.costs == fused.costs


def test_compiled_segment_times_set_every_segment_sum(fixed: _FixedTimes) -> None:
    model, x = _mlp()
    prof = profile_model(model, (x,), devices=["cpu"], num_microbatches=2, cache=False,
                         fuse=True)
    ((cuts, _),) = fixed.calls
    assert cuts  # the tiny model is cut into segments, each compiled and timed apart
    bounds = [0, *cuts, len(prof.costs.nodes)]
    for (a, z), (fwd, bwd) in zip(itertools.pairwise(bounds), fixed.times(cuts), strict=True):
        nodes = prof.costs.nodes[a:z]
        assert sum(n.fwd_us for n in nodes) == pytest.approx(fwd)
        assert sum(n.bwd_input_us + n.bwd_weight_us for n in nodes) == pytest.approx(bwd)


def test_fuse_reaches_every_batch_point_where_m_is_open(fixed: _FixedTimes,
                                                        tmp_path: Path) -> None:
    model, x = _mlp()
    x = torch.randn(32, 32)
    prof = profile_model(model, (x,), devices=["cpu", "cpu"], split_cost=False, cache=True,
                         fuse=True)
    assert prof.costs.low_batch_size == 2  # the batch points were timed, all compiled
    assert len(fixed.calls) >= 2 and all(fuse for _, fuse in fixed.calls)
    assert any(FUSED in m for m in _methods(tmp_path))


def test_a_fused_plans_predicted_step_uses_the_compiled_figures(fixed: _FixedTimes) -> None:
    model, x = _mlp()
    m = 2
    plan, _ = plan_model(model, (x,), devices=["cpu"], num_microbatches=m,
                         schedule_kind="gpipe", recompute=False, cache=False, fuse=True)
    ((cuts, _),) = fixed.calls
    per_microbatch = sum(f + b for f, b in fixed.times(cuts))
    # one stage runs every microbatch's forward and backward: m x the compiled segments' sum
    assert plan.predicted_step_time_us == pytest.approx(m * per_microbatch, rel=1e-3)


def test_compile_passes_fuse_to_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    class Seen(Exception):
        pass

    def record(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise Seen

    monkeypatch.setattr("autopart.steps.plan_step.plan_model", record)
    model, x = _mlp()
    for fuse in (True, False):
        with pytest.raises(Seen):
            autopart.compile(model, (x,), loss_fn=nn.functional.mse_loss,
                             example_target=torch.randn(8, 32), devices=["cpu", "cpu"],
                             fuse=fuse)
        assert seen["fuse"] is fuse


def test_segment_times_compile_each_segment_when_fusing() -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(),
                          nn.Linear(16, 4))
    x = torch.randn(4, 16)
    captured = capture(model, (x,))
    flat = captured.flatten_inputs((x,), {})
    torch._dynamo.reset()
    counters.clear()
    times = segment_times(captured, flat, "cpu", (2,), min_repeats=1, budget_s=0.0, fuse=True)
    assert len(times) == 2 and all(f > 0 and b > 0 for f, b in times)
    assert counters["stats"]["unique_graphs"] == 2  # one compiled graph per segment
    assert all(p.grad is None for p in model.parameters())
