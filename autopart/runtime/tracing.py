"""Recording a real step: each action's start and end per rank (the trace's data is in core)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from autopart.core.trace import TraceEvent

__all__ = ["ActionRecorder"]


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
