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
    with pytest.raises((OSError, PlanError), match="disk full"):
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


def _ranks(*stage_lists: tuple[int, ...]) -> tuple[RankPlan, ...]:
    return tuple(RankPlan(r, "cpu", s, 0) for r, s in enumerate(stage_lists))


def _stages(ranks: list[int]) -> tuple[StagePlan, ...]:
    return tuple(StagePlan(s, r, "cpu", "", "", 0, ("", ""), 0, 0, 0.0, 0.0, 0.0, 0)
                 for s, r in enumerate(ranks))


@pytest.mark.parametrize(("overrides", "message"), [
    # stages = ranks x stages_per_rank
    ({"ranks": _ranks((0,), (1,), ())}, r"2 stages on 3 ranks with stages_per_rank=1; .* = 3"),
    ({"stages_per_rank": 2, "schedule_kind": "interleaved_1f1b"},
     r"2 stages on 2 ranks with stages_per_rank=2"),
    # v > 1 only for interleaving; interleaving needs m % p == 0
    ({"stages_per_rank": 2}, r"stages_per_rank=2 with schedule_kind='gpipe': only "
                             r"'interleaved_1f1b'"),
    ({"stages_per_rank": 0}, r"stages_per_rank=0 .* \(v >= 1\)"),
    ({"schedule_kind": "interleaved_1f1b", "num_microbatches": 1, "batch_size": 1},
     r"interleaved_1f1b needs num_microbatches \(1\) to be a multiple of the number of ranks \(2\)"),
    # every stage on an existing rank, ranks own exactly their stages
    ({"stages": _stages([0, 2])}, r"stage 1 is on rank 2, but the plan has 2 ranks"),
    ({"stages": _stages([1, 0])}, r"ranks\[0\]|stage 0 is on rank 1"),
    ({"ranks": _ranks((0, 1), ())}, r"ranks\[0\] has rank=0, stage_indices=\[0, 1\]; rank 0 of 2 "
                                    r"runs stages \[0\]"),
    ({"ranks": (RankPlan(1, "cpu", (0,), 0), RankPlan(0, "cpu", (1,), 0))},
     r"ranks\[0\] has rank=1"),
    ({"ranks": ()}, r"2 stages on 0 ranks"),
    ({"stages": (*_stages([0]), StagePlan(0, 1, "cpu", "", "", 0, ("", ""), 0, 0, 0.0, 0.0, 0.0, 0))},
     r"stages\[1\] has stage_index 0; stages are listed in order 0..1"),
    ({"stages": (*_stages([0]), StagePlan(1, 1, "cuda:1", "", "", 0, ("", ""), 0, 0, 0.0, 0.0,
                                          0.0, 0))}, r"stage 1 names device 'cuda:1'"),
    # cuts
    ({"cuts": (Cut(0, "a", "b", 0),)}, r"cut positions \[0\] must be >= 1"),
    ({"cuts": (Cut(3, "a", "b", 0), Cut(3, "a", "b", 0)), "stages": _stages([0, 1, 2]),
      "ranks": _ranks((0,), (1,), (2,))}, r"cut positions \[3, 3\] must be >= 1 and strictly"),
    ({"cuts": (Cut(3, "", "b", 0),)}, r"cuts\[0\] names no node on one side"),
    # integers are integers, numbers are finite
    ({"num_microbatches": 2.7}, r"num_microbatches=2.7 must be an integer >= 0 \(not a bool"),
    ({"num_microbatches": True}, r"num_microbatches=True must be an integer"),
    ({"batch_size": "8"}, r"batch_size='8' must be an integer"),
    ({"num_microbatches": 0}, r"num_microbatches=0 must be >= 1 and divide batch_size=8"),
    ({"batch_size": 0}, r"num_microbatches=4 must be >= 1 and divide batch_size=0"),
    ({"predicted_step_time_us": float("nan")}, r"predicted_step_time_us=nan must be a finite"),
    ({"predicted_step_time_us": 10**400}, r"must be a finite number"),
    ({"schema_version": True}, r"schema_version=True must be an integer"),
    ({"library_versions": {"torch": 2}}, r"library_versions=.* must be an object of strings"),
    ({"cuts": [Cut(3, "n0x", "n1", 512)]}, r"cuts=.* must be a list of cuts"),
    # fingerprints present
    ({"graph_fingerprint": ""}, r"graph_fingerprint is empty"),
    ({"cluster_fingerprint": " "}, r"cluster_fingerprint is empty"),
    ({"cost_source": None}, r"cost_source=None must be a string"),
])
def test_plans_are_checked_as_a_whole(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(**overrides)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Cut(True, "a", "b", 0), r"Cut.position=True must be an integer >= 0"),
    (lambda: Cut(1, "a", "b", -1), r"Cut.crossing_bytes=-1 must be an integer >= 0"),
    (lambda: StagePlan(0, 0, "cpu", "", "", 0, ("", ""), 0, 0, 0.0, 0.0, 0.0, 0, recompute=1),
     r"StagePlan.recompute=1 must be true or false"),
    (lambda: StagePlan(0, 0, "cpu", "", "", 0, ("",), 0, 0, 0.0, 0.0, 0.0, 0),
     r"StagePlan.module_range=\('',\) must be a list of two strings"),
    (lambda: RankPlan(0, "cpu", (0.5,), 0), r"RankPlan.stage_indices=\(0.5,\) must be a list of "
                                            r"integers"),
    (lambda: SolverReport("OK", float("inf"), 0.0, 0.0, 0.0), r"SolverReport.objective=inf"),
])
def test_parts_check_their_fields(build: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        build()  # type: ignore[operator]


def test_interleaved_plan_is_valid() -> None:
    plan = make_plan(schedule_kind="interleaved_1f1b", stages_per_rank=2,
                     cuts=(Cut(1, "a", "b", 0), Cut(2, "b", "c", 0), Cut(3, "c", "d", 0)),
                     stages=_stages([0, 1, 0, 1]), ranks=_ranks((0, 2), (1, 3)))
    assert plan.num_stages == 4


def _edited(tmp_path: Path, edit: object) -> Path:
    data = json.loads(json.dumps(make_plan().to_dict()))
    edit(data)  # type: ignore[operator]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(num_microbatches=2.7), r"num_microbatches=2.7 must be an integer"),
    (lambda d: d.update(num_microbatches=True), r"num_microbatches=True must be an integer"),
    (lambda d: d["stages"][1].update(rank=2), r"stage 1 is on rank 2, but the plan has 2 ranks"),
    (lambda d: d["stages"][1].update(rank=1.0), r"stages\[1\].rank=1.0 must be an integer"),
    (lambda d: d["ranks"].append({"rank": 2, "device": "cpu", "stage_indices": [],
                                  "peak_memory_bytes": 0}), r"2 stages on 3 ranks"),
    (lambda d: d["ranks"][0].update(stage_indices=[1]), r"ranks\[0\] has rank=0, stage_indices=\[1\]"),
    (lambda d: d["ranks"][0].update(stage_indices=7), r"ranks\[0\].stage_indices=7 must be a list"),
    (lambda d: d["stages"].reverse(), r"stages\[0\] has stage_index 1"),
    (lambda d: d["stages"][0].pop("rank"), r"missing field 'rank' in stages\[0\]"),
    (lambda d: d["stages"][0].update(colour=1), r"unknown stages\[0\] field\(s\) \['colour'\]"),
    (lambda d: d.update(cuts={"position": 3}), r"cuts=.* must be a list"),
    (lambda d: d.update(cuts=[3]), r"cuts\[0\] must be a JSON object, got int"),
    (lambda d: d.update(solver=None), r"solver must be a JSON object, got NoneType"),
    (lambda d: d.update(library_versions=[]), r"library_versions=\[\] must be an object"),
    (lambda d: d.update(lower_bounds={"step_time_us": 1.0}), r"missing field 'peak_memory_bytes' "
                                                             r"in lower_bounds"),
    (lambda d: d.update(graph_fingerprint=""), r"graph_fingerprint is empty"),
    (lambda d: d.update(stages_per_rank="1"), r"stages_per_rank='1' must be an integer"),
])
def test_load_refuses_edited_plans_naming_the_field(tmp_path: Path, edit: object,
                                                    message: str) -> None:
    path = _edited(tmp_path, edit)
    with pytest.raises(PlanError, match=rf"{path}: invalid plan: .*{message}"):
        Plan.load(path)


