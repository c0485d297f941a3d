"""train_step(grad_scaler=...) in the one-process runtime: scaled gradients, unscale, clipping,
the optimizer step and the scale update equal torch's AMP recipe on the plain model; an
overflow in one stage skips the step on every stage (float32 weights; fp16 autocast too)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import autopart
from autopart.core.capture import capture
from autopart.core.errors import PlanError
from tests.plans import even_positions, manual_plan
from tests.zoo import gpt2, mlp

SCALE = 2.0 ** 10
TOL = {"rtol": 1e-5, "atol": 4e-5}
# fp16 keeps 11 significant bits: one rounding is off by up to 2**-11 relative. Microbatches
# change which fp16 products are rounded and summed (as for bf16 in tests/precision.py), so a
# weight gradient may differ by a few units of 2**-11 (seen: 3.6e-4 on GPT-2's biases); we
# allow 4 * 2**-11 ~ 2e-3 relative (Frobenius) per gradient and 2**-9 on the loss
# (cross_entropy runs in float32 under autocast; its logits are fp16). A real bug (a stage
# not scaled, a microbatch missing, a gradient unscaled twice) is off by a factor of 2 or more.
FP16_GRAD_TOL = 4 * 2.0 ** -11
FP16_LOSS_TOL = 2.0 ** -9


def _pipeline(build: Any, kind: str, device: str = "cpu") -> tuple[Any, ...]:
    """``(reference, pipe, args, target, loss_fn)``: the model and its 2-stage pipeline on a
    fixed 2-microbatch plan of ``kind``, both on ``device``."""
    model, args, target, loss_fn = build()
    model = model.to(device)
    args, target = tuple(a.to(device) for a in args), target.to(device)
    reference = copy.deepcopy(model)
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, 2), 2, 8, schedule_kind=kind)
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, devices=[device] * 2)
    return reference, pipe, args, target, loss_fn


def _scalers(device: str, **kwargs: Any) -> tuple[torch.amp.GradScaler, torch.amp.GradScaler]:
    return tuple(torch.amp.GradScaler(device, **kwargs) for _ in range(2))  # type: ignore[return-value]


def _amp_recipe_matches(build: Any, kind: str, device: str) -> None:
    """One step of torch's AMP recipe (scale, unscale_, clip, step, update) on the pipeline
    and on the plain model: equal scaled and unscaled gradients, norm, parameters, scale."""
    reference, pipe, args, target, loss_fn = _pipeline(build, kind, device)
    scaler, ref_scaler = _scalers(device, init_scale=SCALE, growth_interval=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss = pipe.train_step(*args, target=target, grad_scaler=scaler)
    ref_loss = loss_fn(reference(*args), target)
    ref_scaler.scale(ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)  # unscaled
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():  # scaled: SCALE x the plain gradients
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=TOL["rtol"],
                                   atol=TOL["atol"] * SCALE, msg=name)
    scaler.unscale_(opt)
    ref_scaler.unscale_(ref_opt)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, **TOL, msg=name)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.testing.assert_close(pipe.clip_grad_norm_(0.5), ref_norm, **TOL)
    scaler.step(opt)
    ref_scaler.step(ref_opt)
    scaler.update()
    ref_scaler.update()
    assert scaler.get_scale() == ref_scaler.get_scale() == 2 * SCALE  # stepped, then grew
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref[name], **TOL, msg=name)


@pytest.mark.parametrize("kind", ["1f1b", "zero_bubble"])
def test_the_amp_recipe_equals_the_plain_models(kind: str) -> None:
    _amp_recipe_matches(gpt2, kind, "cpu")


def test_an_overflow_in_one_stage_skips_the_step_on_every_stage() -> None:
    _, pipe, args, target, _ = _pipeline(mlp, "1f1b")
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    first = next(pipe.stages[0].parameters())
    # an overflow in the first stage's backward only: the last stage's gradients stay finite
    hook = first.register_hook(lambda g: torch.full_like(g, float("inf")))
    pipe.train_step(*args, target=target, grad_scaler=scaler)
    hook.remove()
    last = list(pipe.stages[1].parameters())
    assert last and all(bool(torch.isfinite(p.grad).all()) for p in last)
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == SCALE / 2  # backed off
    for name, p in pipe.named_parameters():
        assert torch.equal(p, before[name]), name  # no stage stepped
    opt.zero_grad()
    pipe.train_step(*args, target=target, grad_scaler=scaler)  # no overflow: it steps
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == SCALE / 2
    assert all(not torch.equal(p, before[n]) for n, p in pipe.named_parameters())


def test_a_disabled_scaler_changes_nothing_and_a_wrong_one_is_refused() -> None:
    _, pipe, args, target, _ = _pipeline(mlp, "1f1b")
    loss = pipe.train_step(*args, target=target)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.zero_grad()
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert torch.equal(pipe.train_step(*args, target=target, grad_scaler=off), loss)
    for name, p in pipe.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    with pytest.raises(PlanError, match="torch.amp.GradScaler"):
        pipe.train_step(*args, target=target, grad_scaler=2.0 ** 16)


def _fp16_autocast_matches(device: str) -> None:
    """GPT-2 under fp16 autocast with float32 weights (torch's AMP recipe), pipeline vs plain
    model run the same way, within fp16 rounding (see FP16_GRAD_TOL)."""
    reference, pipe, args, target, loss_fn = _pipeline(gpt2, "1f1b", device)
    scaler, ref_scaler = _scalers(device, init_scale=2.0 ** 12)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with torch.autocast(device, dtype=torch.float16):
        loss = pipe.train_step(*args, target=target, grad_scaler=scaler)
        out = reference(*args)
        ref_loss = loss_fn(out, target)
    assert out.logits.dtype == torch.float16  # autocast ran in fp16
    ref_scaler.scale(ref_loss).backward()
    ref_value = float(ref_loss.detach())
    assert abs(float(loss) - ref_value) <= FP16_LOSS_TOL * abs(ref_value), (float(loss), ref_value)
    scaler.unscale_(opt)
    ref_scaler.unscale_(ref_opt)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        g, r = p.grad, ref[name].grad
        err = float((g - r).norm() / r.norm().clamp_min(1e-30))
        assert err <= FP16_GRAD_TOL, f"{name}: relative gradient error {err:.2e}"
    scaler.step(opt)
    ref_scaler.step(ref_opt)
    scaler.update()
    ref_scaler.update()
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** 12  # both stepped


def test_fp16_autocast_with_loss_scaling_matches_the_plain_model() -> None:
    _fp16_autocast_matches("cpu")


@pytest.mark.requires_cuda
def test_the_amp_recipe_on_cuda() -> None:
    _amp_recipe_matches(gpt2, "1f1b", "cuda")
    _fp16_autocast_matches("cuda")
