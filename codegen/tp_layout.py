"""Where a tensor-parallel shard comes from: a parameter's split layout and a rank's place in tp."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ShardLayout", "TensorParallelRank"]


@dataclass(frozen=True)
class ShardLayout:
    """How a parameter is split over tp: along ``dim``, each of ``blocks`` (full sizes along
    ``dim``, summing to the full size) cut into tp equal contiguous parts; rank ``r`` holds
    part ``r`` of every block, concatenated (one block but for fused projections)."""

    dim: int
    blocks: tuple[int, ...]

    def local(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s shard of the full tensor (a copy)."""
        parts = torch.split(full, list(self.blocks), self.dim)
        return torch.cat([p.chunk(size, self.dim)[rank] for p in parts], self.dim).clone()

    def full(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (rank order)."""
        size = len(shards)
        pieces = [torch.split(s, [b // size for b in self.blocks], self.dim) for s in shards]
        return torch.cat([pieces[r][i] for i in range(len(self.blocks)) for r in range(size)],
                         self.dim)


@dataclass(frozen=True)
class TensorParallelRank:
    """This process's place in its tensor-parallel group.

    Attributes:
        rank: index in the tp group, 0..size-1.
        size: the tp degree.
        group_name: the tp process group's name (``ProcessGroup.group_name``), which the
            collectives in the graph address.
    """

    rank: int
    size: int
    group_name: str

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> TensorParallelRank:
        """This rank's place in ``group`` (an initialised process group)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group.group_name)
