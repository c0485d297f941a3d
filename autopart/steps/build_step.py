"""The build step: a plan's stages generated from the captured graph and handed to a runtime,
every stage in this process (local) or this rank's stages under torchrun (distributed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.codegen import TensorParallelRank, build_stages
from autopart.core.capture import CapturedGraph, on_meta
from autopart.core.plan import Plan
from autopart.core.progress import phase
from autopart.core.signature import InputSignature
from autopart.devices import plan_devices
from autopart.options import CompileOptions
from autopart.runtime.checkpoint.save_load import checkpoint_tensors
from autopart.runtime.distributed import launch
from autopart.runtime.distributed.heartbeat import DEFAULT_STEP_TIMEOUT_S
from autopart.runtime.distributed.mesh import mesh_groups
from autopart.runtime.distributed.pipeline import DistributedPipeline
from autopart.runtime.local.module import PipelinedModule
from autopart.runtime.pipeline import Pipeline

__all__ = ["build_pipeline"]

LossFn = Callable[[Any, Any], torch.Tensor]


def build_pipeline(model: nn.Module, captured: CapturedGraph, plan: Plan,
                   loss_fn: LossFn | None, options: CompileOptions, backend: str,
                   timings: dict[str, float], *,
                   tensor_of: Callable[[str], torch.Tensor] | None = None,
                   cuts_by_name: bool = False, cut_already: bool = False) -> Pipeline:
    """Build ``plan``'s stages from ``captured`` (:func:`autopart.codegen.build_stages`) and
    wrap them in the ``backend``'s runtime.

    ``"local"``: every stage, on the plan's devices (or ``options.devices``), in a
    :class:`autopart.PipelinedModule`. ``"distributed"``: this rank's stages on its device, on
    the groups of the plan's (pp, dp, tp) mesh (:func:`autopart.runtime.distributed.mesh.
    mesh_groups`; the tp group is passed where tp > 1, the runtime reads
    ``plan.zero_stage`` with the dp group), in a :class:`autopart.DistributedPipeline`; the
    weights come from ``tensor_of`` when given, else the ``checkpoint`` option, else the
    model's own, materialised from ``meta`` where they are there.

    Args:
        model: the model the pipeline stands for (its parameters are shared where a stage
            runs on their device).
        captured: the model captured at the plan's microbatch.
        plan: the plan.
        loss_fn: ``(output, target) -> scalar``, or None (inference only).
        options: the choices (``devices``, ``fuse``, ``issue_threads``, ``cuda_graphs``,
            ``checkpoint``, ``mesh``, ``step_timeout_s``).
        backend: ``"local"`` or ``"distributed"``.
        timings: seconds per phase; ``codegen_s`` (and ``fuse_s``) are added, and the dict
            becomes the pipeline's ``timings_s``.
        tensor_of: canonical FQN -> the tensor a stage owns (a lazy pipeline's new shape
            shares the first pipeline's), or None.
        cuts_by_name: find the plan's cuts by node name (a capture at another shape).
        cut_already: ``tensor_of`` gives this rank's tp slices and ep experts as another
            pipeline of the plan holds them (:func:`autopart.codegen.build_stages`).

    Raises:
        PlanError: the plan does not match ``captured``, or the world / mesh does not fit
            the plan's layout.
    """
    local = backend == "local"
    groups = None if local else mesh_groups(plan, options.mesh)  # PlanError if it does not fit
    if groups is None:
        devices: list[str | torch.device] = list(plan_devices(plan, options.devices))
        ranks = tp = ep = cp = ep_chunk = None
    else:
        device = launch.rank_device()
        devices, ranks = [device] * groups.pp, {dist.get_rank(groups.pp_group)}
        tp = (TensorParallelRank.of_group(groups.tp_group) if groups.tp_group is not None
              else None)
        ep = (TensorParallelRank.of_group(groups.ep_group) if groups.ep_group is not None
              else None)
        cp = (TensorParallelRank.of_group(groups.cp_group) if groups.cp_group is not None
              else None)
        ep_chunk = (TensorParallelRank.of_group(groups.ep_chunk_group)
                    if groups.ep_chunk_group is not None else None)
        meta = on_meta(model)
        cuts_by_name = cuts_by_name or meta  # codegen points the meta literals at device
        if tensor_of is None and options.checkpoint is not None:
            tensor_of = checkpoint_tensors(options.checkpoint)
        elif tensor_of is None and meta:
            tensor_of = launch.materialise(model, device)
    t0 = time.perf_counter()
    with phase("codegen"):
        stages = build_stages(captured, plan, devices, ranks=ranks, fuse=options.fuse,
                              tensor_of=tensor_of, cuts_by_name=cuts_by_name, tp=tp,
                              ep=ep, cp=cp, cut_already=cut_already, ep_chunk=ep_chunk)
    timings["codegen_s"] = time.perf_counter() - t0
    if options.fuse:
        timings["fuse_s"] = stages.fuse_s
    signature = InputSignature.of(captured)
    if groups is None:
        pipe = PipelinedModule(model, stages, signature, loss_fn=loss_fn, timings_s=timings,
                               issue_threads=options.issue_threads)
        pipe.cuda_graphs = options.cuda_graphs
        return pipe
    return DistributedPipeline(model, stages, signature, devices[0], loss_fn=loss_fn,
                               pp_group=groups.pp_group, dp_group=groups.dp_group,
                               tp_group=groups.tp_group, ep_group=groups.ep_group,
                               edp_group=groups.edp_group, timings_s=timings,
                               step_timeout_s=options.step_timeout_s or DEFAULT_STEP_TIMEOUT_S)
