"""Megatron's tensor-parallel collectives as torch.library custom ops with autograd."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tp_copy", "tp_gather", "tp_reduce"]

# The ops live in the graph as ``torch.ops.autopart.tp_copy`` / ``tp_reduce`` / ``tp_gather``:
# a stage's source names them, ``torch.compile`` (``fuse=True``) treats them as opaque calls
# with the autograd registered here (their fake kernels give the shapes), and each one runs a
# functional collective (``torch.ops._c10d_functional``, addressed by the process group's
# name, so the graph holds a string rather than a ProcessGroup object). torch's own
# ``_c10d_functional.all_reduce`` differentiates to another all-reduce, which is the adjoint
# of a sum but not Megatron's convention (every tp rank holds the same replicated
# activation and the same gradient of it), hence these three.


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name)
    reduced: torch.Tensor = torch.ops._c10d_functional.wait_tensor(out)
    return reduced


@torch.library.custom_op("autopart::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's "f": identity forward (a copy); backward all-reduces (sums) the gradient
    over the tp group. Goes before a replicated tensor enters split work (a column-parallel
    input, a broadcast operand of the split region)."""
    return x.clone()


@tp_copy.register_fake
def _tp_copy_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _tp_copy_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.group_name = inputs[1]


def _tp_copy_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return tp_reduce(grad, ctx.group_name), None


tp_copy.register_autograd(_tp_copy_backward, setup_context=_tp_copy_setup)


@torch.library.custom_op("autopart::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Megatron's "g": all-reduce (sum) forward over the tp group; identity backward. Goes
    after a row-parallel matmul (its partial sums) and a vocab-parallel embedding."""
    return _all_reduce(x, group_name)


@tp_reduce.register_fake
def _tp_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _tp_reduce_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


tp_reduce.register_autograd(_tp_reduce_backward, setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("autopart::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, dim: int, rank: int, size: int, group_name: str) -> torch.Tensor:
    """All-gather of each tp rank's slice of ``dim`` (rank order) forward; backward keeps this
    rank's slice of the gradient (every tp rank holds the same gradient of the gathered,
    replicated tensor). Gathers a vocab-parallel head's logits before the user's loss."""
    parts = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, group_name)
    parts = torch.ops._c10d_functional.wait_tensor(parts)
    return torch.cat(parts.chunk(size, 0), dim)


@tp_gather.register_fake
def _tp_gather_fake(x: torch.Tensor, dim: int, rank: int, size: int,
                    group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= size
    return x.new_empty(shape)


def _tp_gather_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, ctx.dim, ctx.rank, _, _ = inputs
    ctx.width = x.shape[ctx.dim]


def _tp_gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    return grad.narrow(ctx.dim, ctx.rank * ctx.width, ctx.width).contiguous(), None, None, None, None


tp_gather.register_autograd(_tp_gather_backward, setup_context=_tp_gather_setup)
