"""The README's first example as written, under torchrun on 2 CPU ranks (tests/distributed/
torchrun_lazy.py): no example inputs and no init_process_group; rank 0 plans at the first
step and the other rank waits for its plan; a second sequence length is built once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_lazy_compile_as_written_trains_under_torchrun(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={_free_port()}", "--max-restarts=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPART_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([*torchrun, str(ROOT / "tests/distributed/torchrun_lazy.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        for step, seq in enumerate([8, 16, 8]):
            assert f"rank {rank} step {step} seq {seq} ok loss" in proc.stdout, proc.stdout
    assert proc.stdout.count("autopart: planned at the first train_step on inputs (4, 8): "
                             "2 ranks, 2 stages") == 1, proc.stdout  # rank 0 only
    assert proc.stdout.count("new input shape (4, 16)") == 1, proc.stdout
