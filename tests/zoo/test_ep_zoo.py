"""The zoo's ep = 2 arm (benchmarks/zoo/ep.py): a MoE model on 2 gloo ranks with its experts
split over the 2 replicas, against the plain model; a dense tiny config recorded as such."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks.zoo.ep import EP_OVERRIDES, experts_of, markdown, run_ep_one  # noqa: E402
from benchmarks.zoo.models import OVERRIDES, entries, tiny_config  # noqa: E402


def _entry(model_type: str):
    return next(e for e in entries() if (e.family, e.model_type) == ("causal_lm", model_type))


def test_qwen2_moe_at_ep2_splits_its_experts_and_matches() -> None:
    rec = run_ep_one(_entry("qwen2_moe"), timeout_s=300)
    assert rec["status"] == "match", rec.get("error") or rec
    # two layers x (gate_up, down) stacked expert tensors split on each rank
    assert (rec["experts"], rec["split"]) == (4, 4)
    assert rec["max_rel_err"] <= 1e-5 and not rec["missing_grads"]


def test_a_tiny_config_without_moe_layers_is_recorded_dense(monkeypatch) -> None:
    # the zoo's 2-layer DeepSeek-V3 keeps its first 3 layers dense: no experts module
    monkeypatch.setitem(OVERRIDES, "deepseek_v3", {**OVERRIDES.get("deepseek_v3", {}),
                                                   "first_k_dense_replace": 3})
    assert experts_of(tiny_config("deepseek_v3")) == 4
    rec = run_ep_one(_entry("deepseek_v3"), timeout_s=300)
    assert rec["status"] == "dense", rec
    assert EP_OVERRIDES["deepseek_v3"] == {"first_k_dense_replace": 0}


def test_results_page_counts_and_reasons() -> None:
    result = {"machine": "m", "python": "3", "torch": "t", "transformers": "x",
              "command": "benchmarks/zoo/ep.py", "wall_s": 1.0, "models": [
                  {"family": "causal_lm", "model_type": "mixtral", "status": "match",
                   "experts": 4, "split": 4, "max_rel_err": 3e-7, "wall_s": 9.0},
                  {"family": "causal_lm", "model_type": "jetmoe", "status": "refused",
                   "experts": 4, "error": "PlanError: no experts module a|b"}]}
    page = markdown(result)
    assert "| match | 1 |" in page and "| refused | 1 |" in page
    assert "| causal_lm | mixtral | 4 | 4 | match | 3.0e-07 | 9.0 |  |" in page
    assert "no experts module a\\|b" in page
