"""Running a worker function on gloo ranks in a fresh interpreter, for the numerics tests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_problems(module: str, function: str, world: int, *args: Any,
                  timeout_s: float = 400) -> dict[int, list[str]]:
    """``module.function(rank, world, port, out_dir, *args)`` on ``world`` spawned ranks in a
    new interpreter (``torch.multiprocessing.spawn``); each rank writes the checks it saw
    fail to ``out_dir/<rank>.json``. Returns them by rank.

    Raises:
        AssertionError: the launch exited non-zero (its stderr's tail in the message).
    """
    with tempfile.TemporaryDirectory() as out:
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            import torch.multiprocessing as mp
            from {module} import {function}
            if __name__ == "__main__":
                mp.spawn({function}, nprocs={world}, join=True,
                         args=({world}, {free_port()}, {out!r}, *{args!r}))
        """)
        proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout_s)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {r: json.loads((Path(out) / f"{r}.json").read_text()) for r in range(world)}
