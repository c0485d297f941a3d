"""CUDA graphs of each stage's forward and backward at the step's fixed microbatch shape, replayed."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["StageGraphs", "graph_refusal"]


def graph_refusal(stage: nn.Module, device: torch.device, *, recompute: bool,
                  splits_backward: bool) -> str | None:
    """Why ``stage`` cannot be captured as a CUDA graph, or None when it can be tried.

    What is known before a capture: the device, the actions the executor runs for the stage
    and RNG that names its own generator. What only a capture shows (a host sync such as
    ``.item()``, a data-dependent shape, an op CUDA graphs do not support) comes out of
    :meth:`StageGraphs.capture` as the capture's own error.

    Args:
        stage: the stage module (an ``fx.GraphModule`` from codegen, or any module).
        device: the stage's device.
        recompute: the stage recomputes its forward in backward (``torch.utils.checkpoint``,
            either recompute policy).
        splits_backward: the schedule runs the stage's backward as ``I`` and ``W``.

    Returns:
        A sentence naming the reason, or None.
    """
    if device.type != "cuda":
        return f"not CUDA: the stage runs on {device}; CUDA graphs replay CUDA kernels only"
    if recompute:
        return ("recompute: torch.utils.checkpoint re-runs the forward (all of it, or under the "
                "selective policy what it does not keep) inside the backward, outside any "
                "captured graph")
    if splits_backward:
        return ("split backward (I and W actions): torch.cuda.make_graphed_callables captures "
                "one backward that computes input and weight gradients together")
    graph = getattr(stage, "graph", None)
    for node in getattr(graph, "nodes", ()):
        if node.kwargs.get("generator") is not None:
            return (f"RNG with its own generator at node {node.name}: only the default CUDA "
                    "generator is registered with a graph (graph-safe)")
    return None


class _Slot(nn.Module):
    """One captured copy of a stage: ``make_graphed_callables`` replaces this wrapper's
    ``forward``, not the stage's, and its saved activations live in this copy's own pool."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.stage(*args))


def _signature(args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad)
                 if isinstance(a, torch.Tensor) else ("value", repr(a)) for a in args)


