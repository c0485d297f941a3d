"""The most memory a call allocates, on the CPU or a CUDA device (shared by the profiler,
which sizes each node's backward, and the runtimes, which measure a step's peak)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocated_peak_bytes"]


def allocated_peak_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """Run ``fn()`` once; the most bytes it held allocated on ``device`` at any moment, above
    what the device held when it started.

    CPU: torch's CPU allocator reports each allocation and free to the profiler
    (``torch.profiler.profile(profile_memory=True)``); the running sum of those records, in
    time order, is what ``fn`` allocated and has not freed, and the result is its largest
    value. Only the frees of blocks allocated during ``fn`` count (matched by address): a
    block allocated before ``fn`` and freed during it never lowers the figure (the profiler
    reports such a free when the block was allocated under an earlier profiling session).
    On equal timestamps an allocation is taken before a free. The whole process counts: run
    nothing else meanwhile. The profiler slows ``fn`` (most on its first use in a process):
    do not time such a call.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``,
    minus ``torch.cuda.memory_allocated`` before (block sizes of the caching allocator).

    Other devices (``meta``): ``fn()`` runs and the figure is 0.

    Returns:
        ``(fn's result, bytes)``.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = int(torch.cuda.memory_allocated(device))
        out = fn()
        torch.cuda.synchronize(device)
        return out, int(torch.cuda.max_memory_allocated(device)) - before
    if device.type != "cpu":
        return fn(), 0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    # (time, -bytes: allocations first on a tie, address) of each allocation and free
    records: list[tuple[int, int, int]] = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        kind, fields = event.typed
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            records.append((event.start_time_ns, -fields.alloc_size, fields.ptr))
    records.sort()
    live = peak = 0
    held: set[int] = set()
    for _, neg_bytes, ptr in records:
        if neg_bytes < 0:
            held.add(ptr)
        elif ptr in held:
            held.discard(ptr)
        else:
            continue  # allocated before fn
        live -= neg_bytes
        peak = max(peak, live)
    return out, peak
