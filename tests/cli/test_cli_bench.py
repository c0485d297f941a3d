"""`autopart bench` on a tiny model: real ranks, a report with its figures."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopart.apps.cli import app


@pytest.mark.slow
def test_bench_writes_a_report_with_every_arm_and_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(app, [
        "bench", "hf:GPT2LMHeadModel", "--config", "n_layer=2", "--config", "n_embd=32",
        "--config", "n_head=2", "--config", "vocab_size=256", "--config", "n_positions=16",
        "--batch-size", "4", "--seq-len", "16", "--ranks", "2", "--steps", "2",
        "--num-microbatches", "2", "--schedule", "1f1b", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    for arm in ("one process", "| autopart |", "| uniform_layers |"):
        assert arm in text, text
    # GPT-2's tied embedding on both ranks: each sums its gradient after the schedule, a
    # collective predicted and traced on both
    assert "| pipeline rank | exposed predicted ms | exposed measured ms |" in text, text
    rows = [line for line in text.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert len(rows) == 2 and all(float(row.split("|")[3]) > 0 for row in rows), rows
    for png in ("timeline.png", "stages.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "plan.json").exists() and (out / "stage_0.py").exists()


def test_bench_refuses_a_malformed_model_spec() -> None:
    result = CliRunner().invoke(app, ["bench", "no-colon-here"])
    assert result.exit_code == 2
    assert "valid forms are hf:<class> or file.py:function" in result.output
