"""Outputs that alias: a view of the input, two views of one activation, a transposed
(non-contiguous) activation crossing a cut; values and every gradient as in the model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import autopart
from tests.numerics import assert_train_step_matches


class Aliasing(nn.Module):
    def __init__(self, width: int = 8, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.inp(x).t()  # (width, batch): a transposed activation, read after the cut
        g = h.t()
        for block in self.blocks:
            g = torch.tanh(block(g))
        alias = g.view(g.shape[0], 2, -1)[:, 1]  # a strided view of the output g
        return x[:, :2], g, alias, h.t() * 2  # input view, two aliases, transposed


def _loss(out: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    view_of_input, g, alias, strided = out
    return (g - target).pow(2).mean() + alias.mean() + strided.mean() + view_of_input.mean() * 0


@pytest.mark.parametrize("num_stages", [2, 4])
def test_aliasing_outputs_match_the_model(num_stages: int) -> None:
    torch.manual_seed(0)
    model = Aliasing()
    reference = copy.deepcopy(model)
    x, target = torch.randn(8, 8), torch.randn(8, 8)
    pipe = autopart.compile(model, (x,), loss_fn=_loss, num_stages=num_stages,
                            num_microbatches=2, time_limit_s=5.0)
    got: Any = pipe(x)
    want = reference(x)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert_train_step_matches(pipe, reference, (x,), target, _loss)
