"""Local executor: runs a schedule's actions in one process, each stage on its own device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autopart.schedule import Action, Schedule, execution_order

__all__ = ["LocalExecutor", "StepResult"]

# loss_closure(mb_index, flat_outputs_of_last_stage) -> scalar loss already scaled by 1/m
LossClosure = Callable[[int, tuple[Any, ...]], torch.Tensor]


class StepResult:
    """What one run of a schedule produced.

    Attributes:
        outputs: per microbatch, the last stage's flat outputs (detached), in mb order.
        losses: per microbatch, the scaled loss (training only), detached.
        max_live_activations: per stage, the most microbatches whose forward state was held
            at once (what the schedule's memory model predicts: m for GPipe).
    """

    def __init__(self, num_microbatches: int, num_stages: int) -> None:
        self.outputs: list[tuple[Any, ...]] = [() for _ in range(num_microbatches)]
        self.losses: list[torch.Tensor | None] = [None] * num_microbatches
        self.max_live_activations = [0] * num_stages


def _detach_for(value: Any, device: torch.device, requires_grad: bool) -> Any:
    """The receiving stage's copy of a sent value: on its device, a fresh autograd leaf."""
    if not isinstance(value, torch.Tensor):
        return value
    moved = value.detach().to(device, non_blocking=True)
    if requires_grad and value.requires_grad and moved.is_floating_point():
        moved.requires_grad_(True)
    return moved


class LocalExecutor:
    """Runs F and B actions of a schedule on stage modules held in this process.

    Each forward runs under autograd (training) with its inputs as fresh leaves, so the
    backward of stage ``s`` stops at its inputs and their ``.grad`` is what stage ``s - 1``
    receives as output gradients. A stage's saved activations are dropped as soon as its
    backward for that microbatch has run. On CPU the actions run one after another in the
    order :func:`autopart.schedule.execution_order` gives.

    Args:
        stages: stage modules; stage ``s`` takes the values stage ``s - 1`` returns.
        devices: device of each stage.
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        if len(stages) != len(devices):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices")
        self.stages = list(stages)
        self.devices = list(devices)

    def run(self, schedule: Schedule, mb_inputs: list[list[Any]], *,
            loss_closure: LossClosure | None = None) -> StepResult:
        """Run every action of ``schedule``.

        Args:
            schedule: per-rank action lists (one stage per rank).
            mb_inputs: per microbatch, the flat inputs of stage 0.
            loss_closure: training when given: called on the last stage's outputs of each
                microbatch; the backward starts from the loss it returns.

        Returns:
            The outputs, losses and live-activation counts (see :class:`StepResult`).
        """
        num_stages = len(self.stages)
        m = len(mb_inputs)
        training = loss_closure is not None
        result = StepResult(m, num_stages)
        # inputs[(s, i)]: stage s's input leaves for microbatch i (kept for backward)
        inputs: dict[tuple[int, int], list[Any]] = {}
        # outputs[(s, i)]: stage s's outputs for microbatch i, until the next stage's F
        # (inference) or its own B (training) has consumed them
        outputs: dict[tuple[int, int], tuple[Any, ...]] = {}
        # grads[(s, i)]: gradients w.r.t. stage s's outputs, sent back by stage s + 1
        grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        live = [0] * num_stages
        for action in execution_order(schedule, num_stages):
            s, i = action.stage_index, action.mb_index
            if action.kind == "F":
                self._forward(s, i, mb_inputs, inputs, outputs, training)
                if training:
                    live[s] += 1
                    result.max_live_activations[s] = max(result.max_live_activations[s], live[s])
                if s == num_stages - 1:
                    result.outputs[i] = tuple(o.detach() if isinstance(o, torch.Tensor) else o
                                              for o in outputs[(s, i)])
                    if loss_closure is not None:
                        loss = loss_closure(i, outputs[(s, i)])
                        result.losses[i] = loss
                if not training and s > 0:
                    outputs.pop((s - 1, i), None)
                    inputs.pop((s, i), None)
            elif action.kind == "B":
                self._backward(action, result, inputs, outputs, grads)
                live[s] -= 1
            else:
                raise NotImplementedError(f"action kind {action.kind} ({action}) needs the "
                                          "zero-bubble runtime, which this version lacks")
        result.losses = [None if loss is None else loss.detach() for loss in result.losses]
        return result

    def _forward(self, s: int, i: int, mb_inputs: list[list[Any]],
                 inputs: dict[tuple[int, int], list[Any]],
                 outputs: dict[tuple[int, int], tuple[Any, ...]], training: bool) -> None:
        device = self.devices[s]
        if s == 0:
            args = [_detach_for(v, device, requires_grad=False) for v in mb_inputs[i]]
        else:
            args = [_detach_for(v, device, training) for v in outputs[(s - 1, i)]]
        inputs[(s, i)] = args
        with torch.set_grad_enabled(training):
            out = self.stages[s](*args)
        outputs[(s, i)] = tuple(out)

    def _backward(self, action: Action, result: StepResult,
                  inputs: dict[tuple[int, int], list[Any]],
                  outputs: dict[tuple[int, int], tuple[Any, ...]],
                  grads: dict[tuple[int, int], list[torch.Tensor | None]]) -> None:
        s, i = action.stage_index, action.mb_index
        last = s == len(self.stages) - 1
        outs = outputs.pop((s, i))
        if last:
            loss = result.losses[i]
            assert loss is not None, "loss is computed in the last stage's forward"
            tensors, grad_tensors = [loss], [None]
        else:
            pairs = [(o, g) for o, g in zip(outs, grads.pop((s, i)), strict=True)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            tensors = [o for o, _ in pairs]
            grad_tensors = [g for _, g in pairs]
        if tensors:
            torch.autograd.backward(tensors, grad_tensors)
        args = inputs.pop((s, i))
        if s > 0:
            prev = self.devices[s - 1]
            grads[(s - 1, i)] = [a.grad.to(prev, non_blocking=True)
                                 if isinstance(a, torch.Tensor) and a.grad is not None else None
                                 for a in args]
        del outs, args
