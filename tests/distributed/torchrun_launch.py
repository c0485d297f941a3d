"""Launch a test script under torchrun on CPU ranks (gloo) and hand back what it printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.distributed.spawned import ROOT, Launched, free_port, run_script

__all__ = ["ROOT", "free_port", "torchrun"]


def torchrun(script: str, nproc: int, tmp_path: Path, *, timeout_s: float = 600,
             env: dict[str, str] | None = None,
             args: list[str] | None = None,
             forked: bool = False) -> subprocess.CompletedProcess[str] | Launched:
    """Run ``script`` (relative to the repository root) with ``args`` on ``nproc`` ranks, one
    thread each, with the profile cache in ``tmp_path``; fails the test, with the output's
    tail, when the launch does not exit 0.

    ``forked``: the ranks are forked from the test session's preloaded server with torchrun's
    environment (:func:`tests.distributed.spawned.run_script`), not started by torchrun: the
    same rendezvous and runtime for a fraction of the start-up (for tests of what runs on the
    ranks, not of torchrun).
    """
    rank_env = {"OMP_NUM_THREADS": "1", "AUTOPART_CACHE_DIR": str(tmp_path), **(env or {})}
    if forked:
        run = run_script(ROOT / script, nproc, args=args, timeout_s=timeout_s, env=rank_env)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        return run
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "--max-restarts=0", str(ROOT / script), *(args or [])]
    full_env = {**os.environ, **rank_env}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc
