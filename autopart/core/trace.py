"""Traces: per-rank start and end of every action of a step, measured or predicted.

A trace is data the runtimes record (a real step) and the simulator writes (the predicted
step of the same plan); both round-trip through Chrome trace-event JSON, which
``ui.perfetto.dev`` and ``chrome://tracing`` open: one process per rank (``pid``), one
complete event (``"ph": "X"``) per action, times in µs from the step's start
(format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).

Each rank has two lanes (:data:`LANES`), a thread each in the JSON: ``"compute"`` (its
actions, the waits between them, the loss, the end-of-step ``reduce``, and ``"exposed ..."``
slices nested where its thread was blocked on a collective) and ``"comm"`` (its
collectives, each from issue to completion; slices that overlap go on further threads
``"comm 2"``, ``"comm 3"``, ... so that every thread's slices nest, as Perfetto requires).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from autopart.core.errors import PlanError
from autopart.core.jsonio import write_text_atomic

__all__ = ["TraceEvent", "Trace", "ACTION_KINDS", "COMM_KINDS", "EXPOSED_KINDS", "LANES",
           "parse_action"]

#: Compute actions of a schedule (``autopart.core.schedule``): forward, full backward,
#: input-gradient and weight-gradient backward.
ACTION_KINDS = ("F", "B", "I", "W")
#: Communication and waiting: ``send``/``recv`` (posting a transfer or moving a value),
#: ``wait`` (blocked on a transfer), ``loss`` (the loss on the last stage), ``reduce``
#: (gradient reduction after the schedule); on the comm lane the collectives
#: ``all_reduce``, ``all_gather``, ``reduce_scatter`` (issue to completion); on the compute
#: lane ``exposed`` (the rank's thread blocked on a collective: ``"exposed all_gather
#: layers.0"``).
COMM_KINDS = ("send", "recv", "wait", "loss", "reduce", "all_reduce", "all_gather",
              "reduce_scatter", "exposed")
#: Compute-lane slices that count as exposed communication (:meth:`Trace.exposed_comm_us`):
#: the rank's thread blocked on a collective.
EXPOSED_KINDS = ("exposed",)
#: A rank's lanes: its thread's work (``"compute"``) and its collectives (``"comm"``).
LANES = ("compute", "comm")

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


def parse_action(name: str) -> tuple[int, str, int] | None:
    """``"1F3"`` -> ``(1, "F", 3)``; None for names that are not compute actions."""
    hit = _ACTION.match(name)
    return None if hit is None else (int(hit.group(1)), hit.group(2), int(hit.group(3)))


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One slice of a rank's timeline.

    Attributes:
        rank: pipeline rank that ran it.
        name: ``"<stage><kind><mb>"`` for compute actions (``"1F3"``), else a
            :data:`COMM_KINDS` word, optionally followed by details (``"send 1F3"``).
        start_us: start, µs from the step's start on that rank.
        end_us: end, µs; at least ``start_us``.
        lane: ``"compute"`` (default) or ``"comm"`` (a collective, issue to completion);
            see :data:`LANES`.
    """

    rank: int
    name: str
    start_us: float
    end_us: float
    lane: str = "compute"

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise PlanError(f"trace event {self.name!r} has rank {self.rank}; ranks are >= 0")
        if self.lane not in LANES:
            raise PlanError(f"trace event {self.name!r} on rank {self.rank} is on lane "
                            f"{self.lane!r}; lanes are {LANES}")
        if not self.end_us >= self.start_us:
            raise PlanError(f"trace event {self.name!r} on rank {self.rank} ends at "
                            f"{self.end_us} µs before it starts at {self.start_us} µs")

    @property
    def duration_us(self) -> float:
        """``end_us - start_us``."""
        return self.end_us - self.start_us

    @property
    def action(self) -> tuple[int, str, int] | None:
        """``(stage_index, kind, mb_index)`` for compute actions, else None."""
        return parse_action(self.name)

    @property
    def kind(self) -> str:
        """``"F"``/``"B"``/``"I"``/``"W"`` for compute actions, else the name's first word
        (``"all_gather"``, ``"exposed"``, ``"wait"`` ...)."""
        act = self.action
        return act[1] if act is not None else self.name.split(" ", 1)[0]


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals, µs."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass(frozen=True)
class Trace:
    """The timeline of one step: every rank's events.

    Attributes:
        events: all events, any order (:meth:`of_rank` sorts).
        source: ``"measured:<device>"`` or ``"predicted"``.
        metadata: free JSON-able facts (plan fingerprint, schedule kind, m, peak bytes ...).
    """

    events: tuple[TraceEvent, ...]
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        """1 + the largest rank with an event (0 for an empty trace)."""
        return 1 + max((e.rank for e in self.events), default=-1)

    @property
    def step_time_us(self) -> float:
        """From the earliest start to the latest end over all ranks, µs."""
        if not self.events:
            return 0.0
        return max(e.end_us for e in self.events) - min(e.start_us for e in self.events)

    def of_rank(self, rank: int) -> list[TraceEvent]:
        """Rank ``rank``'s events by start time."""
        return sorted((e for e in self.events if e.rank == rank),
                      key=lambda e: (e.start_us, e.end_us))

    def actions(self, rank: int) -> list[str]:
        """Rank ``rank``'s compute actions (``"1F3"`` ...) in the order they started."""
        return [e.name for e in self.of_rank(rank) if e.action is not None]

    def busy_us(self, rank: int) -> float:
        """Time rank ``rank`` spent in compute actions, µs."""
        return sum(e.duration_us for e in self.events if e.rank == rank and e.action is not None)

    def lane(self, lane: str) -> Trace:
        """This trace with only ``lane``'s events (``"compute"``: what traces held before
        collectives got a lane of their own)."""
        return Trace(tuple(e for e in self.events if e.lane == lane), self.source,
                     dict(self.metadata))

    def comm_us(self, rank: int) -> float:
        """Time rank ``rank`` had a collective in flight (the union of its comm-lane slices,
        each from issue to completion), µs; 0.0 where none was recorded (a predicted trace,
        or a step without data-parallel collectives)."""
        return _union_us([(e.start_us, e.end_us) for e in self.events
                          if e.rank == rank and e.lane == "comm"])

    def exposed_comm_us(self, rank: int) -> float:
        """Exposed communication of rank ``rank``, µs: the union of its compute-lane
        ``"exposed ..."`` slices (:data:`EXPOSED_KINDS`), the time its thread was blocked on
        a collective: waiting for a gradient bucket, inside an FSDP all-gather or
        reduce-scatter, in the collectives after the step (tied sums, dp means). Each lies
        inside one of its comm-lane slices, so it is at most :meth:`comm_us`. Not counted:
        waits for pipeline transfers (``wait``), the bookkeeping of the end-of-step
        ``reduce`` around its collectives, the loss's broadcast, and tensor-parallel
        collectives inside an action."""
        return _union_us([(e.start_us, e.end_us) for e in self.events
                          if e.rank == rank and e.lane == "compute"
                          and e.kind in EXPOSED_KINDS])

    def comm_by_rank(self) -> dict[int, tuple[float, float]]:
        """Per rank, ``(comm_us, exposed_comm_us)``, µs."""
        return {r: (self.comm_us(r), self.exposed_comm_us(r)) for r in range(self.num_ranks)}

    def stage_busy_us(self) -> dict[int, float]:
        """Per stage, the time spent in its compute actions, µs."""
        out: dict[int, float] = {}
        for e in self.events:
            act = e.action
            if act is not None:
                out[act[0]] = out.get(act[0], 0.0) + e.duration_us
        return dict(sorted(out.items()))

    # ---- Chrome trace-event JSON ------------------------------------------------------
    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace-event JSON object (``{"traceEvents": [...]}``): a
        process per rank, thread 0 its compute lane, threads 1, 2, ... its comm lane
        (``"comm"``, ``"comm 2"`` ...: a slice goes on the first of them whose slices end
        before it starts, so overlapping collectives never share a thread)."""
        out: list[dict[str, Any]] = []
        for r in range(self.num_ranks):
            out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                        "args": {"name": f"rank {r}"}})
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0,
                        "args": {"name": "compute"}})
        threads: dict[int, list[float]] = {}  # rank -> end of each comm thread's last slice
        order = sorted(self.events, key=lambda e: (e.rank, e.lane != "compute", e.start_us,
                                                   -e.end_us))
        for e in order:
            tid = 0
            if e.lane == "comm":
                ends = threads.setdefault(e.rank, [])
                tid = next((k for k, end in enumerate(ends) if end <= e.start_us), len(ends))
                if tid == len(ends):
                    ends.append(e.end_us)
                    out.append({"ph": "M", "name": "thread_name", "pid": e.rank, "tid": tid + 1,
                                "args": {"name": "comm" if tid == 0 else f"comm {tid + 1}"}})
                ends[tid] = e.end_us
                tid += 1
            out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": e.rank, "tid": tid,
                        "ts": round(e.start_us, 3), "dur": round(e.duration_us, 3)})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, **self.metadata}}

    @classmethod
    def from_chrome(cls, data: Any) -> Trace:
        """Read what :meth:`to_chrome` wrote.

        Raises:
            PlanError: not a trace-event object, or an event without rank, name, ts or dur.
        """
        if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
            raise PlanError("not a Chrome trace: expected a JSON object with a 'traceEvents' "
                            "list (write one with autopart.trace.save)")
        other = data.get("otherData") or {}
        comm_threads = {(ev.get("pid"), ev.get("tid")) for ev in data["traceEvents"]
                        if isinstance(ev, dict) and ev.get("ph") == "M"
                        and ev.get("name") == "thread_name"
                        and str((ev.get("args") or {}).get("name", "")).startswith("comm")}
        events = []
        for i, ev in enumerate(data["traceEvents"]):
            if not isinstance(ev, dict) or ev.get("ph") != "X":
                continue
            try:
                start = float(ev["ts"])
                lane = "comm" if (ev.get("pid"), ev.get("tid")) in comm_threads else "compute"
                events.append(TraceEvent(int(ev["pid"]), str(ev["name"]), start,
                                         start + float(ev["dur"]), lane))
            except (KeyError, TypeError, ValueError) as exc:
                raise PlanError(f"trace event {i} lacks a valid pid, name, ts or dur "
                                f"({exc}); the file is not an autopart trace") from exc
        meta = {k: v for k, v in other.items() if k != "source"} if isinstance(other, dict) else {}
        return cls(tuple(events), str(other.get("source", "")) if isinstance(other, dict)
                   else "", meta)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_chrome` to ``path`` atomically (open it in ``ui.perfetto.dev``)."""
        write_text_atomic(path, json.dumps(self.to_chrome(), indent=None, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace :meth:`save` wrote.

        Raises:
            PlanError: the file is not JSON or not a trace.
            OSError: it cannot be read.
        """
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise PlanError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}); "
                                "expected a trace written by autopart.trace.save") from exc
        return cls.from_chrome(data)
