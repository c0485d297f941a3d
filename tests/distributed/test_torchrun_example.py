"""examples/torchrun_gpt2.py under torchrun on 2 CPU ranks: rank 0 profiles and solves,
every rank trains, and the plan's predicted step is printed beside the measured median."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_example_trains_and_prints_predicted_against_measured(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={_port()}", "--max-restarts=0", str(ROOT / "examples/torchrun_gpt2.py"),
           "--steps", "3", "--layers", "2", "--n-embd", "64", "--batch-size", "8",
           "--seq-len", "32", "--num-microbatches", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPART_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"plan: \d+ stages, \w+, m=4, cuts at \[", out), out
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+), [\d.]+ s", out)]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), out
    line = re.search(r"step time: predicted ([\d.]+) s, measured ([\d.]+) s \(median of 2 "
                     r"after the first\), predicted ([+-][\d.]+)%", out)
    assert line is not None, out
    predicted, measured, error = (float(g) for g in line.groups())
    assert predicted > 0 and measured > 0
    # the printed error is the ratio's, up to the seconds' rounding to 1 ms
    slack = 100 * 0.0005 * (1 / measured + predicted / measured**2) + 0.05
    assert abs(error - 100 * (predicted / measured - 1)) <= slack
