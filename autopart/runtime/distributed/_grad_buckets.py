"""ZeRO-0's data-parallel gradient reduction overlapped with the backward: each stage's
gradients are all-reduced in buckets launched while its last microbatch's backward runs.

How it runs (the scheme of DDP's reducer and Megatron-LM's ``--overlap-grad-reduce``, on
torch.distributed's asynchronous collectives):

- Each local stage's trainable parameters are packed into buckets of at most
  :func:`autopart.core.layout.grad_bucket_elements` elements (Megatron-Core's default,
  ``max(4e7, 1e6 x dp)``; one dtype and device each), in reverse registration order: roughly
  the order the backward finishes their gradients.
- torch's schedule runtime tells a stage which backward is its last of the step
  (``last_backward``). Before it, the stage's buckets are armed; a parameter's
  post-accumulate-grad hook marks it ready, and a bucket whose parameters are all ready is
  copied into one flat tensor and all-reduced with ``async_op=True``, in bucket order (every
  replica launches the same collectives in the same order, as DDP requires). After that
  backward (or the last weight-gradient ``W`` of a split backward, whose gradients torch adds
  up outside autograd's hooks) the buckets not launched yet are launched.
- After the schedule, :meth:`GradBuckets.finish` waits for every bucket and writes the mean
  back into ``.grad``. Only that wait is exposed: the reductions run beside the rest of the
  backward and the rest of the schedule (gloo's worker threads on CPU, NCCL's stream on GPU).
- In a traced step (CPU), each bucket is a slice of the rank's comm lane from its launch to
  its completion (``"all_reduce bucket <k> stage <s>"``), and each wait in :meth:`finish`
  an ``"exposed ..."`` slice of its compute lane (:class:`autopart.runtime.tracing.
  CollectiveTimer`).

A parameter two stages of this rank share (a tied embedding of a V schedule) is left out:
its gradient is complete only after both stages' backwards, and the after-the-step path
(:func:`autopart.runtime.distributed._grads.reduce_grads`) averages it there.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.core.layout import grad_bucket_elements
from autopart.core.plan import Plan
from autopart.runtime.distributed._comm import mean_into
from autopart.runtime.tracing import CollectiveTimer

__all__ = ["GradBuckets", "overlapped_reduction"]


class _Bucket:
    """Parameters whose gradients are reduced together, and the reduction in flight."""

    __slots__ = ("params", "ready", "flat", "work", "name", "slot")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.work: Any = None
        self.name = "all_reduce"  # its trace slice's name
        self.slot: int | None = None  # its slice in the trace, while traced


class GradBuckets:
    """This rank's overlapped dp gradient reduction (see the module docstring).

    Args:
        modules: stage index -> the module of each local stage (its parameters are the
            stage's).
        group: the data-parallel group (>= 2 ranks).
        bucket_elements: a bucket's largest size, elements (default:
            :func:`autopart.core.layout.grad_bucket_elements` of the group's size).
        exclude: ids of parameters not averaged over ``group`` (an ep rank's experts,
            reduced over their own replicas after the step).

    Attributes:
        covered: ids of the parameters reduced here (the others are reduced after the step).
        timer: where the buckets report during a traced step (the pipeline's).
    """

    def __init__(self, modules: Mapping[int, nn.Module], group: dist.ProcessGroup,
                 bucket_elements: int | None = None,
                 exclude: Collection[int] = ()) -> None:
        self._group = group
        self._size = dist.get_world_size(group)
        cap = grad_bucket_elements(self._size) if bucket_elements is None else bucket_elements
        holders: dict[int, int] = {}  # parameter id -> local stages holding it
        for mod in modules.values():
            for p in mod.parameters():
                holders[id(p)] = holders.get(id(p), 0) + 1
        self._buckets: dict[int, list[_Bucket]] = {}
        self._next: dict[int, int] = {}  # stage -> index of its next bucket to launch
        self._armed: set[int] = set()
        self.covered: set[int] = set()
        self.timer = CollectiveTimer()
        for s, mod in modules.items():
            params = [p for p in mod.parameters() if p.requires_grad and holders[id(p)] == 1
                      and id(p) not in exclude]
            buckets = self._pack(list(reversed(params)), cap)
            self._buckets[s] = buckets
            for k, b in enumerate(buckets):
                b.name = f"all_reduce bucket {k} stage {s}"
                for p in b.params:
                    self.covered.add(id(p))
                    p.register_post_accumulate_grad_hook(self._hook(s, b))

    @staticmethod
    def _pack(params: list[nn.Parameter], cap: int) -> list[_Bucket]:
        out: list[_Bucket] = []
        open_: dict[tuple[torch.dtype, torch.device], tuple[_Bucket, int]] = {}
        for p in params:
            key = (p.dtype, p.device)
            current = open_.get(key)
            if current is None or (current[1] + p.numel() > cap and current[0].params):
                current = (_Bucket([]), 0)
                out.append(current[0])
            current[0].params.append(p)
            open_[key] = (current[0], current[1] + p.numel())
        return out

    def _hook(self, stage: int, bucket: _Bucket) -> Any:
        def ready(p: torch.Tensor) -> None:
            if stage in self._armed:
                bucket.ready.add(id(p))
                self._launch_ready(stage)
        return ready

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad.reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                 for p in bucket.params]
        bucket.flat = torch.cat(grads)  # (elements of the bucket,)
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self._group,
                                      async_op=True)
        bucket.slot = self.timer.issued(bucket.name, bucket.work)

    def _launch_ready(self, stage: int) -> None:
        buckets, i = self._buckets[stage], self._next[stage]
        while i < len(buckets) and len(buckets[i].ready) == len(buckets[i].params):
            self._launch(buckets[i])
            i += 1
        self._next[stage] = i

    def start(self, stage: int) -> None:
        """Arm ``stage``'s buckets: its last backward of the step begins."""
        if stage not in self._buckets:
            return
        self._armed.add(stage)
        self._next[stage] = 0
        for b in self._buckets[stage]:
            b.ready.clear()
            b.flat = b.work = b.slot = None

    def launch_rest(self, stage: int) -> None:
        """Launch ``stage``'s buckets not launched yet (its last backward or last ``W`` is
        done: every gradient of the stage is final)."""
        if stage not in self._armed:
            return
        buckets = self._buckets[stage]
        for b in buckets[self._next[stage]:]:
            self._launch(b)
        self._next[stage] = len(buckets)
        self._armed.discard(stage)

    def finish(self) -> None:
        """Wait for every launched bucket and write the mean over the group into each
        parameter's ``.grad`` (a parameter without one keeps None). A stage whose last
        backward never started this step (an aborted step) is skipped.

        Raises:
            RuntimeError: a reduction failed or timed out (torch.distributed's error).
        """
        self._armed.clear()
        for buckets in self._buckets.values():
            for b in buckets:
                if b.work is None:
                    continue
                work, flat, slot = b.work, b.flat, b.slot
                b.work = b.flat = b.slot = None
                self.timer.wait(slot, work)
                assert flat is not None
                mean_into(flat, [(p.numel(), p.grad) for p in b.params], self._size)

    def uncovered(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` this object does not reduce."""
        return [p for p in params if id(p) not in self.covered]


def overlapped_reduction(plan: Plan, dp_group: dist.ProcessGroup | None, sharded: bool,
                         submods: Mapping[int, nn.Module],
                         exclude: Collection[int] = ()) -> GradBuckets | None:
    """The overlapped reduction of a plan with ``overlap_grad_reduce`` (ZeRO-0, a dp group
    of at least 2 ranks), else None: gradients are then averaged after the step (ZeRO 1-3:
    FSDP2 reduce-scatters them).

    Args:
        plan: the plan.
        dp_group: this rank's data-parallel group, or None.
        sharded: the rank's parameters are ZeRO 1-3 shards (no overlap here).
        submods: stage index -> each local stage's module.
        exclude: ids of parameters the buckets leave out (:class:`GradBuckets`).
    """
    if (not plan.overlap_grad_reduce or dp_group is None or sharded
            or dist.get_world_size(dp_group) < 2):
        return None
    return GradBuckets(submods, dp_group, exclude=exclude)
