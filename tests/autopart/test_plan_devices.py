"""Which devices a replayed plan runs on (autopart.planning.plan_devices)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopart.devices import plan_devices
from autopart.planning import plan_model


def _plan(devices: list[str]):  # type: ignore[no-untyped-def]
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    plan, _ = plan_model(model, (torch.randn(8, 8),), devices=["cpu", "cpu"],
                         num_microbatches=2, cache=False)
    return dataclasses.replace(
        plan, ranks=tuple(dataclasses.replace(r, device=devices[r.rank]) for r in plan.ranks),
        stages=tuple(dataclasses.replace(s, device=devices[s.rank]) for s in plan.stages))


def test_the_plans_own_devices_when_they_are_here_else_a_warning() -> None:
    assert plan_devices(_plan(["cpu", "cpu"]), None) == ["cpu", "cpu"]
    assert plan_devices(_plan(["cpu", "cpu"]), ["cpu", "cpu"]) == ["cpu", "cpu"]
    far = _plan([f"cuda:{torch.cuda.device_count() + 1}"] * 2)
    with pytest.warns(RuntimeWarning, match=r"not all on this machine; its ranks run on"):
        chosen = plan_devices(far, None)
    assert len(chosen) == 2
