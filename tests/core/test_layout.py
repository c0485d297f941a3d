"""3D layouts: the degree checks, and plan files with tp, dp and ZeRO (schema 2; schema 1 loads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopart.core.errors import PlanError
from autopart.core.layout import (
    ParallelLayout,
    check_degrees,
    check_global_batch,
    check_tp,
    check_zero_stage,
    nearest,
)
from autopart.core.plan import PLAN_SCHEMA_VERSION, Plan, ShardedParameter
from tests.core.test_plan import make_plan


def test_nearest() -> None:
    assert nearest(3, [1, 2, 4, 8]) == [2, 4]
    assert nearest(8, [1, 2, 3, 4, 6, 12]) == [4, 6]


def test_layout_degrees() -> None:
    layout = ParallelLayout(tp=8, pp=4, dp=32, zero_stage=1)
    assert layout.num_gpus == 1024
    assert layout.describe() == "tp 8 x pp 4 x dp 32, ZeRO-1"
    with pytest.raises(PlanError, match="dp=0 must be an integer >= 1"):
        ParallelLayout(dp=0)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: check_tp(3, gpus_per_host=8), r"tp=3 must divide the 8 GPUs per host.*\[2, 4\]"),
    (lambda: check_tp(8, gpus_per_host=8, num_heads=12),
     r"tp=8 does not divide the model's 12 attention heads; nearest valid: \[2, 4\]"),
    (lambda: check_degrees(8, 2, 16, 512), r"8 x 2 x 16 = 256, but the cluster has 512 GPUs; "
                                           r".*use dp=32"),
    (lambda: check_degrees(8, 3, 1, 64), r"with tp=8, pp must divide 8: nearest valid pp "
                                         r"\[2, 4\]"),
    (lambda: check_global_batch(1000, 48), r"global batch 1000 does not split over dp=48"),
    (lambda: check_global_batch(64, 4, 3), r"gives 16 per replica, which m=3 microbatches "
                                           r"cannot split; nearest valid m: \[2, 4\]"),
    (lambda: check_zero_stage(-1), r"zero_stage=-1 is not a ZeRO stage"),
    (lambda: check_zero_stage(True), r"zero_stage=True is not a ZeRO stage"),
])
def test_bad_degrees_name_the_value_and_the_nearest_valid(call: object, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        call()  # type: ignore[operator]


def test_a_3d_plan_round_trips(tmp_path: Path) -> None:
    plan = make_plan(tp=4, dp=2, zero_stage=1, model_flops=123,
                     sharded_parameters=(ShardedParameter("a.w", "column"),
                                         ShardedParameter("b.w", "row")))
    assert plan.num_gpus == 16 and plan.schema_version == PLAN_SCHEMA_VERSION == 2
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path) == plan


def test_a_schema_1_plan_loads_as_tp_dp_1(tmp_path: Path) -> None:
    data = make_plan().to_dict()
    for key in ("tp", "dp", "zero_stage", "sharded_parameters", "model_flops"):
        del data[key]
    data["schema_version"] = 1
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = Plan.load(path)
    assert (old.tp, old.dp, old.zero_stage, old.sharded_parameters) == (1, 1, 0, ())
    assert old.schema_version == 1


@pytest.mark.parametrize(("overrides", "match"), [
    ({"tp": 0}, r"tp=0, dp=1, zero_stage=0: tp and dp must be >= 1"),
    ({"zero_stage": 4}, r"zero_stage one of 0, 1, 2, 3"),
    ({"dp": 3}, r"num_microbatches=4 x dp=3 must divide batch_size=8"),
    ({"schema_version": 1, "tp": 2}, r"schema_version 1 has no tp"),
    ({"schema_version": 7}, r"schema_version 7 is not supported"),
    ({"sharded_parameters": (ShardedParameter("a.w", "row"),)}, r"sharded_parameters listed "
                                                                 r"with tp=1"),
    ({"tp": 2, "sharded_parameters": (ShardedParameter("a.w", "row"),) * 2}, r"appears twice"),
])
def test_bad_3d_plans_are_refused(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        make_plan(**overrides)


def test_bad_shard_style() -> None:
    with pytest.raises(PlanError, match=r"style 'diagonal'; expected one of"):
        ShardedParameter("a.w", "diagonal")
