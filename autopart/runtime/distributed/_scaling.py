"""Loss scaling across a distributed pipeline's ranks: scaled losses, one overflow verdict."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopart.runtime._torch_private import found_non_finite

__all__ = ["ScaledLosses", "agree_on_overflow"]


class ScaledLosses:
    """One step's losses under a ``GradScaler``: :meth:`scale` gives torch's schedule the
    scaled loss to backpropagate and keeps the unscaled one, by the scaled tensor's id
    (torch also calls the loss function on its shape inference's uninitialised outputs at a
    runtime's first step, so the calls are not one per microbatch).

    Made on every rank at the start of a step: the scaler makes its scale tensor at its first
    ``scale()`` call, which the step makes on the last stage's rank only, and every rank's
    ``unscale_`` and ``step`` need it.

    Args:
        scale_loss: ``GradScaler.scale``.
        device: this rank's device (where the scaler's scale lives when made here).
    """

    def __init__(self, scale_loss: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device) -> None:
        scale_loss(torch.zeros((), device=device))
        self._scale_loss = scale_loss
        self._unscaled: dict[int, torch.Tensor] = {}

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale (the backward starts there); the value is kept."""
        scaled = self._scale_loss(loss)
        self._unscaled[id(scaled)] = loss.detach()
        return scaled

    def unscaled(self, scaled: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The unscaled losses of ``scaled`` (tensors :meth:`scale` returned, still held)."""
        return [self._unscaled[id(x)] for x in scaled]


def agree_on_overflow(params: Iterable[torch.Tensor], device: torch.device,
                      group: dist.ProcessGroup, guarded: Callable[[Callable[[], Any]], Any],
                      ) -> bool:
    """Make every rank's ``GradScaler`` skip a step that overflowed on any rank of ``group``.

    A rank's scaler checks only the gradients of its own optimizer, so each rank finds
    whether any gradient of ``params`` holds an inf or a nan (the check
    ``GradScaler.unscale_`` makes, :func:`autopart.runtime._torch_private.found_non_finite`),
    the flag is all-reduced (MAX) over ``group``, as torch's ``ShardedGradScaler`` does
    inside its ``unscale_``, and a rank whose gradients are finite while another rank's are
    not gets its gradients filled with nan: its scaler then skips ``opt.step()`` and backs
    its scale off like the others' (such a step's gradients are unusable anyway), and a
    plain ``torch.amp.GradScaler`` works unchanged. Collective over ``group``; data-parallel
    replicas need no flag of their own, their gradient all-reduce carries a non-finite
    value to every replica.

    Args:
        params: this rank's parameters; those without a gradient are skipped.
        device: this rank's device (where the flag is reduced).
        group: the pipeline's ranks.
        guarded: runs the all-reduce, turning a failure into the step's error.

    Returns:
        Whether any rank of ``group`` found an inf or a nan.
    """
    held = [p for p in params if p.grad is not None]
    found = found_non_finite([p.grad for p in held if p.grad is not None], device)
    mine = bool(found)
    guarded(lambda: dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group))
    anywhere = bool(found)
    if anywhere and not mine:
        with torch.no_grad():
            for p in held:
                assert p.grad is not None
                if p.grad.is_sparse:
                    p.grad = p.grad * float("nan")
                else:
                    p.grad.fill_(float("nan"))
    return anywhere
