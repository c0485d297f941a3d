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


def test_report_lists_missing_results_and_names_a_broken_file(tmp_path: Path) -> None:
    report = _report()
    results = tmp_path / "results"
    (results / "solver_scale").mkdir(parents=True)
    shutil.copy(BENCHMARKS / "solver_scale" / "results.json", results / "solver_scale")
    text = report.write_report(results, tmp_path / "REPORT.md").read_text()
    # pipeline_cpu, peers, executor_overhead, plan_quality, fidelity, gpu, zoo
    assert text.count("No recorded results") == 7
    assert "solver_scale: a 175B-parameter plan" in text

    (results / "plan_quality").mkdir()
    (results / "plan_quality" / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"plan_quality/results.json: not JSON"):
        report.write_report(results, tmp_path / "REPORT.md")
    assert text == (tmp_path / "REPORT.md").read_text()  # the old report is left whole
    assert not list(tmp_path.glob(".REPORT.md.*"))
