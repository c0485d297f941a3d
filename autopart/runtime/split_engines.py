"""How each runtime splits a stage's backward into I and W, for the profiler to time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopart.codegen.split_backward import SplitBackward
from autopart.runtime._torch_private import split_stage_backward

__all__ = ["LocalSplit", "TorchPipeliningSplit"]


class LocalSplit:
    """The one-process executor's split: a :class:`~autopart.codegen.split_backward.SplitBackward`
    built in I (as the executor builds it), its ``weight_grads`` in W; outputs handed on as
    they are."""

    def sent(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return outputs

    def split(self, roots: list[torch.Tensor], grads: list[torch.Tensor],
              inputs: list[torch.Tensor], params: list[torch.nn.Parameter],
              ) -> tuple[Callable[[], Any], Callable[[], Any]]:
        made: list[SplitBackward] = []

        def run_i() -> Any:
            made.append(SplitBackward(roots, grads, inputs, params))
            return made[-1].input_grads()

        return run_i, lambda: made[-1].weight_grads()


class TorchPipeliningSplit:
    """The distributed runtime's split: torch.distributed.pipelining's stages send copies
    of their outputs and run ``stage_backward_input`` in I, ``stage_backward_weight`` in W."""

    def sent(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [o.clone() for o in outputs]

    def split(self, roots: list[torch.Tensor], grads: list[torch.Tensor],
              inputs: list[torch.Tensor], params: list[torch.nn.Parameter],
              ) -> tuple[Callable[[], Any], Callable[[], Any]]:
        return split_stage_backward(roots, grads, inputs, params)
