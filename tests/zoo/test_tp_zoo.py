"""The zoo's tp = 2 arm (benchmarks/zoo/tp.py): one model on 2 gloo ranks, sharded as the
solver finds, against the plain model; and its results page."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks.zoo.models import entries  # noqa: E402
from benchmarks.zoo.tp import markdown, run_tp_one  # noqa: E402


def test_bert_at_tp2_runs_its_sibling_pairs_and_matches() -> None:
    entry = next(e for e in entries() if (e.family, e.model_type) == ("masked_lm", "bert"))
    rec = run_tp_one(entry, timeout_s=300)
    assert rec["status"] == "match", rec.get("error") or rec
    # two layers x (attention, MLP) pairs and the tied vocabulary, all in the stage's source
    assert (rec["pairs"], rec["vocab"]) == (4, ["bert.embeddings.word_embeddings.weight"])
    assert rec["collectives"] > 0 and rec["max_rel_err"] <= 1e-5 and not rec["missing_grads"]


def test_results_page_counts_and_reasons() -> None:
    result = {"machine": "m", "python": "3", "torch": "t", "transformers": "x",
              "command": "benchmarks/zoo/tp.py", "wall_s": 1.0, "models": [
                  {"family": "causal_lm", "model_type": "gpt2", "status": "match", "pairs": 4,
                   "vocab": ["w"], "collectives": 12, "max_rel_err": 4e-7, "wall_s": 8.0},
                  {"family": "image_classification", "model_type": "convnext",
                   "status": "no_pairs", "error": "no pairs found", "pairs": 0, "vocab": []},
                  {"family": "seq2seq_lm", "model_type": "t5", "status": "refused",
                   "error": "PlanError: tensor parallelism cannot shard op a|b"}]}
    page = markdown(result)
    assert "| match | 1 |" in page and "| no_pairs | 1 |" in page and "| refused | 1 |" in page
    assert "| causal_lm | gpt2 | 4 | 1 | 12 | match | 4.0e-07 | 8.0 |  |" in page
    assert "no pairs found" in page and "op a\\|b" in page
