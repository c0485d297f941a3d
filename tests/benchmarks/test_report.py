"""The benchmark report reads the recorded results and says what is missing."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_report", BENCHMARKS / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_quotes_the_recorded_results(tmp_path: Path) -> None:
    out = _report().write_report(BENCHMARKS, tmp_path / "REPORT.md")
    text = out.read_text()
    recorded = json.loads((BENCHMARKS / "pipeline_cpu" / "results.json").read_text())
    autopart = recorded["autopart"]
    assert f"{autopart['step_s']:.3f} ({autopart['fraction_of_ideal']:.3f} of ideal)" in text
    ratio = recorded["torch_1f1b"]["time_over_autopart"]["median"]
    assert f"{ratio:.3f}x autopart" in text
    quality = json.loads((BENCHMARKS / "plan_quality" / "results.json").read_text())
    gpt2 = quality["models"]["gpt2-small"]["speed"][0]
    assert f"| gpt2-small | {gpt2['ranks']} | {gpt2['predicted_step_time_us'] / 1e3:.2f} |" in text
    for png in ("pipeline_cpu.png", "plan_quality.png"):
        assert (tmp_path / "figures" / png).read_bytes()[:4] == b"\x89PNG"
    peers = BENCHMARKS / "pipeline_cpu" / "results_peers.json"
    if peers.exists():  # recorded by peers.py on a machine with DeepSpeed
        for name, wl in json.loads(peers.read_text())["workloads"].items():
            assert f"### {name}" in text
            assert f"| autopart | {wl['summary']['autopart']['step_s']:.3f} |" in text
        assert (tmp_path / "figures" / "peers.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "No recorded results (`benchmarks/pipeline_cpu/peers.py`)" in text
        text = text.replace("No recorded results (`benchmarks/pipeline_cpu/peers.py`)", "")
    assert "No recorded results" not in text
    f3d = json.loads((BENCHMARKS / "fidelity_3d" / "results.json").read_text())
    for r in f3d["rows"]:
        assert (f"| {r['world']} | {r['arm']} | {r['tp']} x {r['pp']} x {r['dp']} | {r['m']} | "
                f"{r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | "
                f"{r['error']:+.1%} |") in text
    selective = json.loads((BENCHMARKS / "selective_recompute" / "results.json").read_text())
    for r in selective["rows"]:
        assert (f"| {r['arm']} | {', '.join(r['recompute'])} |" in text
                and f"| {r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} |" in text)
    fsdp = json.loads((BENCHMARKS / "fsdp_table" / "results.json").read_text())
    for r in fsdp["rows"]:
        o = r["overlapped"]
        assert (f"| {r['model']} | {r['local_batch']} | {r['checkpointing']} | "
                f"{r['published_step_s']:.3f} | {o['step_s']:.3f} "
                f"({o['error_vs_published']:+.1%}) |") in text
    early = json.loads((BENCHMARKS / "early_receives" / "results.json").read_text())
    for r in early["rows"]:
        assert f"| {r['ranks']} | {r['arm']} | {r['median_s']['torch']:.4f} |" in text


def test_report_lists_missing_results_and_names_a_broken_file(tmp_path: Path) -> None:
    report = _report()
    results = tmp_path / "results"
    (results / "solver_scale").mkdir(parents=True)
    shutil.copy(BENCHMARKS / "solver_scale" / "results.json", results / "solver_scale")
    text = report.write_report(results, tmp_path / "REPORT.md").read_text()
    # pipeline_cpu, peers, executor_overhead, plan_quality, layout_scale, fidelity,
    # fidelity_3d, overlap_cpu, fsdp_table, selective_recompute, early_receives, gpu, zoo
    assert text.count("No recorded results") == 13
    assert "solver_scale: a 175B-parameter plan" in text

    (results / "plan_quality").mkdir()
    (results / "plan_quality" / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"plan_quality/results.json: not JSON"):
        report.write_report(results, tmp_path / "REPORT.md")
    assert text == (tmp_path / "REPORT.md").read_text()  # the old report is left whole
    assert not list(tmp_path.glob(".REPORT.md.*"))


@pytest.mark.parametrize("probed", [False, True])
def test_fidelity_section_shows_the_machine_speed_when_the_sweep_probed_it(
        tmp_path: Path, probed: bool) -> None:
    row = {"workload": "gpt2", "labels": ["1f1b v1 m8"], "predicted_step_s": 0.70,
           "measured_step_s": 0.75, "step_error": 0.70 / 0.75 - 1,
           "predicted_peak_bytes": [2**20, 2**21], "measured_peak_bytes": [2**20, 2**21]}
    summary = {"plans": 1, "median_abs_step_error": 0.0667, "max_abs_step_error": 0.0667,
               "under_predicted_peaks": 0, "max_peak_over": 0.0}
    if probed:
        row |= {"machine_vs_profile": 1.05, "speed_adjusted_step_error": 0.70 * 1.05 / 0.75 - 1}
        summary |= {"median_abs_speed_adjusted_step_error": 0.02,
                    "max_abs_speed_adjusted_step_error": 0.02}
    (tmp_path / "fidelity").mkdir()
    (tmp_path / "fidelity" / "results.json").write_text(json.dumps({
        "machine": "x86_64, 2 cores", "python": "3.11", "torch": "2.13.0+cpu", "ranks": 2,
        "threads_per_rank": 1, "steps": 7, "date": "2026-11-25", "summary": summary,
        "rows": [row]}))
    text = "\n".join(_report().fidelity(tmp_path, tmp_path))
    assert "| gpt2 | 1f1b v1 m8 | 0.700 | 0.750 | -6.7% |" in text
    assert ("| 1.050 | 1 / 1, 2 / 2 |" in text) == probed
    assert ("median |error| of 2.0%, worst 2.0%" in text) == probed
