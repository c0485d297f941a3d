"""One training step of a pipeline against the unpartitioned model: loss and every gradient;
and the kernels a step dispatches, counted."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class KernelCounts(TorchDispatchMode):
    """While entered, counts every kernel dispatched (``count["aten.addmm.default"]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def assert_train_step_matches(pipe: Any, reference: nn.Module, args: tuple[Any, ...],
                              target: Any, loss_fn: Any, *, atol: float = 1e-6) -> None:
    """Run ``pipe.train_step(*args, target=target)`` and one forward + backward of
    ``reference`` (an untouched copy of the model), then check the loss and every parameter's
    gradient with ``assert_close(rtol=1e-5, atol=atol)`` (float32; STYLE.md's tolerances:
    ``atol`` 1e-6, looser only where kernels differ, e.g. fused stages)."""
    loss = pipe.train_step(*args, target=target)
    ref_loss = loss_fn(reference(*args), target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=atol)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-5, atol=atol, msg=name)
