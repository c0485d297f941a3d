"""This rank's stages as torch's schedule runtime runs them: each stage module wrapped for
point-to-point transfer and recompute, sharded over dp by ZeRO, made a ``PipelineStage``, and
ZeRO-0's overlapped gradient buckets attached."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.codegen.stages import BuiltStages
from autopart.core.schedule import splits_backward
from autopart.runtime.distributed._grad_buckets import GradBuckets, overlapped_reduction
from autopart.runtime.distributed._sharding import DataSharding
from autopart.runtime.distributed._stages import P2PStage
from autopart.runtime.distributed.heartbeat import Heartbeat

__all__ = ["RankStages", "rank_stages"]


@dataclass
class RankStages:
    """What :func:`rank_stages` builds.

    Attributes:
        sharding: ZeRO's sharding of the stages over dp (a no-op one at ZeRO-0).
        pipeline_stages: torch ``PipelineStage`` objects of the rank's stages, in stage order.
        grad_buckets: ZeRO-0's dp buckets launched in each stage's last backward, or None
            (no overlap, dp = 1, or ZeRO 1-3).
        local: the tensors the rank holds, by FQN, with ZeRO's sharded parameters in place
            of the whole ones.
    """

    sharding: DataSharding
    pipeline_stages: list[Any]
    grad_buckets: GradBuckets | None
    local: dict[str, torch.Tensor]


def rank_stages(stages: BuiltStages, local_stages: list[int], local: dict[str, torch.Tensor],
                fqn_order: list[str], device: torch.device, heartbeat: Heartbeat,
                dp_group: dist.ProcessGroup | None,
                p2p_group: dist.ProcessGroup | None,
                exclude: frozenset[int] = frozenset()) -> RankStages:
    """Build this rank's stages for torch's schedule runtime.

    Each local stage module becomes a :class:`P2PStage` (recompute with the plan's
    ``recompute_policy``, copies of its outputs where its backward splits), ZeRO 1-3 puts
    FSDP2 on each (:class:`DataSharding`; its DTensor parameters replace the FQNs' tensors in
    ``local``), each becomes a ``PipelineStage`` on ``p2p_group``, and with the plan's
    overlap ZeRO-0's dp buckets are attached to every stage and report to the sharding's
    collective timer.

    Args:
        stages: the built stages (every stage's plan and module; only ``local_stages`` run
            here).
        local_stages: the indices of this rank's stages.
        local: the tensors this rank holds, by FQN.
        fqn_order: the model's parameter FQNs in ``named_parameters`` order.
        device: this rank's device.
        heartbeat: the pipeline's heartbeat, told of every action.
        dp_group: this rank's data-parallel group, or None.
        p2p_group: the group the stages send and receive on.
        exclude: ids of parameters the dp buckets and ZeRO leave out (an ep rank's experts).

    Raises:
        PlanError: a ZeRO stage the groups or the placement cannot run
            (:class:`DataSharding`), or an unknown recompute policy (:class:`P2PStage`).
    """
    plan, placement = stages.plan, stages.placement
    submods: dict[int, nn.Module] = {
        s: P2PStage(stages.modules[s], stages.runners[s], plan.stages[s].recompute,
                    splits_backward(plan.schedule_kind, plan.stages[s].recompute),
                    recompute_policy=plan.recompute_policy)
        for s in local_stages}
    sharding = DataSharding(plan, dp_group, device, placement, fqn_order)
    sharding.shard(submods, [p for mod in submods.values() for p in mod.parameters()
                             if id(p) in exclude])
    local = sharding.refreshed(local, {s: stages.modules[s] for s in submods}, placement)
    pipeline_stages = [sharding.new_stage(heartbeat, submods[s], s, plan.num_stages, device,
                                          group=p2p_group)
                       for s in local_stages]
    buckets = overlapped_reduction(plan, dp_group, sharding.sharded, submods, exclude)
    for st in pipeline_stages:
        st.grad_buckets = buckets
    if buckets is not None:  # where this rank's dp collectives report in a traced step
        buckets.timer = sharding.timer
    return RankStages(sharding, pipeline_stages, buckets, local)
