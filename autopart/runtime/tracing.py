"""Recording a real step: each action's start and end per rank, and each collective's (the
trace's data is in core)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from autopart.core.trace import TraceEvent

__all__ = ["ActionRecorder", "CollectiveTimer", "events_from_json", "events_to_json"]

_T = TypeVar("_T")


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

    Collectives (CPU timing, :class:`CollectiveTimer`) go on the rank's comm lane, from issue
    to completion (:meth:`comm` around one run to completion, :meth:`issued` /
    :meth:`waited` for an asynchronous one), and the time the rank's thread is blocked on
    one on its compute lane as ``"exposed <name>"`` (:meth:`exposed`, :meth:`waiting`),
    nested in the slice that waited and never a ``"wait"`` of its own.

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
        # asynchronous collectives: [rank, name, issued, completed (the future's callback),
        # wait returned, wait started], µs
        self._open: list[list[Any]] = []

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

    # ---- collectives (CPU timing) ------------------------------------------------------
    @contextlib.contextmanager
    def exposed(self, rank: int, name: str) -> Iterator[None]:
        """Time the body as ``"exposed <name>"`` on ``rank``'s compute lane: its thread is
        blocked on a collective (nested in whatever slice holds it; the waits between
        actions are not touched)."""
        start = self.now_us()
        try:
            yield
        finally:
            self._cpu.append(TraceEvent(rank, f"exposed {name}", start, self.now_us()))

    @contextlib.contextmanager
    def comm(self, rank: int, name: str) -> Iterator[None]:
        """Time the body as slice ``name`` on ``rank``'s comm lane (a collective run to
        completion by the body)."""
        start = self.now_us()
        try:
            yield
        finally:
            self._cpu.append(TraceEvent(rank, name, start, self.now_us(), "comm"))

    def issued(self, rank: int, name: str, work: Any) -> int:
        """An asynchronous collective ``name`` of ``rank`` was issued now; ``work`` is its
        ``torch.distributed`` work object, whose future marks the completion (its callback
        runs on the backend's thread). Returns the slot :meth:`waiting` and :meth:`waited`
        take."""
        slot = len(self._open)
        entry: list[Any] = [rank, name, self.now_us(), None, None, None]
        self._open.append(entry)
        future = getattr(work, "get_future", None)
        if future is not None:
            try:
                future().add_done_callback(lambda _: entry.__setitem__(3, self.now_us()))
            except RuntimeError:  # a backend without futures: the wait's return marks it
                pass
        return slot

    def waiting(self, slot: int) -> None:
        """The rank's thread starts waiting for the collective of ``slot`` now."""
        self._open[slot][5] = self.now_us()

    def waited(self, slot: int) -> None:
        """The wait on the collective of ``slot`` returned now (its completion at the
        latest)."""
        self._open[slot][4] = self.now_us()

    def events(self) -> list[TraceEvent]:
        """Every slice recorded so far (synchronises CUDA devices with events)."""
        out = list(self._cpu)
        for rank, name, start, done, waited, waiting in self._open:
            ends = [t for t in (done, waited) if t is not None]
            if not ends:  # never waited for nor completed (an aborted step): left out
                continue
            end = max(start, min(ends))
            out.append(TraceEvent(rank, name, start, end, "comm"))
            if waiting is not None:  # blocked from the wait's start to the completion
                out.append(TraceEvent(rank, f"exposed {name}", min(waiting, end), end))
        for rank, name, ev0, ev1, ref in self._cuda:
            ev1.synchronize()
            start = ref.elapsed_time(ev0) * 1e3
            out.append(TraceEvent(rank, name, start, start + ev0.elapsed_time(ev1) * 1e3))
        return out


class CollectiveTimer:
    """Where one rank's collectives report during a traced step: the FSDP2 all-gathers and
    reduce-scatters (:func:`autopart.runtime._torch_private.time_fsdp_collectives`) and
    ZeRO-0's gradient buckets (:class:`autopart.runtime.distributed._grad_buckets.
    GradBuckets`) hold one, and the pipeline attaches its recorder for a traced step. Off
    (no recorder, or a CUDA device, whose collectives are not timed here), a collective
    costs one ``is None`` test.

    Attributes:
        recorder: the step's recorder, or None (not tracing).
        track: this rank's pipeline rank (its lanes in the trace).
    """

    def __init__(self) -> None:
        self.recorder: ActionRecorder | None = None
        self.track = 0

    def attach(self, recorder: ActionRecorder | None, track: int, device: torch.device) -> None:
        """Record into ``recorder`` as ``track`` (None: stop); CPU devices only."""
        self.recorder = recorder if device.type == "cpu" else None
        self.track = track

    def blocking(self, name: str, call: Callable[[], _T]) -> _T:
        """Run ``call``, a collective that returns when it is done (FSDP2's on CPU): its
        whole time is on the comm lane and exposed on the compute lane."""
        rec = self.recorder
        if rec is None:
            return call()
        with rec.comm(self.track, name), rec.exposed(self.track, name):
            return call()

    def issued(self, name: str, work: Any) -> int | None:
        """An asynchronous collective was issued now (:meth:`ActionRecorder.issued`); its
        slot, or None when not recording."""
        rec = self.recorder
        return None if rec is None else rec.issued(self.track, name, work)

    def wait(self, slot: int | None, work: Any) -> None:
        """``work.wait()``; when recording, exposed on the compute lane from the wait's
        start to the collective's completion (a wait that returns later, once the thread
        runs again, is not charged beyond it)."""
        rec = self.recorder
        if rec is None or slot is None:
            work.wait()
            return
        rec.waiting(slot)
        work.wait()
        rec.waited(slot)


def events_to_json(events: Iterable[TraceEvent]) -> bytes:
    """Trace events as JSON rows ``[rank, name, start_us, end_us, lane]`` (never pickle)."""
    return json.dumps([[e.rank, e.name, e.start_us, e.end_us, e.lane] for e in events]).encode()


def events_from_json(blob: bytes) -> list[TraceEvent]:
    """What :func:`events_to_json` wrote."""
    return [TraceEvent(int(r), str(n), float(a), float(b), str(lane))
            for r, n, a, b, lane in json.loads(blob)]
