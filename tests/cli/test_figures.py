"""autopart.apps.figures: the Gantt timeline with per-rank peaks, and the per-stage bars."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from autopart.apps.figures import gantt, stage_bars
from autopart.core.errors import UsageError
from autopart.core.trace import Trace, TraceEvent

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def _trace() -> Trace:
    return Trace((TraceEvent(0, "0F0", 0, 10), TraceEvent(1, "1F0", 12, 20),
                  TraceEvent(1, "loss", 20, 21), TraceEvent(0, "wait", 10, 30),
                  TraceEvent(0, "0B0", 30, 50)), "measured:cpu")


def test_gantt_draws_a_png_and_needs_a_trace(tmp_path: Path) -> None:
    png = gantt(tmp_path / "t.png", [("measured", _trace())],
                peaks=[("predicted", [10, 20]), ("measured", [11, 19])])
    assert png.read_bytes()[:8] == PNG
    with pytest.raises(UsageError, match="at least one"):
        gantt(tmp_path / "u.png", [])


def test_stage_bars_draws_a_png(tmp_path: Path) -> None:
    ranks = [SimpleNamespace(peak_memory_bytes=10 * 2**20), SimpleNamespace(peak_memory_bytes=2**22)]
    plan = SimpleNamespace(ranks=ranks)
    trace = _trace()
    stage_bars(tmp_path / "s.png", plan, SimpleNamespace(trace=trace), trace, {"autopart": plan},
               {"autopart": SimpleNamespace(peak_bytes=[11 * 2**20, 5 * 2**20])})
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG
