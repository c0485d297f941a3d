"""A rank's tensor-parallel group: full tensors from its shards and back, and the norm's count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from autopart.codegen.stages import BuiltStages
from autopart.core.errors import PlanError

__all__ = ["TensorParallelState", "expert_parallel_state", "tensor_parallel_state"]


class TensorParallelState:
    """What a pipeline rank does with its tp group beyond the stages' own collectives.

    The same holds for an ep group (:func:`expert_parallel_state`): its ranks hold disjoint
    slices of some parameters (their experts) and equal copies of the rest, so gathering,
    cutting and the gradient norm's once-per-value count are the same.

    The stages (built with ``build_stages(..., tp=...)``) hold this rank's shards under the
    original FQNs; replicated parameters are whole on every tp rank and, by Megatron's
    "f"/"g" convention, get the same gradient on each, so nothing is reduced across tp
    after a step.

    Attributes:
        group: the tp process group.
        rank: this process's index in it.
        size: the tp degree.
        shards: FQN -> layout of each parameter this rank holds a shard of.
    """

    def __init__(self, group: dist.ProcessGroup, shards: Mapping[str, Any]) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.shards = dict(shards)

    def full_state(self, held: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``held`` (FQN -> tensor of this rank) with every shard replaced by the full
        tensor, gathered from the tp group (fused q/k/v blocks reassembled). Collective
        over the tp group: every tp rank calls it (they hold the same FQNs)."""
        out: dict[str, torch.Tensor] = {}
        for fqn, t in held.items():
            layout = self.shards.get(fqn)
            if layout is None:
                out[fqn] = t.detach()
                continue
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t.detach().contiguous(), group=self.group)
            out[fqn] = layout.full(parts)
        return out

    def local_state(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """A full-tensor ``state_dict`` with this rank's slice of each sharded FQN."""
        return {k: (self.shards[k].local(v, self.rank, self.size)
                    if k in self.shards and isinstance(v, torch.Tensor) else v)
                for k, v in state_dict.items()}

    def counts_in_norm(self, fqn: str) -> bool:
        """Whether this rank adds ``fqn``'s gradient to the gradient norm: every shard, and a
        replicated parameter on tp rank 0 only (the others hold the same gradient)."""
        return fqn in self.shards or self.rank == 0

    def reduce_norm(self, total: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """Combine the tp ranks' partial norms (``norm ** p`` sums, or maxima) in place."""
        dist.all_reduce(total, op=op, group=self.group)


def tensor_parallel_state(stages: BuiltStages, tp_group: dist.ProcessGroup | None,
                          ) -> TensorParallelState | None:
    """The tp state of a rank's pipeline, or None when the plan's tp is 1.

    Raises:
        PlanError: the plan has tp > 1 and no tp group of that size was given, or the stages
            were built for another tp rank than this process's place in ``tp_group``.
    """
    plan = stages.plan
    if plan.tp == 1:
        return None
    size = None if tp_group is None else dist.get_world_size(tp_group)
    if size != plan.tp:
        raise PlanError(f"the plan has tp={plan.tp} but the tensor-parallel group has "
                        f"{size or 'no'} ranks; pass tp_group (the mesh's 'tp' dimension) "
                        f"of {plan.tp} ranks, e.g. torchrun with tp x pp x dp processes")
    assert tp_group is not None
    if stages.tp is None or stages.tp.group_name != tp_group.group_name \
            or stages.tp.rank != dist.get_rank(tp_group):
        raise PlanError("the stages were built for another tensor-parallel group or rank; "
                        "build them with build_stages(..., tp=TensorParallelRank.of_group("
                        "tp_group))")
    return TensorParallelState(tp_group, stages.shards)


def expert_parallel_state(stages: BuiltStages, ep_group: dist.ProcessGroup | None,
                          ) -> TensorParallelState | None:
    """The ep group's state of a rank's pipeline (its experts split on dimension 0, as a tp
    group's shards are split), or None when the plan's ep is 1.

    Raises:
        PlanError: the plan has ep > 1 and no ep group of that size was given, the stages
            were built for another ep rank, or the plan also has tp > 1, which expert
            parallelism does not run with yet.
    """
    plan = stages.plan
    if plan.ep == 1:
        return None
    if plan.tp > 1:
        raise PlanError(f"ep={plan.ep} with tp={plan.tp}: expert parallelism runs with tp=1 so "
                        "far; re-plan with tp=1, or with ep=1")
    size = None if ep_group is None else dist.get_world_size(ep_group)
    if size != plan.ep:
        raise PlanError(f"the plan has ep={plan.ep} but the expert-parallel group has "
                        f"{size or 'no'} ranks; pass ep_group (built by autopart.runtime."
                        "distributed.mesh.mesh_groups) of that size")
    assert ep_group is not None
    if stages.ep is None or stages.ep.group_name != ep_group.group_name \
            or stages.ep.rank != dist.get_rank(ep_group):
        raise PlanError("the stages were built for another expert-parallel group or rank; "
                        "build them with build_stages(..., ep=TensorParallelRank.of_group("
                        "ep_group))")
    return TensorParallelState(ep_group, stages.ep_shards)
