"""Microbatch scatter (split along dim 0) and gather (concatenate, or average scalars)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from autopart.core.errors import PlanError

__all__ = ["split_leaves", "split_tree", "merge_leaves"]


def split_leaves(leaves: list[Any], num_microbatches: int, what: str = "input") -> list[list[Any]]:
    """Split every tensor leaf with ``dim >= 1`` into ``num_microbatches`` equal slices of dim 0.

    Other leaves (0-dim tensors, ints, None, ...) go to every microbatch unchanged.

    Args:
        leaves: flattened inputs; tensors are ``(batch, ...)``.
        num_microbatches: m >= 1.
        what: word used in error messages (``"input"``, ``"target"``).

    Returns:
        ``m`` lists, each like ``leaves`` with tensors of shape ``(batch // m, ...)``.

    Raises:
        PlanError: a tensor's dim 0 is not divisible by ``m``.
    """
    out: list[list[Any]] = [[] for _ in range(num_microbatches)]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            if leaf.shape[0] % num_microbatches:
                raise PlanError(
                    f"{what} leaf {i} has dim 0 of size {leaf.shape[0]}, not divisible by "
                    f"num_microbatches={num_microbatches}; pass a batch that is a multiple of "
                    f"{num_microbatches} or choose another num_microbatches")
            for mb, chunk in enumerate(leaf.chunk(num_microbatches, dim=0)):
                out[mb].append(chunk)
        else:
            for mb in range(num_microbatches):
                out[mb].append(leaf)
    return out


def split_tree(tree: Any, num_microbatches: int, what: str = "target") -> list[Any]:
    """:func:`split_leaves` for any pytree (e.g. a target tensor or a dict of tensors)."""
    leaves, spec = pytree.tree_flatten(tree)
    return [pytree.tree_unflatten(mb, spec) for mb in split_leaves(leaves, num_microbatches, what)]


def merge_leaves(per_mb: list[list[Any]]) -> list[Any]:
    """Gather flattened microbatch outputs into full-batch outputs.

    Tensors with ``dim >= 1`` are concatenated along dim 0; 0-dim tensors (for example a
    mean loss the model computes itself) are averaged, which equals the full-batch mean
    when microbatches are the same size; other values come from the first microbatch.
    """
    merged: list[Any] = []
    for parts in zip(*per_mb, strict=True):
        first = parts[0]
        if isinstance(first, torch.Tensor) and first.dim() >= 1:
            merged.append(torch.cat(parts, dim=0))
        elif isinstance(first, torch.Tensor):
            merged.append(torch.stack(parts).mean(dim=0))
        else:
            merged.append(first)
    return merged
