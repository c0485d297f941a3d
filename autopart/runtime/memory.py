"""Peak memory of a real step: the tensors a pipeline holds and the most a step allocates."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopart.core.memory import allocated_peak_bytes

__all__ = ["PeakMemory", "device_key", "measure_peak_bytes", "resident_bytes",
           "optimizer_tensors"]


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
    once, with its full size)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
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
