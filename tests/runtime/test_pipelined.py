import copy
from typing import Any

import pytest
import torch

import autopart
from autopart.core.capture import capture
from autopart.core.errors import PlanError
from autopart.core.microbatch import split_leaves
from tests.plans import even_positions, manual_plan
from tests.zoo import gpt2, mlp


def _pipe(build: Any, num_stages: int, m: int, **kw: Any) -> tuple[Any, ...]:
    model, args, target, loss_fn = build()
    reference = copy.deepcopy(model)
    captured = capture(model, tuple(split_leaves(list(args), m)[0]))
    plan = manual_plan(captured, even_positions(captured, num_stages), m, args[0].shape[0])
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, **kw)
    return pipe, reference, args, target, loss_fn


def test_state_dict_has_the_model_keys_and_values() -> None:
    pipe, reference, *_ = _pipe(gpt2, 3, 2)
    ours, theirs = pipe.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)  # tied names (lm_head.weight) included, same order
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in reference.named_parameters()]


def test_load_state_dict_reaches_owners_and_replicas() -> None:
    pipe, reference, args, *_ = _pipe(gpt2, 3, 2)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01)
    pipe.load_state_dict(reference.state_dict())
    torch.testing.assert_close(pipe(*args).logits, reference(*args).logits, rtol=1e-5, atol=4e-5)
    bad = reference.state_dict()
    bad.pop("transformer.ln_f.bias")
    bad["extra"] = torch.zeros(1)
    with pytest.raises(PlanError, match=r"missing \['transformer.ln_f.bias'\], unexpected \['extra'\]"):
        pipe.load_state_dict(bad)


def test_tied_weights_stay_equal_to_the_plain_model_over_three_adamw_steps() -> None:
    pipe, reference, args, target, loss_fn = _pipe(gpt2, 4, 4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.train_step(*args, target=target)
        ref_loss = loss_fn(reference(*args), target)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=4e-5)
        opt.step()
        ref_opt.step()
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=4e-5, msg=name)
    # the replica in the last stage follows the owner's optimizer updates (refreshed lazily,
    # before the next forward): the pipelined logits still equal the plain model's
    torch.testing.assert_close(pipe(*args).logits, reference(*args).logits, rtol=1e-5, atol=4e-5)
    placement = pipe._placement
    last = placement.replicas["transformer.wte.weight"][-1]
    torch.testing.assert_close(placement.tensors[(last, "transformer.wte.weight")],
                               ref_params["transformer.wte.weight"], rtol=1e-5, atol=4e-5)


def test_any_multiple_of_the_microbatch_size_runs() -> None:
    pipe, reference, args, *_ = _pipe(mlp, 2, 4)  # microbatch size 2
    x = torch.randn(6, 32)
    torch.testing.assert_close(pipe(x), reference(x), rtol=1e-5, atol=4e-5)


def test_bad_calls_say_what_to_do() -> None:
    pipe, _, args, target, _ = _pipe(mlp, 2, 4)
    with pytest.raises(PlanError, match="not a multiple of the microbatch size 2"):
        pipe(torch.randn(5, 32))
    with pytest.raises(PlanError, match=r"compiled for \(k\*2, 32\)"):
        pipe(torch.randn(4, 31))
    with pytest.raises(PlanError, match="structure"):
        pipe(args[0], args[0])
    model, margs, _, _ = mlp()
    captured = capture(model, margs)
    plan = manual_plan(captured, even_positions(captured, 2), 1, 8)
    inference_only = autopart.compile(model, margs, plan=plan)
    with pytest.raises(PlanError, match="pass loss_fn="):
        inference_only.train_step(*margs, target=target)


def test_a_plan_for_another_model_is_refused() -> None:
    model, args, _, loss_fn = mlp()
    captured = capture(model, args)
    plan = manual_plan(captured, even_positions(captured, 2), 1, 8)
    other = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))
    with pytest.raises(PlanError, match="a different model or config"):
        autopart.compile(other, args, loss_fn=loss_fn, plan=plan)
    with pytest.raises(PlanError, match="made for batch 8"):
        autopart.compile(model, (args[0][:4],), loss_fn=loss_fn, plan=plan)
    with pytest.raises(PlanError, match="2 ranks but 3 devices"):
        autopart.compile(model, args, loss_fn=loss_fn, plan=plan, devices=["cpu"] * 3)


def test_stage_sources_are_written_next_to_the_plan(tmp_path: Any) -> None:
    pipe, *_ = _pipe(mlp, 2, 1)
    written = pipe.save_plan(tmp_path / "mlp.plan.json")
    assert [p.name for p in written] == ["mlp.plan.json", "stage_0.py", "stage_1.py"]
    source = (tmp_path / "stage_1.py").read_text()
    assert "class Stage1" in source and "f32[8, 32]" in source  # shapes as comments
    assert autopart.Plan.load(written[0]) == pipe.plan


@pytest.mark.parametrize(("fixed", "measured"), [
    ({}, True),  # the solver may pick zero_bubble: the split is priced
    ({"schedule": "zero_bubble"}, True),
    ({"schedule": "1f1b"}, False),  # the splitting kinds ruled out: nothing to price
    ({"stages_per_rank": 2}, True),  # zbv and dualpipev run two stages per rank and split
    ({"stages_per_rank": 2, "schedule": "interleaved_1f1b"}, False),
])
def test_split_cost_is_measured_only_where_a_splitting_schedule_can_be_chosen(
        fixed: dict[str, Any], measured: bool) -> None:
    model, args, _, loss_fn = mlp()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, devices=["cpu", "cpu"],
                            num_microbatches=2, time_limit_s=2.0, **fixed)
    assert ("split_cost_s" in pipe.timings_s) == measured
    for key in ("capture_s", "profile_s", "solve_s", "codegen_s"):
        assert key in pipe.timings_s
    if "schedule" in fixed:
        assert pipe.plan.schedule_kind == fixed["schedule"]
    if "stages_per_rank" in fixed:
        assert pipe.plan.stages_per_rank == fixed["stages_per_rank"]
