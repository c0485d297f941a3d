"""The distributed runtime's cost per transfer between ranks: fitted to a measured step, measured on
two gloo processes, cached per machine and carried by a distributed profile into its plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopart
from autopart import planning
from autopart.core.errors import ProfileError
from autopart.runtime_overhead import fit_transfer_overhead


def test_the_fit_is_the_overhead_at_which_the_prediction_meets_the_measurement() -> None:
    def predict(a: float) -> float:  # 34 actions on the critical path, 6 ms of compute
        return 6000.0 + 34 * a

    assert fit_transfer_overhead(predict, 6000.0 + 34 * 512.0) == pytest.approx(512.0, abs=1.0)
    assert fit_transfer_overhead(predict, 5000.0) == 0.0  # already at or above: no charge
    with pytest.raises(ProfileError, match="is not reached"):
        fit_transfer_overhead(predict, 1e9)


def test_two_gloo_processes_measure_a_positive_cost_per_action() -> None:
    overhead = planning.measure_transfer_overhead()
    # measured here at 370-700 µs; on any host it is Python and a few posted messages per
    # action, far from a whole step of the tiny pipeline's (tens of ms)
    assert 0.0 <= overhead < 20_000.0


def test_a_distributed_cpu_profile_carries_the_cached_cost_into_its_plans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    planning.transfer_overhead.cache_clear()
    calls = []

    def measure() -> float:
        calls.append(1)
        return 250.0

    monkeypatch.setattr(planning, "measure_transfer_overhead", measure)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    x = torch.randn(8, 16)
    try:
        dist, prof = autopart.plan_model(model, (x,), devices=["cpu", "cpu"],
                                         num_microbatches=4, schedule="1f1b",
                                         runtime="distributed")
        planning.transfer_overhead.cache_clear()  # a new process reads the file
        _, again = autopart.plan_model(model, (x,), devices=["cpu", "cpu"],
                                       num_microbatches=4, schedule="1f1b",
                                       runtime="distributed")
        local, local_prof = autopart.plan_model(model, (x,), devices=["cpu", "cpu"],
                                                num_microbatches=4, schedule="1f1b")
    finally:
        planning.transfer_overhead.cache_clear()
    assert prof.transfer_overhead_us == again.transfer_overhead_us == 250.0 and len(calls) == 1
    assert local_prof.transfer_overhead_us == 0.0  # the one-process executor is not charged
    assert "transfer_overhead_s" in prof.timings_s
    # 1F1B, m = 4, 2 ranks: at least the 8 actions of a rank's timeline pay it
    assert dist.predicted_step_time_us >= local.predicted_step_time_us + 8 * 250.0 - 1.0
    assert planning.Profile.options(prof).transfer_overhead_us == 250.0
