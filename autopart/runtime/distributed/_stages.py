"""The stage modules torch's pipelining runtime drives: dense point-to-point transfers,
recompute, and each action marked on the heartbeat and timed into a trace."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autopart.codegen.recompute import check_recompute_policy, run_recomputed
from autopart.runtime._torch_private import ZeroIndexStage
from autopart.runtime.distributed._grad_buckets import GradBuckets
from autopart.runtime.distributed.heartbeat import Heartbeat
from autopart.runtime.tracing import ActionRecorder

__all__ = ["P2PStage", "TracedStage", "restride", "side_thread"]

_SIDE = threading.local()


@contextlib.contextmanager
def side_thread() -> Iterator[None]:
    """Mark the calling thread, while inside, as running an action beside the rank's own
    thread (the backward of a DualPipe-V pair overlapped with its forward,
    :func:`autopart.runtime._torch_private.overlap_pairs`): its actions are traced without a
    ``"wait"`` before them and are not marked on the heartbeat, which follows the rank's
    own thread."""
    _SIDE.active = True
    try:
        yield
    finally:
        _SIDE.active = False


class P2PStage(nn.Module):
    """A stage adapted to point-to-point transfer, which moves dense buffers only.

    Outputs are made contiguous before they are sent (a pass-through mask is often an
    ``expand`` view); inputs whose captured layout was strided (a transposed activation)
    are copied back into that layout, because the stage's graph may ``view`` them. A stage
    the plan marks ``recompute`` runs its forward under non-reentrant
    ``torch.utils.checkpoint`` when gradients are on, with the plan's ``recompute_policy``
    (:func:`autopart.codegen.recompute.run_recomputed`): under ``"full"`` only its inputs are
    kept and the backward rebuilds the rest; under ``"selective"`` the outputs of its
    matmuls, attention and tp collectives are kept too, and the backward rebuilds the rest
    of its forward (norms, activations, dropout) without communicating.

    A stage whose backward splits (``split_backward``) sends copies of its outputs: torch's
    ``stage_backward_input`` detaches every stage output in place once ``I`` is done, and
    where the stage itself saved one for its ``W`` (a linear's input that also crosses the
    cut) that ``W`` failed with "Trying to use a saved tensor that has been detached
    in-place". A copy is one boundary tensor per microbatch. Outputs that need no gradient
    are sent detached (a view, such as a mask, cannot be detached in place).

    Args:
        stage: the stage's graph module.
        runner: what the forward calls: ``stage`` itself or ``torch.compile`` of it.
        recompute: the plan marks the stage ``recompute`` (default False).
        split_backward: the schedule runs the stage's backward as ``I`` and ``W``.
        recompute_policy: what a recomputing stage recomputes, one of
            :data:`autopart.core.recompute_policy.RECOMPUTE_POLICIES` (the plan's
            ``recompute_policy``; default ``"full"``).

    Raises:
        PlanError: ``recompute_policy`` not in ``RECOMPUTE_POLICIES``.
    """

    def __init__(self, stage: fx.GraphModule, runner: nn.Module, recompute: bool = False,
                 split_backward: bool = False, recompute_policy: str = "full") -> None:
        super().__init__()
        self.stage = stage
        self._run = [runner]  # the module itself, or torch.compile of it (not a submodule)
        self.recompute = recompute
        self.recompute_policy = check_recompute_policy(recompute_policy)
        self.split_backward = split_backward
        self._layouts: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = []
        for node in stage.graph.nodes:
            if node.op != "placeholder":
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and not val.is_contiguous():
                self._layouts.append((tuple(val.shape), tuple(val.stride())))
            else:
                self._layouts.append(None)

    @property
    def runner(self) -> nn.Module:
        """What the forward calls: ``stage`` itself, or ``torch.compile`` of it."""
        return self._run[0]

    def forward(self, *args: Any) -> Any:
        restored = []
        for arg, layout in zip(args, self._layouts, strict=True):
            if isinstance(arg, torch.Tensor) and arg.requires_grad:
                # the gradient this stage sends back must be dense too
                arg.register_hook(lambda g: g.contiguous())
            if layout is not None and isinstance(arg, torch.Tensor) and arg.stride() != layout[1]:
                arg = restride(arg, *layout)
            restored.append(arg)
        runner = self._run[0]
        if self.recompute and torch.is_grad_enabled():
            out = run_recomputed(self.stage, *restored, runner=runner,
                                 policy=self.recompute_policy)
        else:
            out = runner(*restored)
        sent = []
        for o in out:
            if isinstance(o, torch.Tensor):
                dense = o.contiguous()
                if self.split_backward and dense is o and o.requires_grad:
                    dense = o.clone()  # torch's I detaches what it sent; the stage keeps o
                elif self.split_backward and not o.requires_grad:
                    # torch's I detaches every output in place, which a view refuses ("Can't
                    # detach views in-place": a mask the stage passes on as a view of its
                    # own); detach() gives the same values as a tensor of its own, no copy
                    dense = dense.detach()
                o = dense
            sent.append(o)
        return tuple(sent)


def restride(dense: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """``dense`` laid out like the captured tensor (differentiable).

    Broadcast dimensions (stride 0) are taken from index 0 and expanded again; the other
    dimensions are copied into a buffer with the captured strides.
    """
    expanded = [d for d, st in enumerate(stride) if st == 0 and shape[d] > 1]
    base = dense
    for d in expanded:
        base = base.narrow(d, 0, 1)
    if expanded:
        return base.contiguous().expand(shape)
    strided = torch.empty_strided(shape, stride, dtype=dense.dtype, device=dense.device)
    return strided.copy_(dense)


class TracedStage(ZeroIndexStage):
    """``PipelineStage`` that marks each action it computes on the heartbeat (``"1F3"``,
    ``"1B3"``, ``"1W3"``), so that a rank stuck inside one is named with it, and times it
    into ``recorder`` during a traced step. Integer inputs of torch's shape inference are
    zeros (:class:`autopart.runtime._torch_private.ZeroIndexStage`)."""

    def __init__(self, heartbeat: Heartbeat, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._heartbeat = heartbeat
        self.recorder: ActionRecorder | None = None  # set for one traced step
        self.track = 0  # this rank's pipeline rank: the trace's track
        # ZeRO-0's overlapped dp reduction, started at the stage's last backward
        self.grad_buckets: GradBuckets | None = None

    @contextlib.contextmanager
    def _action(self, name: str) -> Iterator[None]:
        side = getattr(_SIDE, "active", False)
        with contextlib.nullcontext() if side else self._heartbeat.action(name):
            if self.recorder is None:
                yield
                return
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            with self.recorder.span(self.track, name, stream, waits=not side):
                yield

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._action(f"{self.stage_index}F{fwd_chunk_id}"):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        full = kwargs.get("full_backward", True)
        kind = "B" if full else "I"
        with self._action(f"{self.stage_index}{kind}{bwd_chunk_id}"), \
                self._last_backward(full and kwargs.get("last_backward", False)):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._action(f"{self.stage_index}W{bwd_chunk_id}"), \
                self._last_backward(kwargs.get("last_backward", False)):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    @contextlib.contextmanager
    def _last_backward(self, last: bool) -> Iterator[None]:
        """Around the step's last ``B`` (or ``W``) of this stage, which torch's schedule
        runtime marks ``last_backward``: the overlapped gradient reduction's buckets launch
        as their gradients become final, and the rest when it is done
        (:class:`autopart.runtime.distributed._grad_buckets.GradBuckets`)."""
        buckets = self.grad_buckets if last else None
        if buckets is None:
            yield
            return
        buckets.start(self.stage_index)
        yield
        buckets.launch_rest(self.stage_index)
