"""The progress display: phases recorded in order with their elapsed times, drawn only on a
terminal and never with AUTOPART_PROGRESS=0."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from autopart.core.progress import display_enabled, phase, progress


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100), out


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def _run_phases() -> None:
    with phase("capture"):
        pass
    with phase("profile") as shown:
        shown.note("from cache")
        with phase("calibration") as inner:
            inner.count(3, 7)
    with pytest.raises(ValueError), phase("solve"):
        raise ValueError("no plan")
    with phase("codegen"):
        pass


@pytest.fixture(autouse=True)
def _no_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOPART_PROGRESS", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_phases_are_recorded_in_order_with_their_times_and_drawn_on_a_terminal() -> None:
    console, out = _terminal()
    with progress(console) as display:
        assert display.enabled
        _run_phases()
    got = [(p.name, p.depth, p.note, p.failed) for p in display.phases]
    assert got == [("capture", 0, "", False), ("profile", 0, "from cache", False),
                   ("calibration", 1, "", False), ("solve", 0, "", True),
                   ("codegen", 0, "", False)]
    assert all(p.seconds >= 0 for p in display.phases)
    by_name = {p.name: p.seconds for p in display.phases}
    assert by_name["profile"] >= by_name["calibration"]  # the outer phase holds the inner
    # the last frame drawn: one row per phase, in order, each with its seconds
    last = _plain(out.getvalue()).split("\r")[-1]
    rows = [line for line in last.splitlines() if line.strip()]
    assert [r.split()[1] for r in rows] == ["capture", "profile", "calibration", "solve", "codegen"]
    assert all(re.search(r"\d+\.\d s", r) for r in rows)
    assert rows[0].startswith("✓") and rows[3].startswith("✗")
    assert "from cache" in rows[1]
    assert rows[2].index("calibration") > rows[1].index("profile")  # indented under profile


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_off_with_autopart_progress_0(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("AUTOPART_PROGRESS", value)
    console, out = _terminal()
    with progress(console) as display:
        assert not display.enabled
        _run_phases()
    assert out.getvalue() == ""
    assert [p.name for p in display.phases][:2] == ["capture", "profile"]  # still recorded


def test_off_when_not_a_terminal_and_on_ranks_other_than_0(
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    with progress(Console(file=out)):
        _run_phases()
    assert out.getvalue() == ""
    console, _ = _terminal()
    assert display_enabled(console)
    monkeypatch.setenv("RANK", "1")
    assert not display_enabled(console)


def test_a_phase_alone_draws_on_stderr_only_when_it_is_a_terminal(
        capsys: pytest.CaptureFixture[str]) -> None:
    with phase("capture"):
        print("the user's own output")
    captured = capsys.readouterr()
    assert captured.out == "the user's own output\n"  # untouched
    assert captured.err == ""  # pytest's stderr is no terminal


def test_an_inner_progress_reuses_the_outer_display() -> None:
    console, _ = _terminal()
    with progress(console) as outer:
        with phase("capture"):
            pass
        with progress() as inner, phase("solve"):
            assert inner is outer
    assert [p.name for p in outer.phases] == ["capture", "solve"]
