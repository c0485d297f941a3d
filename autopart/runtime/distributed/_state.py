"""A distributed pipeline's whole tensors: its tp, ep and ZeRO shards gathered by FQN, and back."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from autopart.core.plan import Plan
from autopart.runtime.checkpoint.state import CheckpointState
from autopart.runtime.distributed._sharding import DataSharding
from autopart.runtime.distributed._tensor_parallel import TensorParallelState
from autopart.runtime.pipeline import Pipeline

__all__ = ["WholeTensors"]


class WholeTensors:
    """Whole tensors of one pipeline rank, from its shards and back, by the model's FQNs.

    A parameter can be split twice: over tp (:class:`TensorParallelState`: this rank's
    slice, GPT-2's fused q/k/v per block) and then over dp (ZeRO 1-3:
    :class:`DataSharding`, a DTensor shard of the tp slice); an expert weight is split over
    ep instead (this rank's experts, dimension 0). :meth:`whole` undoes both
    (all-gather over dp, then over tp), :meth:`part` cuts a whole tensor back into this
    rank's piece without communication. Optimizer state shaped like its parameter (Adam's
    moments) goes the same way; anything else (Adam's ``step``) is left as it is.

    Collective: every rank of a dp and tp group must call :meth:`whole` for the same FQNs
    in the same order (ranks of one pipeline rank hold the same FQNs).

    Args:
        local: FQN -> the tensor this rank holds (a shard, a DTensor shard or whole).
        whole_shapes: FQN -> the model's shape of each tensor of ``local``.
        sharding: the pipeline's ZeRO sharding (a no-op at ZeRO-0).
        tp: the pipeline's tensor-parallel state, or None (tp = 1).
        ep: the pipeline's expert-parallel state (experts split on dimension 0 over the ep
            group, :class:`TensorParallelState` of that group), or None (ep = 1).
    """

    def __init__(self, local: Mapping[str, torch.Tensor],
                 whole_shapes: Mapping[str, tuple[int, ...]], sharding: DataSharding,
                 tp: TensorParallelState | None,
                 ep: TensorParallelState | None = None) -> None:
        self.local = local
        self.whole_shapes = dict(whole_shapes)
        self.sharding = sharding
        self.tp = tp
        self.ep = ep

    @property
    def split(self) -> bool:
        """Whether any tensor of this rank is a piece of a whole one (tp > 1, ep > 1 or
        ZeRO 1-3)."""
        return self.tp is not None or self.ep is not None or self.sharding.sharded

    def _split_by(self, group: TensorParallelState | None, fqn: str,
                  shape: tuple[int, ...]) -> bool:
        """Whether a (dp-gathered) tensor of ``shape`` under ``fqn`` is ``group``'s slice."""
        held = self.local[fqn]
        return (group is not None and fqn in group.shards
                and shape == tuple(held.shape) and shape != self.whole_shapes[fqn])

    def whole(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which ``t`` (``fqn``'s parameter or a state tensor shaped like
        it) is this rank's piece; ``t`` itself, detached, when it is not one."""
        out = t.full_tensor() if isinstance(t, DTensor) else t
        out = out.detach()
        for group in (self.tp, self.ep):
            if self._split_by(group, fqn, tuple(out.shape)):
                assert group is not None
                out = group.full_state({fqn: out})[fqn]
        return out

    def part(self, fqn: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``whole`` (shaped like ``fqn``'s whole tensor), on the
        parameter's device: the tp slice, then the DTensor shard when the parameter is one.
        A tensor of another shape (a scalar state entry) is returned as is."""
        if fqn not in self.local or tuple(whole.shape) != self.whole_shapes[fqn]:
            return whole
        held = self.local[fqn]
        out = whole.to(held.device)
        for group in (self.tp, self.ep):
            if group is not None and fqn in group.shards:
                out = group.shards[fqn].local(out, group.rank, group.size)
        if isinstance(held, DTensor):
            out = distribute_tensor(out, held.device_mesh, held.placements, src_data_rank=None)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of this rank, whole (collective over dp and tp)."""
        return {fqn: self.whole(fqn, t) for fqn, t in self.local.items()}

    def load(self, state_dict: Mapping[str, Any], targets: Iterable[tuple[str, torch.Tensor]]
             ) -> None:
        """Copy whole tensors of ``state_dict`` into ``targets`` (FQN, tensor held), each
        its own piece; keys not given are skipped.

        Raises:
            PlanError: a value's shape differs from the model's
                (:meth:`Pipeline._copy_state_in`, which cuts a ZeRO shard's piece).
        """
        for group in (self.tp, self.ep):
            if group is not None:
                state_dict = group.local_state(state_dict)
        Pipeline._copy_state_in(state_dict, targets)

    def checkpoint_state(self, owned: Iterable[str], params: dict[int, str], plan: Plan,
                         device: torch.device, load: Callable[[Mapping[str, Any]], Any],
                         ) -> CheckpointState:
        """The checkpoint's view of a split rank: it writes the whole tensors it owns (tp and
        dp peers write equal ones, which DCP stores once), loads into whole buffers that are
        then cut into its pieces by ``load`` (the pipeline's ``load_state_dict``), and
        gathers and cuts optimizer state through :meth:`whole` / :meth:`part`.

        Args:
            owned: the FQNs this rank owns (its stages own them).
            params: ``id(parameter)`` -> FQN of this rank's parameters.
            plan: the pipeline's plan.
            device: this rank's device.
            load: copies a whole-tensor state dict into the rank's tensors.
        """
        owned = set(owned)
        writes = {fqn: self.whole(fqn, t) for fqn, t in self.local.items() if fqn in owned}
        holds = {fqn: torch.empty(self.whole_shapes[fqn], dtype=t.dtype)
                 for fqn, t in self.local.items()}
        return CheckpointState(writes, holds, params, {f: f for f in holds}, plan, True, device,
                               lambda: load(holds), whole=self.whole, part=self.part)