class StageGraphs:
    """Per stage, CUDA graphs of its training forward and backward, replayed by the executor.

    The first training step runs eagerly and records each stage's input signature (shapes,
    dtypes, ``requires_grad``) and how many microbatches it held at once (k, the
    schedule's in-flight count). :meth:`capture` then records k copies of the stage with
    :func:`torch.cuda.make_graphed_callables`, each with its own memory pool: a copy's saved
    activations stay put from its ``F`` to its ``B``, so a microbatch takes a free copy at
    ``F`` and gives it back after ``B``. Outputs and input gradients are cloned out of the
    graphs' static buffers before another stage reads them. RNG ops use the default CUDA
    generator, which a capture registers (graph-safe), so dropout draws differ from an eager
    step's. A stage that cannot be graphed runs eagerly; the reason is printed once per stage
    and kept in :attr:`reasons`.

    Args:
        stages: the stage modules, in stage order.
        devices: the device of each stage.
        recompute: indices of stages that recompute their forward.
        split: indices of stages whose backward the schedule splits into I and W.
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device],
                 recompute: Sequence[int] = (), split: Sequence[int] = ()) -> None:
        self.stages = list(stages)
        self.devices = list(devices)
        self.reasons: dict[int, str] = {}
        for s, (stage, device) in enumerate(zip(self.stages, self.devices, strict=True)):
            why = graph_refusal(stage, device, recompute=s in recompute,
                                splits_backward=s in split)
            if why is not None:
                self._refuse(s, why)
        self.captured = False
        self._seen: dict[int, tuple[Any, ...]] = {}
        self._slots: dict[int, list[_Slot]] = {}
        self._free: dict[int, list[int]] = {}
        self._taken: dict[tuple[int, int], int] = {}

    def _refuse(self, s: int, why: str) -> None:
        if s not in self.reasons:
            self.reasons[s] = why
            print(f"autopart: stage {s} runs eagerly, not as a CUDA graph: {why}", file=sys.stderr)

    def graphed(self) -> list[int]:
        """The stages that replay graphs."""
        return sorted(self._slots)

    def forward(self, s: int, i: int, args: Sequence[Any]) -> tuple[Any, ...]:
        """Stage ``s``'s training forward of microbatch ``i``: a graph replay when one was
        captured for these inputs and a copy is free, else the eager stage."""
        sig = _signature(args)
        if not self.captured:
            self._seen.setdefault(s, sig)
            return tuple(self.stages[s](*args))
        if s not in self._slots:
            return tuple(self.stages[s](*args))
        if sig != self._seen[s]:
            self._refuse_call(s, f"inputs {sig} differ from the captured {self._seen[s]}")
            return tuple(self.stages[s](*args))
        if not self._free[s]:
            self._refuse_call(s, f"more than {len(self._slots[s])} microbatches in flight")
            return tuple(self.stages[s](*args))
        slot = self._free[s].pop()
        self._taken[(s, i)] = slot
        outs = self._slots[s][slot](*args)
        # the graph writes the same output buffers on its next replay: clone what leaves it
        return tuple(o.clone() for o in outs)

    def _refuse_call(self, s: int, why: str) -> None:
        key = -1 - s  # one message per stage for call-time fallbacks
        if key not in self.reasons:
            self.reasons[key] = why
            print(f"autopart: stage {s} ran eagerly for a call: {why}", file=sys.stderr)

    def begin_step(self, training: bool) -> None:
        """Every graph copy free (a step that raised may have left some taken); in training,
        every graphed stage's parameter given a ``.grad`` (zeros where it had none).

        A graph's backward returns its static gradient buffers; autograd accumulates them
        into an existing ``.grad`` in place, but would keep the buffer itself as a missing
        ``.grad`` (it steals a gradient nobody else references), and the next microbatch's
        replay would then overwrite the sum.
        """
        self._taken.clear()
        for s, slots in self._slots.items():
            self._free[s] = list(range(len(slots)))
            if training:
                with torch.no_grad():
                    for p in self.stages[s].parameters():
                        if p.requires_grad and p.grad is None:
                            p.grad = torch.zeros_like(p)

    def release(self, s: int, i: int) -> bool:
        """Stage ``s``'s backward of microbatch ``i`` ran: its graph copy is free again.

        Returns:
            Whether that forward and backward were a replay (then the input gradients are
            the graph's static buffers, which the caller must copy before another replay).
        """
        slot = self._taken.pop((s, i), None)
        if slot is not None:
            self._free[s].append(slot)
        return slot is not None

    def capture(self, in_flight: Sequence[int]) -> None:
        """Capture every stage not refused, after an eager step recorded its inputs.

        Args:
            in_flight: per stage, the most microbatches it held at once in that step (the
                number of graph copies to capture).
        """
        self.captured = True
        for s, stage in enumerate(self.stages):
            if s in self.reasons:
                continue
            sig = self._seen.get(s)
            if sig is None or any(k == "value" for k, *_ in sig):
                self._refuse(s, "its inputs are not all tensors (or no training step ran it)")
                continue
            try:
                self._slots[s] = [self._capture_one(stage, sig) for _ in range(max(1, in_flight[s]))]
            except Exception as exc:  # noqa: BLE001 - any capture failure falls back, said once
                self._slots.pop(s, None)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self._refuse(s, f"the capture failed ({type(exc).__name__}: {first}); host syncs "
                             "(.item(), printing a tensor), data-dependent shapes and CPU work "
                             "cannot be captured")
                continue
            self._free[s] = list(range(len(self._slots[s])))

    @staticmethod
    def _capture_one(stage: nn.Module, sig: tuple[Any, ...]) -> _Slot:
        samples = []
        for shape, dtype, device, requires_grad in sig:
            if dtype.is_floating_point:
                t = torch.randn(shape, dtype=dtype, device=device)
            else:
                t = torch.zeros(shape, dtype=dtype, device=device)
            samples.append(t.requires_grad_(requires_grad))
        slot = _Slot(stage)
        torch.cuda.synchronize(samples[0].device if samples else None)
        graphed = torch.cuda.make_graphed_callables(slot, tuple(samples), allow_unused_input=True)
        assert isinstance(graphed, _Slot)
        return graphed
