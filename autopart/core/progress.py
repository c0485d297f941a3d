"""The progress display: which phase of a long call runs (capture, profile, solve, ...) and for how long."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Iterator

from rich.console import Console
from rich.errors import LiveError
from rich.progress import Progress, ProgressColumn, SpinnerColumn, Task, TaskID, TextColumn
from rich.text import Text

__all__ = ["PhaseTime", "Display", "Phase", "progress", "phase", "display_enabled",
           "PROGRESS_ENV"]

#: ``0`` / ``off`` / ``no`` / ``false`` turns the display off; anything else leaves it to
#: whether the display's console (stderr by default) is a terminal.
PROGRESS_ENV = "AUTOPART_PROGRESS"
_OFF = ("0", "off", "no", "false")

#: Redraws per second while a phase runs: few, so that the redrawing thread takes next to
#: nothing from what the profiler times.
REFRESH_PER_S = 2.0

_ACTIVE: contextvars.ContextVar[Display | None] = contextvars.ContextVar(
    "autopart_progress", default=None)


@dataclasses.dataclass(frozen=True)
class PhaseTime:
    """One finished phase.

    Attributes:
        name: the phase (``"capture"``, ``"profile"``, ``"calibration"``, ``"loss cost"``,
            ``"split cost"``, ``"link"``, ``"solve"``, ``"codegen"``, ...).
        seconds: its wall time, s (``time.perf_counter``).
        depth: 0 for a phase started directly in the display, 1 for one started inside
            another phase, and so on.
        note: what the phase said of itself (``"from cache"``), or ``""``.
        failed: it ended with an exception.
    """

    name: str
    seconds: float
    depth: int
    note: str = ""
    failed: bool = False


def display_enabled(console: Console) -> bool:
    """Whether a display on ``console`` is drawn: not when ``$AUTOPART_PROGRESS`` is ``0``
    (``off``, ``no``, ``false``), not on a ``torchrun`` rank other than 0 (``$RANK``), not in
    a process started by ``multiprocessing`` (a benchmark's rank, a co-runner: its parent
    shows the phase), and otherwise only when ``console`` writes to a terminal."""
    if os.environ.get(PROGRESS_ENV, "").strip().lower() in _OFF:
        return False
    if os.environ.get("RANK", "0").strip() not in ("", "0"):
        return False
    if multiprocessing.parent_process() is not None:
        return False
    return console.is_terminal


class _StateColumn(SpinnerColumn):
    """A spinner while the phase runs, a check mark when it is done, a cross if it failed."""

    def render(self, task: Task) -> Text:
        if task.fields.get("failed"):
            return Text("✗", style="red")
        return super().render(task)  # type: ignore[return-value]


class _SecondsColumn(ProgressColumn):
    """The phase's elapsed time in seconds, with one decimal (``12.3 s``), and its note."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        text = Text(f"{elapsed or 0.0:6.1f} s", style="progress.elapsed")
        if task.fields.get("note"):
            text.append(f"  {task.fields['note']}", style="dim")
        return text


class Phase:
    """What a running phase can say about itself, while it runs (``with phase(...) as ph``)."""

    def __init__(self, display: Display, index: int) -> None:
        self._display, self._index = display, index

    def note(self, text: str) -> None:
        """Show ``text`` beside the phase (``"from cache"``); kept in its :class:`PhaseTime`."""
        self._display._note(self._index, text)

    def count(self, done: int, total: int | None) -> None:
        """Show ``done`` of ``total`` items (nodes profiled, steps run) beside the phase."""
        self._display._note(self._index, f"{done}/{total}" if total else str(done), live=True)


@dataclasses.dataclass
class _Row:
    name: str
    depth: int
    start: float
    task: TaskID | None
    seconds: float | None = None
    note: str = ""
    failed: bool = False


class Display:
    """One progress display: a row per phase, in the order the phases started, each with its
    elapsed time; drawn on ``console`` (by rich) only when ``enabled``.

    Attributes:
        console: where it is drawn.
        enabled: whether it is drawn; the phases are recorded either way.
    """

    def __init__(self, console: Console, enabled: bool) -> None:
        self.console, self.enabled = console, enabled
        self._rows: list[_Row] = []
        self._depth = 0
        self._bar: Progress | None = None

    @property
    def phases(self) -> tuple[PhaseTime, ...]:
        """The finished phases, in the order they started."""
        return tuple(PhaseTime(r.name, r.seconds, r.depth, r.note, r.failed)
                     for r in self._rows if r.seconds is not None)

    def _begin(self, name: str) -> int:
        bar = self._drawn()
        task = (None if bar is None else
                bar.add_task("  " * self._depth + name, total=1, note="", failed=False))
        self._rows.append(_Row(name, self._depth, time.perf_counter(), task))
        self._depth += 1
        return len(self._rows) - 1

    def _end(self, index: int, failed: bool) -> None:
        row = self._rows[index]
        row.seconds, row.failed = time.perf_counter() - row.start, failed
        self._depth -= 1
        if self._bar is not None and row.task is not None:
            self._bar.update(row.task, completed=1, failed=failed)

    def _note(self, index: int, text: str, live: bool = False) -> None:
        row = self._rows[index]
        if not live:
            row.note = text
        if self._bar is not None and row.task is not None:
            self._bar.update(row.task, note=text)

    def _drawn(self) -> Progress | None:
        """The rich display, started on the first phase (so a display without phases draws
        nothing); None when not enabled, or when another live display holds the console."""
        if self._bar is None and self.enabled:
            bar = Progress(_StateColumn(finished_text=Text("✓", style="green")),
                           TextColumn("{task.description}"), _SecondsColumn(),
                           console=self.console, refresh_per_second=REFRESH_PER_S)
            try:
                bar.start()
            except LiveError:  # the caller's own live display on this console: stay quiet
                self.enabled = False
                return None
            self._bar = bar
        return self._bar

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextlib.contextmanager
def progress(console: Console | None = None, *, enabled: bool | None = None,
             ) -> Iterator[Display]:
    """The display the phases inside the ``with`` block report to.

    Inside another ``progress`` block (a CLI command around ``autopart.compile``) the outer
    display is reused, so one call's phases show as one list.

    Args:
        console: where to draw; default a new ``rich`` console on stderr.
        enabled: draw it or not; default :func:`display_enabled` of the console.

    Yields:
        The display; its :attr:`Display.phases` lists the phases run so far.
    """
    active = _ACTIVE.get()
    if active is not None:
        yield active
        return
    console = console if console is not None else Console(stderr=True)
    display = Display(console, display_enabled(console) if enabled is None else enabled)
    token = _ACTIVE.set(display)
    try:
        yield display
    finally:
        _ACTIVE.reset(token)
        display._close()


@contextlib.contextmanager
def phase(name: str) -> Iterator[Phase]:
    """Show ``name`` as the running phase, with its elapsed time, until the block ends.

    Outside any :func:`progress` block a display is opened for this phase (and those inside
    it) and closed after. The display is drawn only where :func:`display_enabled` says so;
    the phase runs the same either way.

    Yields:
        A :class:`Phase`, to add a note or a count to the row.
    """
    display = _ACTIVE.get()
    if display is None:
        with progress(), phase(name) as inner:
            yield inner
        return
    index = display._begin(name)
    failed = True
    try:
        yield Phase(display, index)
        failed = False
    finally:
        display._end(index, failed)
