"""Pipeline: the base of both runtimes' partitioned models, holding the outer code they share."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopart.codegen.stages import BuiltStages
from autopart.core.errors import PlanError
from autopart.core.jsonio import write_text_atomic
from autopart.core.memory import PeakMemory, measure_peak_bytes, optimizer_tensors
from autopart.core.plan import Plan
from autopart.core.signature import InputSignature
from autopart.core.trace import Trace, TraceEvent
from autopart.runtime.checkpoint.save_load import PendingSave, save_checkpoint
from autopart.runtime.checkpoint.state import CheckpointState
from autopart.runtime.host import tune_cpu_allocator

__all__ = ["Pipeline"]


class Pipeline(nn.Module):
    """The partitioned model :func:`autopart.compile` returns.

    Subclassed by :class:`autopart.PipelinedModule` (one process, every stage) and
    :class:`autopart.DistributedPipeline` (one rank of a ``torchrun`` launch, its stages); not
    constructed directly. Both offer ``pipe(*args)`` (pipelined inference, the output has the
    model's structure), ``train_step(*args, target=...)`` (forward and backward of every
    microbatch, returning the mean loss as a 0-dim tensor), ``parameters()`` /
    ``named_parameters()`` (what this process holds, each once, under the original model's
    FQNs: what an optimizer takes), ``state_dict`` / ``load_state_dict`` by those FQNs,
    ``clip_grad_norm_``, and the methods below. ``train_step(..., grad_scaler=scaler)``
    trains with loss scaling (fp16) under the user's ``torch.amp.GradScaler``, which then
    steps and updates as in torch's AMP recipe.

    Attributes:
        plan: the plan it runs.
        signature: the inputs and outputs it was compiled for.
        timings_s: seconds spent per compile phase (``capture_s``, ``profile_s``,
            ``split_cost_s``, ``solve_s``, ``codegen_s``; phases not run are absent).
        last_trace: the last ``train_step(trace=True)``'s trace, or None.
        last_peak_memory_bytes: the last ``train_step(measure_memory=True)``'s peak memory
            (:class:`autopart.core.memory.PeakMemory`), or None.
    """

    def __init__(self, stages: BuiltStages, signature: InputSignature, *,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 timings_s: dict[str, float] | None, on_cpu: bool) -> None:
        """Keep what both runtimes share.

        Args:
            stages: the built stages (every stage, or this rank's).
            signature: the inputs and outputs compiled for.
            loss_fn: ``(output, target) -> scalar``, or None for inference only.
            timings_s: seconds per compile phase, kept as ``timings_s`` (None: empty).
            on_cpu: a stage of this process runs on the CPU: tune the CPU allocator so freed
                activations stay in the process (:func:`autopart.runtime.host.tune_cpu_allocator`).
        """
        super().__init__()
        self.plan: Plan = stages.plan
        self.signature = signature
        self.timings_s = {} if timings_s is None else timings_s
        if on_cpu:
            tune_cpu_allocator()
        self._built: BuiltStages = stages
        self._loss_fn = loss_fn
        self._recompute = [st.stage_index for st in stages.plan.stages if st.recompute]
        self.last_trace: Trace | None = None
        self.last_peak_memory_bytes: PeakMemory | None = None

    # ---- what each runtime says ------------------------------------------------------
    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters and buffers whose owning stage runs in this process, by FQN (a
        tied parameter's replicas excluded; tensors the graph never reads count as stage
        0's): what this process writes to a checkpoint."""
        raise NotImplementedError

    def checkpoint_state(self) -> CheckpointState:
        """This process's share of the model as checkpoints read and write it."""
        raise NotImplementedError

    def _writes_plan_file(self) -> bool:
        """Whether :meth:`save_plan` writes the plan file from this process."""
        return True

    # ---- files -------------------------------------------------------------------------
    def stage_sources(self) -> dict[int, str]:
        """Stage index -> readable Python source of each stage this process holds, tensor
        shapes as comments (:func:`autopart.codegen.stage_source`); byte-identical whichever
        runtime built the stage."""
        return self._built.sources()

    def save_plan(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write the plan to ``path`` (a distributed pipeline: from its first rank) and this
        process's stage sources as ``stage_<s>.py`` beside it, each atomically.

        Returns:
            The paths written.
        """
        target = Path(path)
        written = []
        if self._writes_plan_file():
            self.plan.save(target)
            written.append(target)
        for s, source in self.stage_sources().items():
            out = target.parent / f"stage_{s}.py"
            write_text_atomic(out, source)
            written.append(out)
        return written

    def save(self, directory: str | os.PathLike[str], *, optimizer: Any = None,
             extra: dict[str, Any] | None = None, async_save: bool = False,
             keep: int = 1) -> Path | PendingSave:
        """Checkpoint model and optimizer state (DCP) and the plan atomically; on every rank
        of a distributed pipeline. See :func:`autopart.runtime.checkpoint.save_load.save_checkpoint`."""
        return save_checkpoint(self, directory, optimizer=optimizer, extra=extra,
                               async_save=async_save, keep=keep)

    # ---- shared steps ------------------------------------------------------------------
    @staticmethod
    def _copy_state_in(state_dict: Mapping[str, Any],
                       targets: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``state_dict[key]`` into each ``(key, tensor)`` of ``targets`` whose key is
        given (without autograd). A DTensor target (a ZeRO shard) receives its own piece of
        the whole value, cut locally (``distribute_tensor(..., src_data_rank=None)``: no
        communication).

        Raises:
            PlanError: a value's shape differs from its tensor's (whole) shape.
        """
        with torch.no_grad():
            for key, target in targets:
                if key not in state_dict:
                    continue
                value = torch.as_tensor(state_dict[key])
                if tuple(value.shape) != tuple(target.shape):
                    raise PlanError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, the "
                                    f"model's is {tuple(target.shape)}; pass the whole model's "
                                    "tensor under that key")
                if isinstance(target, DTensor):
                    value = distribute_tensor(value.to(target.device, target.dtype),
                                              target.device_mesh, target.placements,
                                              src_data_rank=None).to_local()
                    target = target.to_local()
                target.copy_(value)

    @staticmethod
    def _loss_scaler(grad_scaler: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What multiplies each microbatch's loss where its backward starts:
        ``grad_scaler.scale`` when a scaler is given and enabled, else None.

        Raises:
            PlanError: ``grad_scaler`` is not a ``torch.amp.GradScaler``.
        """
        if grad_scaler is None:
            return None
        if not isinstance(grad_scaler, torch.amp.GradScaler):
            raise PlanError(f"grad_scaler is a {type(grad_scaler).__name__}; pass a "
                            "torch.amp.GradScaler (e.g. torch.amp.GradScaler('cuda')), or None")
        return grad_scaler.scale if grad_scaler.is_enabled() else None

    def _measure_step(self, step: Callable[[], Any], devices: Sequence[torch.device],
                      optimizer: torch.optim.Optimizer | None,
                      resident: Iterable[torch.Tensor]) -> tuple[Any, dict[str, int]]:
        """Run ``step`` under :func:`autopart.core.memory.measure_peak_bytes`, counting as
        held before it this process's parameters, their gradients, ``resident`` (buffers,
        receive buffers) and ``optimizer``'s state."""
        held = [t for _, p in self.named_parameters() for t in (p, p.grad)
                if t is not None] + list(resident)
        return measure_peak_bytes(step, devices, held + optimizer_tensors(optimizer))

    def _trace(self, events: Iterable[TraceEvent], source: str, num_microbatches: int) -> Trace:
        """The trace of a step: ``events``, their ``source`` and the plan's metadata."""
        return Trace(tuple(events), source,
                     {"schedule_kind": self.plan.schedule_kind,
                      "num_microbatches": num_microbatches,
                      "stages_per_rank": self.plan.stages_per_rank,
                      "graph_fingerprint": self.plan.graph_fingerprint})
