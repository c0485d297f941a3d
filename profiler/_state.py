"""Timing a model's own forward and backward without changing it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["kept_state"]


@contextlib.contextmanager
def kept_state(params: Iterable[torch.Tensor], buffers: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside the block, run the model as timing needs; on leaving (also on an error), each of
    ``params`` holds the ``.grad`` tensor it held on entry, each of ``buffers`` (BatchNorm
    statistics a training forward moves) its entry values, and the CPU and CUDA random
    states are as they were (dropout draws from them).

    A ``.grad`` tensor a backward accumulated into in place inside the block is the same
    object afterwards: give the parameters fresh gradients inside (``None`` or new zeros)
    where a held one must not change.
    """
    params = list(params)
    grads = [p.grad for p in params]
    buffers = list({id(b): b for b in buffers}.values())
    saved = [b.detach().clone() for b in buffers]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for b, data in zip(buffers, saved, strict=True):
                b.copy_(data)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
