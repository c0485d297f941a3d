"""compile's default recompute policy, "auto": the selective policy's cost measured and a
second solve made only where the full policy's plan recomputes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import autopart
from autopart.core.errors import PlanError
from autopart.core.runtime_model import RuntimeDescription
from autopart.options import CompileOptions
from autopart.planning import solve_auto_recompute

transformers = pytest.importorskip("transformers")


def _gpt2() -> tuple[Any, torch.Tensor, Any]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, use_cache=False)
    x = torch.randint(0, 256, (8, 32))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out[0]
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256),
                                                 target[:, 1:].reshape(-1))
    return transformers.GPT2LMHeadModel(cfg), x, loss_fn


@pytest.fixture(scope="module")
def every() -> Any:
    """GPT-2 compiled onto 2 CPU ranks with every stage recomputing, the policy left open."""
    model, x, loss_fn = _gpt2()
    return autopart.compile(model, (x,), loss_fn=loss_fn, devices=["cpu", "cpu"],
                            recompute=True, num_microbatches=2)


def test_compile_defaults_to_auto_and_measures_only_when_it_recomputes(every: Any) -> None:
    model, x, loss_fn = _gpt2()
    plain = autopart.compile(model, (x,), loss_fn=loss_fn, devices=["cpu", "cpu"],
                             recompute=False, num_microbatches=2)
    assert "selective_cost_s" not in plain.timings_s
    assert plain.plan.recompute_policy == "full"
    assert all(st.recompute for st in every.plan.stages)
    assert every.plan.recompute_policy in ("full", "selective", "op")
    assert "selective_cost_s" in every.timings_s
    assert CompileOptions().solve_recompute_policy() == "auto"
    assert CompileOptions(fuse=True).solve_recompute_policy() == "full"
    with pytest.raises(PlanError, match="fuse=True"):
        CompileOptions(fuse=True, recompute_policy="selective")


def test_solve_auto_recompute_keeps_the_better_plan(every: Any) -> None:
    x = torch.zeros(8, 32, dtype=torch.long)
    # the fixture's plan is the timing-driven choice: under "op" its stages list kept nodes,
    # which a "full" plan cannot carry
    plan = dataclasses.replace(every.plan, recompute_policy="full", stages=tuple(
        dataclasses.replace(st, recompute_kept=()) for st in every.plan.stages))
    faster = dataclasses.replace(plan, recompute_policy="op",
                                 predicted_step_time_us=plan.predicted_step_time_us / 2)
    asked: list[str] = []

    class _Profile:
        runtime = RuntimeDescription(selective_us_per_node=(1.0, 1.0))  # measured already
        timings_s: dict[str, float] = {}

    def solve_with(profile: Any, policy: str) -> Any:
        asked.append(policy)
        return plan if policy == "full" else faster

    got, _ = solve_auto_recompute(_Profile(), solve_with, (x,), None, "speed")  # type: ignore[arg-type]
    assert asked == ["full", "op"] and got is faster
    leaner = dataclasses.replace(
        plan, recompute_policy="op", predicted_step_time_us=plan.predicted_step_time_us * 2,
        ranks=tuple(dataclasses.replace(r, peak_memory_bytes=r.peak_memory_bytes // 2)
                    for r in plan.ranks))
    for optimize, want in (("memory", leaner), ("speed", plan)):
        got, _ = solve_auto_recompute(
            _Profile(), lambda pr, pol: plan if pol == "full" else leaner,  # type: ignore[arg-type]
            (x,), None, optimize)
        assert got is want
    none = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=False)
                                                  for s in plan.stages))
    asked.clear()
    got, _ = solve_auto_recompute(_Profile(), lambda pr, pol: (asked.append(pol), none)[1],
                                  (x,), None, "speed")  # type: ignore[arg-type]
    assert asked == ["full"] and got is none
