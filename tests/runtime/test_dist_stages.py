"""The stage modules torch's runtime drives: what a split backward may do to their outputs."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from autopart.runtime.distributed._stages import P2PStage


class _PassesAMaskOn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), mask.view(-1)  # the mask leaves as a view of the stage's input


def test_a_split_stage_sends_outputs_torchs_input_gradient_can_detach_in_place() -> None:
    """torch's ``stage_backward_input`` detaches every stage output in place once ``I`` ran,
    which a view refuses ("Can't detach views in-place"): seen on a GPT-2 mask under ZB-V.
    Outputs without a gradient go out detached, those with one as copies."""
    graph = fx.symbolic_trace(_PassesAMaskOn())
    x, mask = torch.randn(2, 4, requires_grad=True), torch.ones(2, 4, dtype=torch.bool)
    for split in (True, False):
        out, sent_mask = P2PStage(graph, graph, split_backward=split)(x, mask)
        assert out.requires_grad and not sent_mask.requires_grad
        assert torch.equal(sent_mask, mask.view(-1))
        if split:
            out.detach_()
            sent_mask.detach_()  # what torch's I does to every output
        else:  # one whole backward: nothing is detached, the view may stay a view
            assert sent_mask.data_ptr() == mask.data_ptr()
