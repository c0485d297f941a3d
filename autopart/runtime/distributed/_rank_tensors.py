"""A distributed pipeline rank's tensors by the model's FQNs: its parameters, its whole
``state_dict`` and the tensors it writes to and loads from a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.core.errors import PlanError
from autopart.runtime._torch_private import incompatible_keys
from autopart.runtime.checkpoint.state import CheckpointState
from autopart.runtime.pipeline import Pipeline

__all__ = ["RankTensors"]


class RankTensors(Pipeline):
    """The tensor half of :class:`autopart.runtime.distributed.pipeline.DistributedPipeline`,
    which sets what it reads: ``_fqn_order`` (the model's parameter FQNs in order), ``_local``
    (the tensors the rank holds, by FQN: ZeRO's DTensor shards, tp's slices), ``_whole``
    (:class:`autopart.runtime.distributed._state.WholeTensors`), ``pp_rank`` and
    ``device``."""

    _fqn_order: list[str]
    _local: dict[str, torch.Tensor]
    _whole: Any
    pp_rank: int
    device: torch.device

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original FQNs (a tied one once per rank)."""
        for fqn in self._fqn_order:
            t = self._local.get(fqn)
            if isinstance(t, nn.Parameter):
                yield prefix + fqn, t

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's tensors by FQN (parameters and buffers of its stages), whole: ZeRO
        shards gathered over the data-parallel group, then tensor-parallel shards into full
        tensors over the tp group (collective over both)."""
        return self._whole.state_dict()

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Copy values into this rank's tensors by FQN; keys of tensors other ranks hold are
        skipped (a whole model's ``state_dict`` can be given to every rank).

        Raises:
            PlanError: with ``strict``, a tensor this rank holds is missing, or a shape
                differs from the model's.
        """
        missing = sorted(set(self._local) - set(state_dict))
        if strict and missing:
            raise PlanError(f"state_dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                            f"which rank {self.pp_rank} holds; pass the whole model's state_dict")
        self._whole.load(state_dict, self._local.items())  # tp and ZeRO: each its piece
        return incompatible_keys(missing, [])

    def rank_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this rank's stages hold, by FQN, as they hold them: tp slices, ep's
        experts, ZeRO's DTensor shards, the rest whole (the very objects, not copies)."""
        return dict(self._local)

    @property
    def zero_sharded(self) -> bool:
        """Whether ZeRO 1-3 shard this rank's parameters over its dp group (FSDP2)."""
        return bool(self._whole.sharding.sharded)

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors whose owning stage is on this rank, by FQN (a tied parameter's
        replica on another rank excluded): what this rank writes to a checkpoint."""
        owner = self._built.placement.owner
        return {fqn: t for fqn, t in self._local.items()
                if self.plan.stages[owner.get(fqn, 0)].rank == self.pp_rank}

    def checkpoint_state(self) -> CheckpointState:
        """This rank writes the tensors it owns and loads every tensor it holds; saving and
        loading are collective when the world has several ranks. Under tp > 1 or ZeRO 1-3
        both go through whole tensors (:class:`autopart.runtime.distributed._state.WholeTensors`), so
        a checkpoint loads into any (tp, pp, dp, ZeRO) layout and into the plain model."""
        params = {id(p): f for f, p in self.named_parameters()}
        if self._whole.split:
            return self._whole.checkpoint_state(self.owned_tensors(), params, self.plan,
                                                self.device,
                                                lambda sd: self.load_state_dict(sd, strict=False))
        held = dict(self._local)
        return CheckpointState(self.owned_tensors(), held, params, {f: f for f in held},
                               self.plan, dist.get_world_size() > 1, self.device, lambda: None)
