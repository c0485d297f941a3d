"""A pipeline rank's results after a step: the loss on every rank, gradients (microbatch
means, tied sums, dp means) and the whole model's gradient norm."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.runtime.distributed._comm import average_over
from autopart.runtime.distributed._sharding import DataSharding, local_tensor
from autopart.runtime.distributed._tensor_parallel import TensorParallelState

__all__ = ["ExpertGrads", "step_loss", "mean_over_microbatches", "reduce_grads", "grad_norm"]


def step_loss(losses: list[torch.Tensor], device: torch.device, last_rank: int,
              group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
              guarded: Callable[[Callable[[], Any]], Any]) -> torch.Tensor:
    """The global batch's loss on every rank: the mean of the microbatches' losses
    (``loss_fn`` averages within one), broadcast from the last stage's rank over the
    pipeline, then averaged over the data-parallel replicas (one scalar all-reduce; each
    replica runs as many rows, so the mean of their means is the batch's), as Megatron-LM
    and torchtitan log it.

    Args:
        losses: each microbatch's unscaled loss (0-dim), on the last stage's rank; ``[]``
            elsewhere.
        device: this rank's device.
        last_rank: the last stage's global rank.
        group: the pipeline's process group (None: the world).
        dp_group: this rank's data-parallel replicas, or None (dp = 1).
        guarded: runs a collective, turning a failure into ``PipelineFailure``.

    Returns:
        A 0-dim float32 tensor, the same on every rank of the world (one dtype everywhere
        for the collectives; a bf16 model's loss is bf16).
    """
    loss = (torch.stack([x.detach() for x in losses]).mean().float() if losses
            else torch.zeros((), device=device))
    guarded(lambda: dist.broadcast(loss, src=last_rank, group=group))
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        guarded(lambda: dist.all_reduce(loss, group=dp_group))
        loss /= dist.get_world_size(dp_group)
    return loss


def mean_over_microbatches(stages: Iterable[nn.Module], m: int) -> None:
    """Divide the gradients the step accumulated over ``m`` microbatches by ``m`` (the
    gradient of the mean loss, as torch's ``scale_grads`` does)."""
    for p in {id(p): p for mod in stages for p in mod.parameters()}.values():
        if p.grad is not None:
            p.grad.div_(m)


def reduce_grads(local: dict[str, torch.Tensor],
                 tied: Iterable[tuple[str, dist.ProcessGroup | None]],
                 params: Iterable[torch.Tensor], dp_group: dist.ProcessGroup | None,
                 sharding: DataSharding, experts: ExpertGrads | None = None) -> None:
    """Sum each tied parameter's gradient over the pipeline ranks holding it (its local
    shard under ZeRO), then average every gradient over the data-parallel replicas in
    buckets, as DDP does (:func:`average_over`); under ZeRO 1-3 FSDP has reduce-scattered
    the mean already.

    Args:
        local: FQN -> tensor this rank holds.
        tied: ``(fqn, group)`` per tied parameter this rank shares.
        params: this rank's parameters.
        dp_group: the data-parallel group, or None.
        sharding: the rank's ZeRO sharding.
        experts: where this rank's expert weights' gradients are reduced (ep > 1), or None;
            those are left out of the dp average.

    Raises:
        RuntimeError: a collective failed or timed out (torch.distributed's error).
    """
    for fqn, group in tied:
        p = local[fqn]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(local_tensor(p.grad), op=dist.ReduceOp.SUM, group=group)
    params = list(params)
    if experts is not None:
        experts.reduce([p for p in params if id(p) in experts.ids])
        params = [p for p in params if id(p) not in experts.ids]
    if dp_group is not None and not sharding.sharded:
        average_over([p.grad for p in params if p.grad is not None], dp_group)


@dataclass(frozen=True)
class ExpertGrads:
    """How an ep rank reduces its experts' gradients (Megatron-Core's expert data parallel).

    Each ep rank's expert weights received the tokens of every replica of its ep group, so
    their gradients already sum those replicas' contributions; the other ``dp / ep``
    replicas holding the same experts (``edp_group``) add theirs, and the sum is divided by
    dp, as the dense gradients' mean over dp is.

    Attributes:
        ids: ``id()`` of each expert weight of this rank.
        edp_group: the replicas holding the same experts, or None (ep = dp).
        ep: the ep degree.
    """

    ids: frozenset[int]
    edp_group: dist.ProcessGroup | None
    ep: int

    def reduce(self, params: list[torch.Tensor]) -> None:
        """Replace each expert gradient by its share of the global batch's gradient."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.edp_group is not None:
            average_over(grads, self.edp_group)  # the sum over dp / ep replicas, / (dp / ep)
        for g in grads:
            g.div_(self.ep)


def grad_norm(owned: Iterable[tuple[str, torch.Tensor]], norm_type: float,
              device: torch.device, pp_group: dist.ProcessGroup,
              tp: TensorParallelState | None, sharding: DataSharding,
              guarded: Callable[[Callable[[], None]], Any],
              ep: TensorParallelState | None = None) -> torch.Tensor:
    """The whole model's gradient p-norm from this rank's pieces, equal on every rank.

    Each rank takes ``sum |g| ** p`` (max for ``inf``) of the gradients it owns, the
    pipeline ranks add theirs up, the tp ranks theirs (each shard once, a replicated
    parameter on tp rank 0 only: :meth:`TensorParallelState.counts_in_norm`), and under
    ZeRO 1-3 the dp ranks their disjoint shards; ZeRO-0 replicas hold equal gradients and
    are counted once.

    Args:
        owned: ``(fqn, parameter)`` of the parameters whose owning stage is on this rank.
        norm_type: p (``inf`` for the largest entry).
        device: where the 0-dim result lives.
        pp_group: the pipeline's group.
        tp: the tp state, or None.
        sharding: the rank's ZeRO sharding.
        guarded: runs the collectives, turning a dead rank into ``PipelineFailure``.
        ep: the ep group's state, or None: an ep rank's experts are summed over the ep group
            (not over their edp replicas, which hold equal ones), apart from the dense rest.

    Returns:
        The norm (0-dim float32 tensor).

    Raises:
        PipelineFailure: a rank died during the reductions (raised by ``guarded``).
    """
    owned = list(owned)
    p = float(norm_type)
    inf = p == float("inf")
    experts = set(ep.shards) if ep is not None else set()

    def power(fqns: Callable[[str], bool]) -> torch.Tensor:
        grads = [local_tensor(t.grad) for fqn, t in owned if t.grad is not None and fqns(fqn)
                 and (tp is None or tp.counts_in_norm(fqn))]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        local = torch.nn.utils.get_total_norm(grads, p, foreach=None).to(torch.float32)
        return local.clone() if inf else local.pow(p)

    # [dense, experts]: the dense gradients are shards over dp under ZeRO 1-3 (and equal
    # over dp at ZeRO-0); an ep rank's experts are its own, equal over its edp replicas
    parts = torch.stack([power(lambda f: f not in experts), power(lambda f: f in experts)])

    def reduce() -> None:
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        dist.all_reduce(parts, op=op, group=pp_group)
        if tp is not None:
            tp.reduce_norm(parts, op)
        dense, expert = parts[0].clone(), parts[1].clone()
        sharding.grad_norm_power(dense, inf)
        if ep is not None:
            ep.reduce_norm(expert, op)
        total.copy_(torch.maximum(dense, expert) if inf else dense + expert)

    total = torch.zeros((), dtype=torch.float32, device=device)
    guarded(reduce)
    return total if inf else total.pow(1.0 / p)
