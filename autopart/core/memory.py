"""Memory measurement, the one module for it: the most a call allocates on the CPU or a CUDA
device, the bytes a set of tensors holds, and a step's typed peak (shared by the profiler,
which sizes each node's backward and the loss, and the runtimes, which measure a step)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocated_peak_bytes", "PeakMemory", "device_key", "measure_peak_bytes", "resident_bytes",
           "optimizer_tensors", "quiet_cpu_profiler", "KINETO_QUIET_LEVEL"]

#: Kineto's log threshold while autopart measures memory: above ``USDT`` (5), the highest
#: level it logs at (kineto's ``libkineto/include/ILoggerObserver.h``, ``LoggerOutputType``).
KINETO_QUIET_LEVEL = "6"

_kineto_configured = False


@contextlib.contextmanager
def quiet_cpu_profiler() -> Iterator[None]:
    """Keep torch's profiler from printing while autopart measures CPU memory with it.

    Two sources print on stderr during such a measurement, both C++ logging:

    * kineto (torch's profiler library) logs ``USDT: ... profiler_start`` and
      ``profiler_stop`` for every profiled call at its ``USDT`` level, above the ``ERROR``
      threshold torch sets. Kineto reads its threshold once per process, from
      ``$KINETO_LOG_LEVEL``, when the profiler is first used (``libkineto_init``); no API
      changes it later. So before the process's first profiled call, and only if the user
      has not set ``$KINETO_LOG_LEVEL``, the variable is set to :data:`KINETO_QUIET_LEVEL`
      for the duration of the ``with`` block and removed after, so child processes started
      later do not inherit it. Kineto keeps that threshold for the rest of the process (its
      own messages to a later ``torch.profiler`` session are then silent too; set
      ``$KINETO_LOG_LEVEL`` to keep them). If the process used the profiler before, kineto
      already has its threshold and nothing changes.
    * c10's ``CPUAllocator.cpp`` warns ("Memory block of unknown size was allocated before
      the profiling started") when a block allocated before the profiled call is freed
      during it. The garbage collector freeing an earlier cycle is the way that happens
      without the measured code asking for it, so automatic collection is paused inside the
      block (``gc.disable``) and restored after; what the measured code frees itself is
      its own. A reference cycle the measured code makes and drops is then freed after the
      block, so the figure counts it (it can only be high). (c10's level,
      ``$TORCH_CPP_LOG_LEVEL``, is read when torch is imported, too late to set here.)
    """
    global _kineto_configured
    set_here = not _kineto_configured and "KINETO_LOG_LEVEL" not in os.environ
    _kineto_configured = True
    if set_here:
        os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET_LEVEL
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        if set_here and os.environ.get("KINETO_LOG_LEVEL") == KINETO_QUIET_LEVEL:
            del os.environ["KINETO_LOG_LEVEL"]


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
    do not time such a call. Torch's profiler prints nothing meanwhile
    (:func:`quiet_cpu_profiler`).

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
    with quiet_cpu_profiler(), profile(activities=[ProfilerActivity.CPU],
                                       profile_memory=True) as prof:
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


@dataclass(frozen=True, slots=True)
class PeakMemory:
    """Peak tensor memory of one measured step (``train_step(measure_memory=True)``), bytes.

    Attributes:
        by_rank: pipeline rank -> peak bytes of the device that rank runs on, for every rank
            of the plan whose device was measured. A distributed step gathers each rank's own
            figure onto every rank; a one-process step gives each rank its device's figure,
            so ranks sharing a device (every rank on the CPU) show the same, whole-device peak.
        by_device: :func:`device_key` -> peak bytes of the devices this process measured
            (one-process: every device of the pipeline; distributed: this rank's device).
    """

    by_rank: Mapping[int, int]
    by_device: Mapping[str, int]


def device_key(device: torch.device) -> str:
    """The key :func:`measure_peak_bytes` reports ``device`` under: ``"cpu"`` for any CPU
    device (the whole process is one), else ``str(device)`` (``"cuda:0"``)."""
    return "cpu" if device.type == "cpu" else str(device)


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (a storage shared by views counts
    once, with its full size; a DTensor counts its local shard's storage)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        to_local = getattr(t, "to_local", None)  # a DTensor (ZeRO shards): this rank's part
        if callable(to_local):
            t = to_local()
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        seen.setdefault((str(t.device), st.data_ptr()), st.nbytes())
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in ``optimizer``'s state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def measure_peak_bytes(fn: Callable[[], Any], devices: Sequence[torch.device],
                       resident: Iterable[torch.Tensor] = ()) -> tuple[Any, dict[str, int]]:
    """Run ``fn()`` once and measure the most tensor memory held on each device meanwhile.

    CUDA: the bytes of the ``resident`` tensors on the device plus the most the step
    allocated above what the device held before it (``torch.cuda.max_memory_allocated``
    after ``torch.cuda.reset_peak_memory_stats``, minus ``torch.cuda.memory_allocated``
    before; the caching allocator's block sizes, cuBLAS workspaces made during the step
    included). Other tensors on the device (another pipeline, the user's reference model)
    are not this pipeline's and are not counted.

    CPU: the most ``fn`` held allocated (:func:`autopart.core.memory.allocated_peak_bytes`:
    the profiler's allocation records, summed in time order) added to the bytes of the
    ``resident`` tensors on the CPU (what was held before: parameters, gradients, optimizer
    state; distinct storages, see :func:`resident_bytes`). A storage allocated before ``fn``
    and freed during it stays counted, so the figure can only be high, never low. The whole
    process is one CPU device. The profiler slows ``fn``: time it in other steps.

    Args:
        fn: one step.
        devices: the devices to measure (repeats are ignored).
        resident: the pipeline's tensors alive before ``fn`` (parameters, gradients,
            buffers, optimizer state).

    Returns:
        ``(fn's result, {str(device): peak bytes})``.
    """
    devs = list(dict.fromkeys(torch.device(d) for d in devices))
    cuda = [d for d in devs if d.type == "cuda"]
    held = [t for t in resident if t is not None]
    before: dict[torch.device, int] = {}
    for d in cuda:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
        before[d] = int(torch.cuda.memory_allocated(d))
    peaks: dict[str, int] = {}
    if any(d.type == "cpu" for d in devs):
        base = resident_bytes(t for t in held if t.device.type == "cpu")
        out, peak = allocated_peak_bytes(fn, torch.device("cpu"))
        peaks["cpu"] = base + peak
    else:
        out = fn()
    for d in cuda:
        torch.cuda.synchronize(d)
        own = resident_bytes(t for t in held if t.device == d)
        peaks[str(d)] = own + int(torch.cuda.max_memory_allocated(d)) - before[d]
    return out, peaks
