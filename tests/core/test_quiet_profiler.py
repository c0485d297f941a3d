"""autopart's memory measurement keeps torch's profiler quiet at its sources (kineto's log
level, the garbage collector), without taking the user's settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_MEASURE = """
import os, sys, torch
from autopart.core.memory import allocated_peak_bytes
allocated_peak_bytes(lambda: torch.ones(10) + 1, torch.device("cpu"))
allocated_peak_bytes(lambda: torch.ones(10) + 1, torch.device("cpu"))
print("KINETO_LOG_LEVEL after:", os.environ.get("KINETO_LOG_LEVEL"))
"""

# an unreachable cycle holding a tensor, made before the profiled call, that the automatic
# collector frees during it (5000 new lists pass the first generation's threshold of 700):
# c10's CPUAllocator.cpp warns of such a free ("Memory block of unknown size ...")
_CYCLE = """
import gc, sys, torch
from autopart.core import memory
if sys.argv[1] == "unpaused":
    gc.disable = lambda: None
class Holder:
    pass
def cycle():
    h = Holder(); h.self = h; h.t = torch.ones(100_000)
def measured():
    return len([[] for _ in range(5000)])
for _ in range(3):
    cycle()
    memory.allocated_peak_bytes(measured, torch.device("cpu"))
print("gc enabled after:", gc.isenabled())
"""


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("KINETO_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    clean.update(env)
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=clean,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_kineto_is_quiet_and_the_variable_is_not_left_set() -> None:
    proc = _python(_MEASURE)
    assert "USDT" not in proc.stderr and "profiler_start" not in proc.stderr, proc.stderr
    assert "KINETO_LOG_LEVEL after: None" in proc.stdout


def test_the_users_kineto_level_is_kept() -> None:
    """At 5, which the user chose, kineto's USDT lines show, and the variable stays."""
    proc = _python(_MEASURE, KINETO_LOG_LEVEL="5")
    assert "KINETO_LOG_LEVEL after: 5" in proc.stdout
    assert "profiler_start" in proc.stderr


def test_no_allocator_warning_from_a_collection_during_the_measurement() -> None:
    quiet = _python(_CYCLE, "paused")
    assert "CPUAllocator" not in quiet.stderr, quiet.stderr
    assert "gc enabled after: True" in quiet.stdout
    # the same without pausing the collector: the warning this guards against
    loud = _python(_CYCLE, "unpaused")
    assert "CPUAllocator" in loud.stderr
