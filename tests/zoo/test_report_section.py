"""The zoo's counts per family, as run.py sums them and report.py shows them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from benchmarks.zoo.run import summarize

ROOT = Path(__file__).resolve().parents[2]


def _record(family: str, failed_at: str | None, four: bool = True) -> dict[str, object]:
    steps = ["eager", "export", "compile_2", "match_2"] + (["compile_4", "match_4"] if four else [])
    done = steps if failed_at is None else steps[:steps.index(failed_at)]
    rec: dict[str, object] = {"family": family, "model_type": f"{family}-{failed_at}"}
    rec.update(dict.fromkeys(done, True))
    if failed_at is not None:
        rec["failed_at"] = failed_at
        if failed_at.startswith("match"):
            rec[failed_at] = False
    return rec


def test_summary_counts_each_step_and_the_report_shows_them(tmp_path: Path) -> None:
    records = [_record("causal_lm", None), _record("causal_lm", "export"),
               _record("causal_lm", "match_4"), _record("image_classification", None, four=False),
               _record("image_classification", "eager")]
    summary = summarize(records)
    assert summary["per_family"]["causal_lm"] == {
        "tried": 3, "eager_ok": 3, "export_ok": 2, "compile_ok": 2, "match_ok": 1,
        "four_stages": 2}
    assert summary["total"]["tried"] == 5 and summary["total"]["match_ok"] == 2
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "results.json").write_text(json.dumps({
        "machine": "x86_64, 2 cores", "python": "3.11", "torch": "2", "transformers": "5",
        "batch": 4, "microbatches": 2, "tolerance": 1e-5, "summary": summary,
        "not_run": ["a"], "models": records}))
    spec = importlib.util.spec_from_file_location("benchmark_report",
                                                  ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    text = "\n".join(report.zoo(tmp_path))
    assert "| causal_lm | 3 | 3 | 2 | 2 | 1 | 2 |" in text
    assert "| total | 5 | 4 | 3 | 3 | 2 | 2 |" in text
    assert "1 model types not run" in text
