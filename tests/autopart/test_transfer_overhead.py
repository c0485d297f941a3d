"""The distributed runtime's cost per transfer between ranks: fitted to a measured step, measured on
two gloo processes, cached per machine and carried by a distributed profile into its plans."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import autopart
from autopart import planning
from autopart.core.errors import ProfileError
from autopart.profiler import batch_points
from autopart.profiler.links import LinkFigures
from autopart.profiler.transfer_overhead import fit_transfer_overhead


def test_the_fit_is_the_overhead_at_which_the_prediction_meets_the_measurement() -> None:
    def predict(a: float) -> float:  # 34 actions on the critical path, 6 ms of compute
        return 6000.0 + 34 * a

    assert fit_transfer_overhead(predict, 6000.0 + 34 * 512.0) == pytest.approx(512.0, abs=1.0)
    assert fit_transfer_overhead(predict, 5000.0) == 0.0  # already at or above: no charge
    with pytest.raises(ProfileError, match="is not reached"):
        fit_transfer_overhead(predict, 1e9)


def test_two_gloo_processes_measure_the_link_and_a_positive_cost_per_transfer() -> None:
    # Real processes; the verdict never depends on the machine's load: a busy machine's times
    # are a ProfileError that says so (the fits are tested on fixed figures above and in
    # tests/profiler/test_links.py), never a figure out of bounds.
    try:
        link, overhead = planning.measure_host_figures(use_cache=False)
    except ProfileError as err:
        assert "quiet" in str(err) or "is not reached" in str(err), err
        return
    assert link.bandwidth_bytes_per_s > 0 and link.latency_us >= 0
    assert overhead >= 0.0


def test_a_distributed_cpu_profile_carries_the_cached_cost_into_its_plans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    planning.host_figures.cache_clear()
    calls = []
    fake_link = LinkFigures(80.0, 2.5e9, (16384, 262144), (86.0, 185.0))

    def measure(use_cache: bool = True) -> tuple[LinkFigures, float]:
        calls.append(use_cache)
        return fake_link, 250.0

    monkeypatch.setattr(planning, "measure_host_figures", measure)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    x = torch.randn(8, 16)
    try:
        dist, prof = autopart.plan_model(model, (x,), devices=["cpu", "cpu"],
                                         num_microbatches=4, schedule_kind="1f1b",
                                         backend="distributed")
        planning.host_figures.cache_clear()  # a new process reads the files
        _, again = autopart.plan_model(model, (x,), devices=["cpu", "cpu"],
                                       num_microbatches=4, schedule_kind="1f1b",
                                       backend="distributed")
    finally:
        planning.host_figures.cache_clear()
    # the one-process executor is not charged; its link is the same cached one
    local, local_prof = autopart.plan_model(model, (x,), devices=["cpu", "cpu"],
                                            num_microbatches=4, schedule_kind="1f1b")
    assert prof.runtime.transfer_overhead_us == again.runtime.transfer_overhead_us == 250.0
    assert len(calls) == 1
    assert prof.host_link == again.host_link == local_prof.host_link == fake_link
    assert local_prof.runtime.transfer_overhead_us == 0.0
    # 1F1B, m = 4, 2 ranks: at least the 8 actions of a rank's timeline pay it (against the
    # same profile replayed without it: the distributed profile is calibrated beside a
    # co-runner, so its node times differ from the local one's by a few per cent)
    bare = autopart.trace.predict(prof, dist, runtime=dataclasses.replace(
        prof.runtime, transfer_overhead_us=0.0)).step_time_us
    assert dist.predicted_step_time_us >= bare + 8 * 250.0 - 1.0
    assert prof.options().runtime.transfer_overhead_us == 250.0


def test_the_distributed_runtimes_cpu_calibration_runs_beside_the_other_ranks_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With m left to the solver the profile's segments are timed at two microbatch sizes;
    for the distributed runtime on two CPU ranks, beside one forked copy of the process
    running the model (the other rank), never for the one-process runtime."""
    import contextlib

    from autopart.profiler import corunners

    if not corunners.available():
        pytest.skip("co-runners need os.fork on Linux")
    planning.host_figures.cache_clear()
    monkeypatch.setattr(planning, "measure_host_figures",
                        lambda use_cache=True: (LinkFigures(80.0, 2.5e9, (16384, 262144),
                                                            (86.0, 185.0)), 250.0))
    entered: list[int] = []
    real = corunners.co_runners

    @contextlib.contextmanager
    def spy(work, count):  # type: ignore[no-untyped-def]
        with real(work, count) as running:
            entered.append(running)
            yield running

    monkeypatch.setattr(batch_points, "co_runners", spy)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    x = torch.randn(16, 16)
    try:
        _, prof = autopart.plan_model(model, (x,), devices=["cpu", "cpu"], schedule_kind="1f1b",
                                      backend="distributed", cache=False)
        assert prof.co_runners == 1 and entered and set(entered) == {1}
        entered.clear()
        # m fixed (a torchrun launch's usual call): the microbatch's own profile is
        # calibrated beside the co-runner, and cached under a key that says so
        _, fixed = autopart.plan_model(model, (x,), devices=["cpu", "cpu"], schedule_kind="1f1b",
                                       num_microbatches=4, backend="distributed")
    finally:
        planning.host_figures.cache_clear()
    assert fixed.co_runners == 1 and entered == [1]
    methods = [json.loads(f.read_text())["key"]["method"]
               for f in Path(os.environ["AUTOPART_CACHE_DIR"]).glob("profile-*.json")]
    assert [m.endswith(",segment-calibrated-v2,co-runners=1") for m in methods] == [True]
    entered.clear()
    _, local = autopart.plan_model(model, (x,), devices=["cpu", "cpu"], schedule_kind="1f1b",
                                   cache=False)
    assert local.co_runners == 0 and set(entered) <= {0}
