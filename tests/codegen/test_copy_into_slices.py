"""In-place copies into slices of activations train through the stages as in the model.

Functionalisation records ``y[:, :k].copy_(src)`` as ``aten.copy`` (which has no
derivative) + ``slice_scatter``; capture rewrites the copy so backward runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopart
from autopart.core.capture import capture
from tests.numerics import assert_train_step_matches


class SliceWriter(nn.Module):
    """Writes three slices of a zero buffer: a same-shape copy, a broadcast one, a cast one."""

    def __init__(self, width: int = 12, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.row = nn.Parameter(torch.randn(4))
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (batch, 12)
        y = torch.zeros_like(h)
        y[:, :4].copy_(h[:, :4] * 2)  # same shape
        y[:, 4:8].copy_(self.row)  # broadcast over the batch
        y[:, 8:].copy_(h[:, 8:].double().sin())  # float64 source, float32 destination
        for block in self.blocks:
            y = torch.tanh(block(y))
        return self.out(y)


def test_capture_leaves_no_aten_copy() -> None:
    captured = capture(SliceWriter(), (torch.randn(4, 12),))
    targets = {n.target for n in captured.graph_module.graph.nodes}
    assert torch.ops.aten.copy.default not in targets
    assert torch.ops.aten.slice_scatter.default in targets


@pytest.mark.parametrize("num_stages", [2, 3])
def test_slice_copies_train_to_the_models_gradients(num_stages: int) -> None:
    torch.manual_seed(0)
    model = SliceWriter()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, t)

    pipe = autopart.compile(model, (x,), loss_fn=loss_fn, num_stages=num_stages,
                            num_microbatches=2, time_limit_s=5.0)
    assert_train_step_matches(pipe, reference, (x,), y, loss_fn)
    assert float(dict(pipe.named_parameters())["row"].grad.abs().sum()) > 0
