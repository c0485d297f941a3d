"""A rank's tensor-parallel group: full tensors from its shards and back, and the norm's count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from autopart.codegen.stages import BuiltStages
from autopart.codegen.tp_layout import TensorParallelRank
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
    group = _checked_group("tp", "tensor-parallel", plan.tp, tp_group, stages.tp,
                           "the mesh's 'tp' dimension")
    return TensorParallelState(group, stages.shards)


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
    group = _checked_group("ep", "expert-parallel", plan.ep, ep_group, stages.ep,
                           "autopart.runtime.distributed.mesh.mesh_groups builds it")
    return TensorParallelState(group, stages.ep_shards)


def _checked_group(name: str, kind: str, degree: int, group: dist.ProcessGroup | None,
                   built: TensorParallelRank | None, where: str) -> dist.ProcessGroup:
    """``group`` when it has the plan's ``degree`` ranks and the stages were built for this
    process's place in it.

    Raises:
        PlanError: no group or one of another size (naming ``<name>_group`` and ``where``
            it comes from), or stages built for another group or rank.
    """
    size = None if group is None else dist.get_world_size(group)
    if size != degree:
        raise PlanError(f"the plan has {name}={degree} but the {kind} group has "
                        f"{size or 'no'} ranks; pass {name}_group ({where}) of {degree} "
                        "ranks, e.g. torchrun with tp x pp x dp processes")
    assert group is not None
    if built is None or built.group_name != group.group_name \
            or built.rank != dist.get_rank(group):
        raise PlanError(f"the stages were built for another {kind} group or rank; build "
                        f"them with build_stages(..., {name}=TensorParallelRank.of_group("
                        f"{name}_group))")
    return group
