"""A cold compile prints nothing of torch's profiler or allocator, and no progress display
when stderr is not a terminal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: what torch prints when autopart's profiling does not keep it quiet: kineto's
#: ``USDT: ... SyncActivityProfilerHandler.cpp:52] profiler_start`` / ``profiler_stop`` and
#: c10's ``[W ... CPUAllocator.cpp:245] Memory block of unknown size ...``
THIRD_PARTY = ("USDT", "profiler_start", "profiler_stop", "CPUAllocator")

_SCRIPT = """
import os, sys, torch, autopart
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
x, y = torch.randn(8, 16), torch.randn(8, 4)
if sys.argv[1] == "eager":
    pipe = autopart.compile(model, (x,), loss_fn=nn.functional.mse_loss, example_target=y,
                            devices=["cpu", "cpu"], time_limit_s=2)
else:  # plans at the first step, on its batch
    pipe = autopart.compile(model, loss_fn=nn.functional.mse_loss, devices=["cpu", "cpu"],
                            time_limit_s=2)
loss = pipe.train_step(x, target=y, measure_memory=True)
print("compiled", len(pipe.plan.ranks), "ranks; loss", float(loss))
print("KINETO_LOG_LEVEL after:", os.environ.get("KINETO_LOG_LEVEL"))
"""


@pytest.mark.parametrize("form", ["eager", "lazy"])
def test_a_cold_compile_prints_no_line_of_torchs_profiler_or_allocator(tmp_path: Path,
                                                                        form: str) -> None:
    """In a fresh process (kineto not yet started) with an empty profile cache; the step
    measures its memory with torch's profiler too."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KINETO_LOG_LEVEL", "AUTOPART_PROGRESS", "TORCH_CPP_LOG_LEVEL", "RANK")}
    env["AUTOPART_CACHE_DIR"] = str(tmp_path / "empty-cache")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, form], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled 2 ranks" in proc.stdout
    for pattern in THIRD_PARTY:
        assert pattern not in proc.stderr, proc.stderr[-3000:]
        assert pattern not in proc.stdout, proc.stdout[-3000:]
    # the variable that quiets kineto was set for autopart's profiling only, not left behind
    assert "KINETO_LOG_LEVEL after: None" in proc.stdout
    # stderr is a pipe, not a terminal: no progress display
    assert "✓" not in proc.stderr
    assert not re.search(r"^\s*(capture|profile|split cost|host link|solve|codegen)\s+\d",
                         proc.stderr, re.MULTILINE), proc.stderr[-3000:]

