"""Checkpoints across 3D layouts: tp 2 x pp 2 -> pp 2 x dp 2 ZeRO-3 -> tp 2 x dp 2 ZeRO-1 and
the plain model, under torchrun on 4 gloo ranks, continue the unpartitioned loss curve
(``torchrun_ckpt_3d.py`` checks every step)."""

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


def test_a_3d_checkpoint_resumes_on_other_layouts_and_in_the_plain_model(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
           f"--master-port={_free_port()}", "--max-restarts=0",
           str(ROOT / "tests/distributed/torchrun_ckpt_3d.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPART_CACHE_DIR": str(tmp_path),
           "TMPDIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in range(4):
        for label, steps in (("tp2xpp2", (0, 1)), ("pp2xdp2-zero3", (2,)),
                             ("tp2xdp2-zero1", (3, 4))):
            for k in steps:
                assert f"rank {rank} {label} step {k} ok" in proc.stdout, proc.stdout[-3000:]
    assert "rank 0 plain step 3 ok" in proc.stdout and "rank 0 plain step 4 ok" in proc.stdout
