"""Traces: per-rank start and end of every action of a step, measured or predicted.

A trace is data the runtimes record (a real step) and the simulator writes (the predicted
step of the same plan); both round-trip through Chrome trace-event JSON, which
``ui.perfetto.dev`` and ``chrome://tracing`` open: one process per rank (``pid``), one
complete event (``"ph": "X"``) per action, times in µs from the step's start
(format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from autopart.core.errors import PlanError
from autopart.core.jsonio import write_text_atomic

__all__ = ["TraceEvent", "Trace", "ACTION_KINDS", "COMM_KINDS", "parse_action"]

#: Compute actions of a schedule (``autopart.core.schedule``): forward, full backward,
#: input-gradient and weight-gradient backward.
ACTION_KINDS = ("F", "B", "I", "W")
#: Communication and waiting: ``send``/``recv`` (posting a transfer or moving a value),
#: ``wait`` (blocked on a transfer), ``loss`` (the loss on the last stage), ``reduce``
#: (gradient reduction after the schedule).
COMM_KINDS = ("send", "recv", "wait", "loss", "reduce")

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
    """

    rank: int
    name: str
    start_us: float
    end_us: float

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise PlanError(f"trace event {self.name!r} has rank {self.rank}; ranks are >= 0")
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
        """The trace as a Chrome trace-event JSON object (``{"traceEvents": [...]}``)."""
        out: list[dict[str, Any]] = []
        for r in range(self.num_ranks):
            out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                        "args": {"name": f"rank {r}"}})
        for e in sorted(self.events, key=lambda e: (e.rank, e.start_us)):
            act = e.action
            cat = act[1] if act is not None else e.name.split(" ", 1)[0]
            out.append({"ph": "X", "name": e.name, "cat": cat, "pid": e.rank, "tid": 0,
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
        events = []
        for i, ev in enumerate(data["traceEvents"]):
            if not isinstance(ev, dict) or ev.get("ph") != "X":
                continue
            try:
                start = float(ev["ts"])
                events.append(TraceEvent(int(ev["pid"]), str(ev["name"]), start,
                                         start + float(ev["dur"])))
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
