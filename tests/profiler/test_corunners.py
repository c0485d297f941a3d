"""Co-runners: forked copies of the process that load the host while a rank's work is timed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from autopart.core.capture import capture
from autopart.profiler.corunners import available, co_runners, model_step

pytestmark = pytest.mark.skipif(not available(), reason="co-runners need os.fork on Linux")


def test_copies_run_the_work_while_the_block_runs_and_are_gone_after(tmp_path: Path) -> None:
    marks = tmp_path / "marks"

    def work() -> None:
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.01)

    with co_runners(work, 2) as running:
        assert running == 2
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                not marks.exists() or len(set(marks.read_text().split())) < 2):
            time.sleep(0.05)
        pids = {int(p) for p in marks.read_text().split()}
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:  # killed and reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    count = len(marks.read_text().split())
    time.sleep(0.1)
    assert len(marks.read_text().split()) == count  # nothing runs after the block
    with co_runners(work, 0) as running:
        assert running == 0


def test_a_copy_that_fails_ends_quietly_and_the_block_still_runs() -> None:
    def work() -> None:
        raise RuntimeError("a copy's failure never reaches the caller")

    with co_runners(work, 1) as running:
        assert running == 1
        time.sleep(0.05)


def test_model_step_runs_a_forward_and_backward_of_the_captured_graph() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    captured = capture(model, (x,))
    step = model_step(captured, captured.flatten_inputs((x,), {}))
    step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
