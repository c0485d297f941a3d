"""Recording a real step: each action's start and end per rank, and the peak memory it held."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from autopart.core.memory import allocated_peak_bytes
from autopart.core.trace import TraceEvent

__all__ = ["ActionRecorder", "measure_peak_bytes", "resident_bytes", "optimizer_tensors"]


class ActionRecorder:
    """Start and end of the actions one process runs during one step.

    On CPU a slice is timed with ``time.perf_counter`` around the action (CPU work is
    synchronous, so this is when it ran). On CUDA two events are recorded on the stream the
    action is issued to and read after the step (:meth:`events` synchronises): the slice is
    when the GPU ran it, not when Python issued it. Times are µs from :meth:`start` (per
    process; every rank of a distributed step starts after the same barrier).

    Between two compute actions of a rank, the time is a ``"wait"`` slice: posting sends,
    waiting for the values to receive and the runtime's own work between actions (CPU only;
    on CUDA the streams' gaps show it).

    Args:
        rank_of_stage: the pipeline rank that runs stage ``s`` (one track per rank).
    """

    def __init__(self, rank_of_stage: Callable[[int], int]) -> None:
        self.rank_of_stage = rank_of_stage
        self._t0 = time.perf_counter()
        self._cpu: list[TraceEvent] = []
        self._cuda: list[tuple[int, str, Any, Any, Any]] = []  # rank, name, ev0, ev1, ref
        self._refs: dict[torch.device, Any] = {}
        self._last_end: dict[int, float] = {}

    def start(self, devices: Iterable[torch.device] = ()) -> None:
        """Set time zero now (after a barrier, in a distributed step)."""
        for d in devices:
            if d.type == "cuda":
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.current_stream(d))
                self._refs[d] = ev
        self._t0 = time.perf_counter()

    def now_us(self) -> float:
        """µs since :meth:`start` on this process's clock."""
        return (time.perf_counter() - self._t0) * 1e6

    @contextlib.contextmanager
    def span(self, rank: int, name: str, stream: Any = None,
             waits: bool = True) -> Iterator[None]:
        """Time the body as slice ``name`` on ``rank``'s track.

        Args:
            rank: the track.
            name: ``"1F3"`` for a compute action, else a word of
                :data:`autopart.core.trace.COMM_KINDS`.
            stream: the CUDA stream the body issues its work to; None: CPU timing.
            waits: record the time since this rank's previous slice as ``"wait"``.
        """
        if stream is not None:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record(stream)
            try:
                yield
            finally:
                ev1.record(stream)
                ref = self._refs.get(stream.device)
                if ref is None:
                    ref = self._refs[stream.device] = ev0
                self._cuda.append((rank, name, ev0, ev1, ref))
            return
        start = self.now_us()
        last = self._last_end.get(rank)
        if waits and last is not None and start > last:
            self._cpu.append(TraceEvent(rank, "wait", last, start))
        try:
            yield
        finally:
            end = self.now_us()
            self._cpu.append(TraceEvent(rank, name, start, end))
            self._last_end[rank] = end

    def events(self) -> list[TraceEvent]:
        """Every slice recorded so far (synchronises CUDA devices with events)."""
        out = list(self._cpu)
        for rank, name, ev0, ev1, ref in self._cuda:
            ev1.synchronize()
            start = ref.elapsed_time(ev0) * 1e3
            out.append(TraceEvent(rank, name, start, start + ev0.elapsed_time(ev1) * 1e3))
        return out


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
