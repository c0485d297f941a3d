"""PipelinedModule.clip_grad_norm_ equals clip_grad_norm_ on the plain model (one process)."""

from __future__ import annotations

import copy

import pytest
import torch

import autopart
from autopart.core.capture import capture
from tests.plans import even_positions, manual_plan
from tests.zoo import gpt2, tied_mlp


@pytest.mark.parametrize("build", [gpt2, tied_mlp], ids=["gpt2", "tied_mlp"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_the_norm_and_clipped_gradients_are_the_plain_models(build, norm_type: float) -> None:
    reference, args, target, loss_fn = build()
    model = copy.deepcopy(reference)
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, 3), 2, 8, schedule_kind="1f1b")
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, devices=["cpu"] * 3)
    pipe.train_step(*args, target=target)
    loss_fn(reference(*args), target).backward()
    full = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float(full) / 10,
                                              norm_type=norm_type)
    norm = pipe.clip_grad_norm_(float(full) / 10, norm_type=norm_type)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-5, atol=1e-7)
