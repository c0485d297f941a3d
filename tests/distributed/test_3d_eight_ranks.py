"""tp 2 x pp 2 x dp 2 on 8 gloo ranks under torchrun, ZeRO-1 and ZeRO-3: loss, every gradient,
the gradient norm and a bf16-autocast step against the plain model (``torchrun_3d_8.py``
checks them on every rank)."""

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


def test_tp2_pp2_dp2_with_zero_1_and_3_is_the_plain_model(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=8",
           f"--master-port={_free_port()}", "--max-restarts=0",
           str(ROOT / "tests/distributed/torchrun_3d_8.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPART_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in range(8):
        for zero in (1, 3):
            assert f"rank {rank} zero{zero} ok" in proc.stdout, proc.stdout[-3000:]
