import copy
import weakref
from typing import Any

import pytest
import torch

import autopart
from autopart.core.capture import capture
from autopart.core.errors import PlanError
from autopart.core.schedule import Action, build_schedule, in_flight_counts
from autopart.runtime.local.executor import LocalExecutor
from tests.numerics import assert_train_step_matches
from tests.plans import even_positions, local_pipeline, manual_plan
from tests.zoo import mlp


@pytest.mark.parametrize(("kind", "v"), [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1),
                                         ("interleaved_1f1b", 2)])
def test_live_activations_never_exceed_the_schedules_in_flight_count(kind: str, v: int) -> None:
    model, args, target, loss_fn = mlp()
    captured = capture(model, (args[0][:1],))
    stages = 4
    plan = manual_plan(captured, even_positions(captured, stages), 8, 8, schedule_kind=kind,
                       stages_per_rank=v)
    pipe = local_pipeline(model, captured, plan, ["cpu"] * (stages // v), loss_fn=loss_fn)
    expected = in_flight_counts(build_schedule(kind, stages // v, 8, v), stages)
    seen = [0] * stages
    outputs: list[weakref.ref[torch.Tensor]] = []
    executor = pipe._executor
    original = executor._forward

    def spy_forward(s: int, i: int, mb_inputs: Any, state: Any, training: bool) -> None:
        original(s, i, mb_inputs, state, training)
        outputs.append(weakref.ref(state[(s, i)].outputs[0]))

    executor._forward = spy_forward  # type: ignore[method-assign]

    def hook(action: Action, live: list[int]) -> None:
        for s in range(stages):
            seen[s] = max(seen[s], live[s])

    mbs = [[x] for x in args[0].chunk(8)]
    targets = target.chunk(8)
    result = executor.run(build_schedule(kind, stages // v, 8, v), mbs,
                          loss_closure=lambda i, out: loss_fn(out[0], targets[i]) / 8,
                          on_action=hook)
    assert seen == expected == result.max_live_activations
    # every stage output was freed once its backward ran, the last stage's too: a training
    # step's result holds no outputs (all m of them had cost m x the logits)
    assert all(ref() is None for ref in outputs)
    assert result.outputs == [()] * 8


def test_zero_bubble_weight_and_input_gradients_sum_to_the_full_backward() -> None:
    model, args, target, loss_fn = mlp()
    captured = capture(model, (args[0][:2],))
    grads = {}
    for kind in ("1f1b", "zero_bubble"):
        m, c = copy.deepcopy((model, captured))
        plan = manual_plan(c, even_positions(c, 2), 4, 8, schedule_kind=kind)
        pipe = local_pipeline(m, c, plan, ["cpu", "cpu"], loss_fn=loss_fn)
        pipe.train_step(*args, target=target)
        grads[kind] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    for name, g in grads["1f1b"].items():
        torch.testing.assert_close(grads["zero_bubble"][name], g, rtol=1e-6, atol=1e-7)


def test_an_invalid_schedule_is_refused_before_running() -> None:
    executor = LocalExecutor([torch.nn.Identity(), torch.nn.Identity()],
                             [torch.device("cpu")] * 2)
    backwards_first = ((Action(0, "B", 0), Action(0, "F", 0)), (Action(1, "F", 0), Action(1, "B", 0)))
    with pytest.raises(PlanError, match="deadlocks"):
        executor.run(backwards_first, [[torch.zeros(1)]], loss_closure=lambda i, o: o[0].sum())


def test_fused_stages_match_within_tolerance() -> None:
    model, args, target, loss_fn = mlp()
    reference = copy.deepcopy(model)
    captured = capture(model, (args[0][:4],))
    plan = manual_plan(captured, even_positions(captured, 2), 2, 8)
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, devices=["cpu", "cpu"],
                            fuse=True)
    assert "fuse_s" in pipe.timings_s
    assert_train_step_matches(pipe, reference, args, target, loss_fn, atol=4e-5)
