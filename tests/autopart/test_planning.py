"""plan_model's profile cache: on by default and reused across compiles (same costs, same plan)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import autopart
import autopart.planning as planning
import autopart.profiler.profile_state as profile_state
import autopart.profiler.session as session
from autopart.profiler.batch_points import batch_points, scaled_batch_points
from tests.zoo import mlp


def _unclocked(plan: autopart.Plan) -> autopart.Plan:
    """The plan without the solver's wall time (the one field a replay may change)."""
    return replace(plan, solver=replace(plan.solver, wall_s=0.0))


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of ``<name>`` where profiling calls it (still calling it):
    ``autopart.profiler.session`` or the session's state, ``profile_state``."""
    calls: list[int] = []
    module = session if hasattr(session, name) else profile_state
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_second_compile_reuses_the_cached_profile_and_split_cost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    profiles = _counting(monkeypatch, "profile_graph")
    splits = _counting(monkeypatch, "measure_split_backward_overhead")
    model, args, _, loss_fn = mlp()
    first = autopart.compile(model, args, loss_fn=loss_fn, devices=["cpu", "cpu"],
                             num_microbatches=2, time_limit_s=2.0)
    second = autopart.compile(model, args, loss_fn=loss_fn, devices=["cpu", "cpu"],
                              num_microbatches=2, time_limit_s=2.0)
    assert (len(profiles), len(splits)) == (1, 1)  # measured once, read the second time
    assert _unclocked(second.plan) == _unclocked(first.plan)
    assert "split_cost_s" in second.timings_s  # priced, from the cache
    # a profile of another shape is another entry
    autopart.compile(model, (torch.cat([args[0], args[0]]),), loss_fn=loss_fn,
                     devices=["cpu", "cpu"], num_microbatches=2, time_limit_s=2.0)
    assert (len(profiles), len(splits)) == (2, 2)
    # the cache can be turned off: then every compile measures
    monkeypatch.setenv("AUTOPART_CACHE", "0")
    autopart.compile(model, args, loss_fn=loss_fn, devices=["cpu", "cpu"], num_microbatches=2,
                     time_limit_s=2.0)
    assert (len(profiles), len(splits)) == (3, 3)


def test_profile_reports_what_came_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    profiles = _counting(monkeypatch, "profile_graph")
    model, args, _, loss_fn = mlp()
    cold = planning.profile_model(model, args, devices=["cpu", "cpu"])
    assert cold.from_cache == frozenset()
    warm = planning.profile_model(model, args, devices=["cpu", "cpu"])
    # m is open: the smallest microbatch's profile and the larger one's whole-graph times too
    assert warm.from_cache == {"profile", "split_cost", "low_batch_profile", "high_batch_times"}
    assert warm.costs == cold.costs
    assert warm.runtime.split_backward_us_per_node == cold.runtime.split_backward_us_per_node
    # m is open: the split's cost is timed at each microbatch size whose segments were timed,
    # smallest first, and cached per size
    batch = args[0].shape[0]
    points = batch_points(batch, cold.microbatch_candidates, 2)
    assert points is not None
    ms = sorted({*points, *scaled_batch_points(batch, cold.microbatch_candidates, 2,
                                                         points)}, reverse=True)
    assert [r for r, _ in cold.runtime.split_backward_points] == [batch // m for m in ms]
    assert len(ms) >= 2 and warm.runtime.split_backward_points == cold.runtime.split_backward_points
    assert cold.runtime.split_backward_us_per_node == cold.runtime.split_backward_points[0][1]
    assert cold.options().runtime.split_backward_points == cold.runtime.split_backward_points
    # a profile without the split factor is completed by the first call that needs it
    other, x = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), torch.randn(4, 8)
    assert planning.profile_model(other, (x,), devices=["cpu"]).from_cache == frozenset()
    assert planning.profile_model(other, (x,), devices=["cpu", "cpu"]).from_cache == {"profile"}
    assert planning.profile_model(other, (x,), devices=["cpu", "cpu"]).from_cache == {
        "profile", "split_cost"}
    assert planning.profile_model(other, (x,), devices=["cpu", "cpu"],
                                  cache=False).from_cache == frozenset()
    assert len(profiles) == 4  # the MLP's full batch and smallest microbatch, other's twice


@pytest.mark.parametrize("num_microbatches", [None, 2], ids=["m-open", "m-fixed"])
def test_a_second_launch_reads_the_measured_loss_and_plans_the_same(
        monkeypatch: pytest.MonkeyPatch, num_microbatches: int | None) -> None:
    """The loss measured with an example target is cached with the profile: a re-measured
    loss moved the demo's plan (cuts and predicted step) from one launch to the next."""
    losses = _counting(monkeypatch, "measure_loss_cost")
    model, args, target, loss_fn = mlp()
    kwargs: dict[str, Any] = dict(devices=["cpu", "cpu"], loss_fn=loss_fn,
                                  example_target=target, num_microbatches=num_microbatches)
    cold = planning.profile_model(model, args, **kwargs)
    measured = len(losses)
    assert measured >= 1
    warm = planning.profile_model(model, args, **kwargs)
    assert len(losses) == measured  # read, not measured again
    assert warm.costs == cold.costs
    planning.profile_model(model, args, cache=False, **kwargs)
    assert len(losses) > measured  # without the cache it is measured again
