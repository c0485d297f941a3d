"""One training step of a pipeline against the unpartitioned model: loss and every gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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
