"""examples/train_gpt2.py under torchrun on 2 CPU ranks: 20 steps uninterrupted, and 20 steps
killed (SIGKILL of the whole launch) after step 12 and resumed with --resume from the latest
checkpoint (step 10), give the same loss curve. The killed run holds its ranks after step 12
(``--hold-after-step``), so the kill lands at that step however loaded the machine is."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopart.runtime.checkpoint.save_load import checkpoint_extra

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["--steps", "20", "--ckpt-every", "5", "--batch-size", "8", "--seq-len", "32",
         "--layers", "2", "--n-embd", "64", "--warmup", "4"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(out: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={_port()}", "--max-restarts=0", str(ROOT / "examples/train_gpt2.py"),
           "--out", str(out), *STEPS, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, )


def _log(out: Path) -> list[dict[str, float]]:
    path = out / "log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's workers live in their own process groups)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_all(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the launch: workers first (no clean-up, mid-step), then torchrun."""
    for pid in reversed(_descendants(proc.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()


def _finish(proc: subprocess.Popen[str]) -> None:
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]


def test_killed_and_resumed_training_has_the_uninterrupted_loss_curve(tmp_path: Path) -> None:
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _finish(_torchrun(whole))
    reference = {e["step"]: e["loss"] for e in _log(whole)}
    assert sorted(reference) == list(range(1, 21))
    assert reference[20] < reference[1]  # it learns
    # the same plan (the solver's cuts depend on timings), killed mid-run
    proc = _torchrun(broken, "--plan", str(whole / "plan.json"), "--hold-after-step", "12")
    deadline = time.monotonic() + 400
    while len(_log(broken)) < 12:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)
    _kill_all(proc)
    killed_at = len(_log(broken))
    assert not (broken / "done").exists() and killed_at == 12
    saved = int(checkpoint_extra(broken / "ckpt")["step"])
    assert saved == 10, saved
    _finish(_torchrun(broken, "--resume"))
    entries = _log(broken)
    steps = [e["step"] for e in entries]
    assert steps[killed_at] == saved + 1, (saved, steps)  # resumed from the latest checkpoint
    resumed = {e["step"]: e["loss"] for e in entries}  # later lines win
    assert sorted(resumed) == list(range(1, 21))
    for step, loss in reference.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-5), (step, resumed[step], loss)
    # and the steps run twice (before the kill and after the resume) agree
    for e in entries[saved:killed_at]:
        assert e["loss"] == pytest.approx(resumed[e["step"]], rel=1e-5)