@pytest.mark.parametrize(("content", "message"), [
    (b"\xff\xfe\x00junk", r"not UTF-8 text: byte 0"),
    (b"[" * 100_000 + b"]" * 100_000, r"nested too deep"),
    (b'{"batch_size": ' + b"9" * 5000 + b"}", r"not a JSON plan file \(Exceeds the limit"),
    (b'{"batch_size": 8, "batch_size": 4}', r"key 'batch_size' appears twice"),
    (b"", r"not a JSON plan file \(Expecting value"),
    (b"[1, 2]", r"plan must be a JSON object, got list"),
])
def test_load_refuses_bad_files_with_plan_error(tmp_path: Path, content: bytes,
                                                message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_load_refuses_a_directory_and_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"cannot read a plan file there \(Is a directory\)"):
        Plan.load(tmp_path)
    with pytest.raises(PlanError, match=r"nope.json: cannot read a plan file there \(No such file"):
        Plan.load(tmp_path / "nope.json")


def test_truncated_plan_files_are_refused(tmp_path: Path) -> None:
    text = json.dumps(make_plan().to_dict(), indent=2)
    path = tmp_path / "cut.json"
    for n in range(0, len(text), 7):
        path.write_text(text[:n])
        with pytest.raises(PlanError, match="not a JSON plan file"):
            Plan.load(path)


def test_ep_must_divide_dp_and_older_plans_load_as_ep_1() -> None:
    plan = make_plan(dp=2, batch_size=16, ep=2)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).ep == 2
    older = plan.to_dict()
    del older["ep"]
    assert Plan.from_dict(older).ep == 1
    with pytest.raises(PlanError, match=r"ep=3 with dp=2.*divide dp"):
        make_plan(dp=2, batch_size=16, ep=3)


def test_cp_attention_round_trips_older_plans_load_as_all_gather_and_ulysses_needs_cp() -> None:
    plan = make_plan(cp=2, cp_attention="ulysses")
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).cp_attention == "ulysses"
    older = plan.to_dict()
    del older["cp_attention"]
    assert Plan.from_dict(older).cp_attention == "all_gather"
    with pytest.raises(PlanError, match=r"cp_attention='ulysses' with cp=1.*'all_gather'"):
        make_plan(cp_attention="ulysses")
    with pytest.raises(PlanError, match=r"cp_attention='ring'.*expected one of"):
        make_plan(cp=2, cp_attention="ring")
