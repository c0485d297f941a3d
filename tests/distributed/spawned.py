"""Running a worker function on gloo ranks in a fresh interpreter, for the numerics tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
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


def case_dir(root: str | Path, key: str) -> Path:
    """Where case ``key`` of a :func:`run_cases` launch writes its results."""
    return Path(root) / "cases" / key


def mark_case(root: str | Path, key: str, rank: int, crash: str | None = None) -> None:
    """Rank ``rank`` is through case ``key``: done, or crashed with the traceback ``crash``."""
    status = Path(root) / "status"
    status.mkdir(parents=True, exist_ok=True)
    (status / f"{key}.{rank}.{'crash' if crash is not None else 'done'}").write_text(crash or "")


def _status(root: Path, key: str, world: int) -> tuple[bool, dict[int, str]]:
    """Whether every rank is done with ``key``, and the tracebacks of those that crashed."""
    status = root / "status"
    done = all((status / f"{key}.{r}.done").exists() for r in range(world))
    crashes = {r: (status / f"{key}.{r}.crash").read_text() for r in range(world)
               if (status / f"{key}.{r}.crash").exists()}
    return done, crashes


def run_cases(module: str, function: str, world: int, root: str | Path,
              cases: list[tuple[str, str, tuple[Any, ...]]],
              case_timeout_s: float = 240) -> dict[str, str | None]:
    """Many checks on ``world`` gloo ranks for the price of one start-up: ``module.function(
    rank, world, port, root, cases)`` (e.g. :func:`tests.distributed.worker.batch`) runs each
    ``(key, check, args)`` in order in the same spawned processes, writing its results to
    :func:`case_dir` and marking each rank through it (:func:`mark_case`).

    Returns, per key, None when every rank got through the case, else why not: the ranks'
    tracebacks, the launch's exit code and the tail of its stderr (what a launch of that case
    alone would have failed with). A case that fails ends its launch; the cases after it run
    in a fresh one, so each verdict comes from processes whose earlier cases all passed. A
    launch that makes no progress within ``case_timeout_s`` seconds (since it started, or
    since its last case got done) is killed, and its current case fails: the timeout of a
    launch of that case alone.
    """
    root = Path(root)
    outcome: dict[str, str | None] = {}
    todo = list(cases)
    launches = 0
    while todo:
        launches += 1
        for key, _, _ in todo:  # what an earlier launch left of these cases
            shutil.rmtree(case_dir(root, key), ignore_errors=True)
            for marker in (root / "status").glob(f"{key}.*"):
                marker.unlink()
        err_path = root / f"launch{launches}.stderr"
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            import torch.multiprocessing as mp
            from {module} import {function}
            if __name__ == "__main__":
                mp.spawn({function}, nprocs={world}, join=True,
                         args=({world}, {free_port()}, {str(root)!r}, {todo!r}))
        """)
        with open(err_path, "w") as err:
            # its own session: a launch that times out is killed with every rank it spawned
            proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                                    stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
            timed_out, progress = False, 0
            deadline = time.monotonic() + case_timeout_s
            while True:
                try:
                    proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                done = sum(_status(root, key, world)[0] for key, _, _ in todo)
                if done > progress:
                    progress, deadline = done, time.monotonic() + case_timeout_s
                elif time.monotonic() > deadline:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
        rest = []
        for i, (key, _, _) in enumerate(todo):
            done, crashes = _status(root, key, world)
            if done and not crashes:
                outcome[key] = None
                continue
            rest = todo[i:]
            break
        if not rest:
            break
        key = rest[0][0]
        crashes = _status(root, key, world)[1]
        # a launch that ended in a case without a traceback (a rank killed) after getting
        # through others runs that case again, first: it fails there if it fails alone
        if crashes or timed_out or rest == todo:
            stderr = err_path.read_text()
            outcome[key] = "\n".join(
                [f"{key}: the launch exited with code {proc.returncode}"
                 + (f", killed after {case_timeout_s:g} s without progress" if timed_out else ""),
                 *(f"rank {r} crashed:\n{text}" for r, text in sorted(crashes.items())),
                 "stderr's tail:", stderr[-3000:]])
            rest = rest[1:]
        todo = rest
    return outcome
