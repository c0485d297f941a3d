import json
import os
from pathlib import Path

import pytest

from autopart.core.errors import PlanError
from autopart.core.plan import Cut, Plan, RankPlan, SolverReport, StagePlan


def make_plan(**overrides: object) -> Plan:
    stages = tuple(StagePlan(s, s, "cpu", f"n{s}", f"n{s}x", 3, (f"m.{s}", f"m.{s}"), 10 * s, 40 * s,
                             1.5, 3.0, 0.25, 1000) for s in range(2))
    fields: dict[str, object] = dict(
        graph_fingerprint="abc", cluster_fingerprint="2xcpu", cost_source="measured:cpu",
        library_versions={"torch": "2.13.0"}, optimize="speed", batch_size=8,
        num_microbatches=4, schedule_kind="gpipe", cuts=(Cut(3, "n0x", "n1", 512),),
        stages=stages, ranks=(RankPlan(0, "cpu", (0,), 1000), RankPlan(1, "cpu", (1,), 1000)),
        predicted_step_time_us=33.3, bubble_fraction=0.2,
        solver=SolverReport("OPTIMAL", 4.5, 4.5, 0.0, 0.01))
    fields.update(overrides)
    return Plan(**fields)  # type: ignore[arg-type]


def test_save_load_round_trip_is_equal(tmp_path: Path) -> None:
    plan = make_plan()
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path) == plan
    data = json.loads(path.read_text())
    assert list(data) == sorted(data)  # stable key order
    assert data["solver"]["status"] == "OPTIMAL"


def test_failed_write_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.json"
    make_plan().save(path)
    before = path.read_text()

    def boom(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        make_plan(batch_size=16).save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary left behind


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_microbatches": 3}, "must be >= 1 and divide batch_size=8"),
    ({"optimize": "fast"}, "optimize='fast'"),
    ({"schedule_kind": "pipedream"}, "schedule_kind='pipedream'"),
    ({"cuts": ()}, "2 stages but 0 cuts"),
    ({"bubble_fraction": 1.5}, "outside"),
])
def test_invalid_plans_are_rejected(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(**overrides)


def test_load_rejects_non_json_unknown_and_missing_fields(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(PlanError, match="not a JSON plan file"):
        Plan.load(bad)
    data = make_plan().to_dict()
    data["surprise"] = 1
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"unknown plan field\(s\) \['surprise'\]"):
        Plan.load(bad)
    data = make_plan().to_dict()
    del data["cuts"]
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="missing field 'cuts'"):
        Plan.load(bad)
    data = make_plan().to_dict()
    data["schema_version"] = 99
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="schema_version 99"):
        Plan.load(bad)
