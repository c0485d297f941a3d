"""`autopart plan --3d / --tp / --pp / --dp / --zero-stage`: the axes reach the search and the summary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autopart.core.plan import Plan
from tests.cli.test_cli_plan import invoke, synthetic


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    synthetic().save(path)
    return path


def test_fixed_axes_reach_the_plan_and_the_summary(profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    code, text = invoke("plan", str(profile), "--cluster", "a100-80gb:8", "--tp", "2", "--pp", "2",
                        "--dp", "2", "--zero-stage", "1", "--batch-size", "16",
                        "--time-limit", "2", "--out", str(out))
    assert code == 0, text
    plan = Plan.load(out)
    assert (plan.tp, len(plan.ranks), plan.dp, plan.zero_stage) == (2, 2, 2, 1)
    assert plan.batch_size == 16 and plan.cluster_fingerprint == "8xa100-80gb/dgx-a100"
    assert "parallel layout (per GPU)" in text
    for axis in ("tensor parallel (tp)", "pipeline ranks (pp)", "data parallel (dp)",
                 "ZeRO stage", "largest memory per GPU", "TFLOP/s per GPU"):
        assert axis in text, axis


@pytest.mark.parametrize("flag", [[], ["--3d"]])
def test_3d_chooses_every_axis(profile: Path, tmp_path: Path, flag: list[str]) -> None:
    # a DGX-class preset ships in hosts of 8: all axes are chosen without --3d too
    out = tmp_path / "p.json"
    code, text = invoke("plan", str(profile), "--cluster", "h100:16", *flag, "--batch-size", "32",
                        "--time-limit", "2", "--out", str(out))
    assert code == 0, text
    plan = Plan.load(out)
    assert plan.tp * len(plan.ranks) * plan.dp == 16
    assert plan.solver.name.startswith("layout-search+")


def test_pipeline_only_makes_every_gpu_a_pipeline_rank(profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    code, text = invoke("plan", str(profile), "--cluster", "h100:4", "--pipeline-only",
                        "--batch-size", "8", "--time-limit", "2", "--out", str(out))
    assert code == 0, text
    plan = Plan.load(out)
    assert (plan.tp, len(plan.ranks), plan.dp) == (1, 4, 1)
    assert plan.cluster_fingerprint == "4xh100-sxm"
    code, text = invoke("plan", str(profile), "--cluster", "h100:4", "--pipeline-only",
                        "--tp", "2", "--out", str(out))
    assert code == 2 and "drop it to fix --tp" in text, text


@pytest.mark.parametrize(("args", "match"), [
    (["--tp", "3"], r"tp=3 must divide the 8 GPUs per host.*nearest valid: \[2, 4\]"),
    (["--tp", "8", "--heads", "12"], r"tp=8 does not divide the model's 12 attention heads"),
    (["--tp", "2", "--pp", "2", "--dp", "3"], r"tp x pp x dp = 2 x 2 x 3 = 12, but the cluster "
                                              r"has 8 GPUs"),
    (["--zero-stage", "5"], r"zero_stage=5 is not a ZeRO stage; valid: 0"),
    (["--dp", "8", "--batch-size", "12"], r"global batch 12 does not split over dp=8"),
])
def test_bad_axes_are_one_line_errors(profile: Path, tmp_path: Path, args: list[str],
                                      match: str) -> None:
    code, text = invoke("plan", str(profile), "--cluster", "a100-80gb:8", *args,
                        "--out", str(tmp_path / "p.json"))
    assert code == 2 and "Traceback" not in text, text
    assert re.search(match, text), text


def test_show_prints_the_layout_of_a_3d_plan(profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    assert invoke("plan", str(profile), "--cluster", "a100-80gb:8", "--tp", "2", "--dp", "2",
                  "--batch-size", "16", "--time-limit", "2", "--out", str(out))[0] == 0
    code, text = invoke("show", str(out))
    assert code == 0, text
    assert "parallel layout (per GPU)" in text and "data parallel (dp)" in text


def test_the_overlap_switch_reaches_the_plan_and_the_summary(profile: Path,
                                                             tmp_path: Path) -> None:
    # ZeRO-0 over dp 2: overlapped by default, after the schedule with the switch off
    for flag, want in ((None, True), ("--no-overlap-grad-reduce", False)):
        out = tmp_path / f"{want}.json"
        code, text = invoke("plan", str(profile), "--cluster", "a100-80gb:8", "--tp", "2",
                            "--pp", "2", "--dp", "2", "--zero-stage", "0", "--batch-size", "16",
                            "--time-limit", "2", "--out", str(out), *([flag] if flag else []))
        assert code == 0, text
        plan = Plan.load(out)
        assert plan.overlap_grad_reduce is want
        assert ("overlapped with the last backward" if want else "after the schedule") in text


def test_cp_attention_reaches_the_plan_and_the_summary(profile: Path, tmp_path: Path) -> None:
    for attention, said in (("ulysses", "Ulysses"), ("all_gather", "all-gathered")):
        out = tmp_path / f"{attention}.json"
        code, text = invoke("plan", str(profile), "--cluster", "a100-80gb:8", "--tp", "2",
                            "--pp", "2", "--dp", "1", "--cp", "2", "--heads", "4",
                            "--cp-attention", attention, "--batch-size", "16",
                            "--time-limit", "2", "--out", str(out))
        assert code == 0, text
        plan = Plan.load(out)
        assert (plan.cp, plan.cp_attention) == (2, attention)
        assert said in text
    # 6 heads: tp 2 x cp 2 does not divide them
    code, text = invoke("plan", str(profile), "--cluster", "a100-80gb:8", "--tp", "2", "--cp",
                        "2", "--heads", "6", "--cp-attention", "ulysses", "--out",
                        str(tmp_path / "p.json"))
    assert code == 2 and "Traceback" not in text and "no allowed tp and cp divide" in text, text
    code, text = invoke("plan", str(profile), "--cluster", "a100-80gb:8", "--cp", "2",
                        "--cp-attention", "ring", "--out", str(tmp_path / "p.json"))
    assert code == 2 and "cp_attention='ring'" in text, text
