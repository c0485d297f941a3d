"""examples/train_3d.py's flags: --tp/--dp/--zero-stage fix the layout, bad values are refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_3d", ROOT / "examples/train_3d.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_solver_chooses_every_axis_by_default() -> None:
    args = _example().parse_args([])
    assert (args.tp, args.dp, args.zero_stage, args.plan) == (None, None, None, None)
    assert args.steps >= 2 and args.batch_size == 16


def test_flags_fix_the_layout() -> None:
    args = _example().parse_args(["--tp", "2", "--dp", "1", "--zero-stage", "3", "--steps", "4"])
    assert (args.tp, args.dp, args.zero_stage, args.steps) == (2, 1, 3, 4)


@pytest.mark.parametrize(("argv", "said"), [
    (["--zero-stage", "4"], "invalid choice: 4"),
    (["--tp", "0"], "0 must be >= 1"),
    (["--dp", "x"], "invalid"),
    (["--steps", "1"], "1 must be >= 2"),
    (["--n-embd", "100", "--n-head", "3"], "--n-embd 100 must be a multiple of --n-head 3"),
    (["--plan", "p.json", "--dp", "2"], "--plan fixes the layout"),
])
def test_bad_flags_are_refused(argv: list[str], said: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _example().parse_args(argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err
