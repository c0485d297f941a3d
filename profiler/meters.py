"""Byte meters: tensor sizes in nested values, and the bytes autograd saves for the backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["tensor_leaves", "tree_nbytes", "storage_key", "SavedTensorMeter"]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested value (tuples, lists, dicts), in pytree order."""
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def tree_nbytes(value: Any) -> int:
    """Sum of ``numel * element_size`` over the tensors of a nested value, bytes.

    A view counts its own logical size, not its base's.
    """
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value))


def strided_nbytes(value: Any) -> int:
    """Sum of ``numel * element_size`` over the tensors of a nested value that are not
    contiguous, bytes (what making each contiguous allocates)."""
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value)
               if not t.is_contiguous())


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """``(device, data_ptr)`` of a tensor's untyped storage; None for storage-less tensors."""
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


class SavedTensorMeter:
    """Pack/unpack hooks for ``torch.autograd.graph.saved_tensors_hooks`` that size what is saved.

    Rule: every tensor autograd packs is keyed by its untyped storage; each storage counts
    once, with its full ``nbytes`` (a saved view keeps its whole base alive). Storages in
    ``excluded`` (the parameters and buffers the node reads) are not counted. Inputs and
    outputs of the node that autograd saves are counted: the backward keeps them alive.
    """

    def __init__(self, excluded: set[tuple[str, int]]) -> None:
        """Start an empty meter.

        Args:
            excluded: storage keys (see :func:`storage_key`) never to count.
        """
        self._excluded = excluded
        self._seen: dict[tuple[str, int], int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Record ``t``'s storage; the tensor itself is what autograd keeps."""
        key = storage_key(t)
        if key is not None and key not in self._excluded and key not in self._seen:
            self._seen[key] = t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        """Give back the packed tensor unchanged."""
        return t

    @property
    def keys(self) -> set[tuple[str, int]]:
        """Storage keys counted so far."""
        return set(self._seen)

    @property
    def sizes(self) -> dict[tuple[str, int], int]:
        """Storage key -> bytes of each storage counted so far."""
        return dict(self._seen)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the distinct, non-excluded storages saved so far."""
        return sum(self._seen.values())
