"""The plan's ``"selective"`` recompute policy in the one-process runtime: a plan whose every
stage recomputes selectively trains as the unpartitioned model does, and its stages keep
their matmuls' outputs instead of running them again (the distributed runtime's case is in
``tests/distributed/test_selective_recompute_ranks.py``)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import autopart
from autopart.core.capture import capture
from autopart.core.errors import PlanError
from autopart.runtime.distributed._stages import P2PStage
from autopart.runtime.local.executor import LocalExecutor
from tests.numerics import KernelCounts, assert_train_step_matches
from tests.plans import even_positions, local_pipeline, manual_plan
from tests.zoo import ZOO

M = 4  # microbatches; batch 8 -> microbatch 2


_CAPTURED: dict[str, tuple[Any, ...]] = {}


def _pipe(name: str, kind: str, num_stages: int, v: int, policy: str | None, *,
          via_compile: bool = False) -> tuple[Any, ...]:
    """A pipeline of ``ZOO[name]`` built from a hand-written plan whose every stage
    recomputes under ``policy`` (None: no stage recomputes), and an untouched copy of the
    model. Each model is captured once per module and deep-copied per pipeline; built by
    ``autopart.compile(plan=...)`` with ``via_compile``, else as it builds one."""
    if name not in _CAPTURED:
        model, args, target, loss_fn = ZOO[name]()
        _CAPTURED[name] = (model, capture(model, tuple(a[: 8 // M] for a in args)), args,
                           target, loss_fn)
    model0, captured0, args, target, loss_fn = _CAPTURED[name]
    model, captured = copy.deepcopy((model0, captured0))
    plan = manual_plan(captured, even_positions(captured, num_stages), M, 8, schedule_kind=kind,
                       stages_per_rank=v, recompute=policy is not None)
    plan = dataclasses.replace(plan, recompute_policy=policy or "full")
    devices = ["cpu"] * (num_stages // v)
    if via_compile:
        pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, devices=devices)
        assert pipe.plan.recompute_policy == (policy or "full")
    else:
        pipe = local_pipeline(model, captured, plan, devices, loss_fn=loss_fn)
    return pipe, copy.deepcopy(model0), args, target, loss_fn


# (model, schedule kind, total stages, stages per rank): Llama with grouped-query attention
# (2 key-value heads for 4 query heads); zero_bubble's recomputing stages run a whole B
LAYOUTS = [("gpt2", "1f1b", 2, 1), ("llama", "interleaved_1f1b", 4, 2),
           ("bert", "zero_bubble", 2, 1)]


@pytest.mark.parametrize(("name", "kind", "num_stages", "v"), LAYOUTS,
                         ids=[f"{n}-{k}-S{s}-v{v}" for n, k, s, v in LAYOUTS])
def test_selective_recompute_matches_the_unpartitioned_model(name: str, kind: str,
                                                             num_stages: int, v: int) -> None:
    pipe, reference, args, target, loss_fn = _pipe(name, kind, num_stages, v, "selective")
    assert_train_step_matches(pipe, reference, args, target, loss_fn, atol=4e-5)


def test_a_selective_step_runs_the_matmuls_once_and_the_rest_twice() -> None:
    """GPT-2's training step, kernels counted: under ``"selective"`` its Conv1D matmuls
    (``addmm``) run as often as without recompute, its layer norms as often as under
    ``"full"``, which runs both twice. The selective pipeline comes from
    ``autopart.compile(plan=...)``: the plan's policy reaches the executor."""
    counts = {}
    for policy in (None, "full", "selective"):
        pipe, _, args, target, _ = _pipe("gpt2", "1f1b", 2, 1, policy,
                                         via_compile=policy == "selective")
        with KernelCounts() as kernels:
            pipe.train_step(*args, target=target)
        counts[policy] = kernels.count
    none, full, selective = counts[None], counts["full"], counts["selective"]
    assert selective["aten.addmm.default"] == none["aten.addmm.default"] \
        < full["aten.addmm.default"]
    assert none["aten.native_layer_norm.default"] \
        < selective["aten.native_layer_norm.default"] == full["aten.native_layer_norm.default"]


def test_an_unknown_recompute_policy_is_refused_by_both_runtimes() -> None:
    with pytest.raises(PlanError, match="'offload'"):
        LocalExecutor([nn.Identity()], [torch.device("cpu")], recompute=[0],
                      recompute_policy="offload")
    graph = torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(PlanError, match="'offload'"):
        P2PStage(graph, graph, recompute=True, recompute_policy="offload")
