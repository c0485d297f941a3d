"""CompileOptions' tp, dp and zero_stage: checked values, and the local backend refusing them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import autopart
from autopart import CompileOptions, PlanError
from autopart.core.capture import capture
from tests.plans import even_positions, manual_plan
from tests.zoo import mlp


@pytest.mark.parametrize(("given", "match"), [
    ({"tp": 0}, r"tp=0 must be an integer >= 1"),
    ({"dp": 1.5}, r"dp=1.5 must be an integer >= 1"),
    ({"zero_stage": 4}, r"zero_stage=4 is not a ZeRO stage; valid: 0 \(none\), 1"),
])
def test_bad_3d_options(given: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        CompileOptions(**given)


def test_tp_one_dp_one_is_accepted() -> None:
    CompileOptions(tp=1, dp=1, zero_stage=0).check_runtime(None)


@pytest.mark.parametrize("given", [{"tp": 2}, {"dp": 4}, {"dp": 2, "zero_stage": 1}])
def test_the_local_backend_refuses_a_layout_it_cannot_run(given: dict[str, Any]) -> None:
    model, args, _, loss_fn = mlp()
    with pytest.raises(PlanError, match=r"the local backend runs every stage in one process.*"
                                        r"torchrun --nproc-per-node"):
        autopart.compile(model, args, loss_fn=loss_fn, devices=["cpu"], **given)


def test_the_distributed_backend_takes_any_layout() -> None:
    for given in ({"tp": 2}, {"dp": 2, "zero_stage": 3}):
        CompileOptions(**given).check_runtime(None, "distributed")  # no error


def test_the_local_backend_refuses_a_replayed_3d_plan() -> None:
    model, args, _, loss_fn = mlp()  # batch 8
    captured = capture(model, (args[0][:4],))
    plan = manual_plan(captured, even_positions(captured, 2), 2, 8, schedule_kind="1f1b")
    plan = dataclasses.replace(plan, dp=2)
    with pytest.raises(PlanError, match=r"tp=1, dp=2, zero_stage=0: the local backend"):
        autopart.compile(model, args, loss_fn=loss_fn, plan=plan, devices=["cpu", "cpu"])
