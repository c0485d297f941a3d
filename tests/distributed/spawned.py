"""Running a worker function on gloo ranks, for the multi-process tests.

A launch is a process forked from one server per test session that has imported torch,
autopart and the zoo's transformers models (:mod:`tests.distributed.preload`); it forks its
ranks in turn (``torch.multiprocessing.start_processes(..., start_method="fork")``). A rank
then starts in milliseconds instead of importing them again (about 8 s of CPU per rank on a
2-core machine, a large part of a small test's time). Each launch runs in a session of its own, with
the environment and working directory of the test that started it, and its stdout and
stderr in files.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: the one forkserver of this test session, made on the first launch
_SERVER: Any = None


def _server() -> Any:
    global _SERVER
    if _SERVER is None:
        _SERVER = multiprocessing.get_context("forkserver")
        _SERVER.set_forkserver_preload(["tests.distributed.preload"])
    return _SERVER


def _launch_main(module: str, function: str, world: int, args: tuple[Any, ...],
                 env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """The launch process: its own session (so that a timeout kills every rank with it), the
    caller's environment and directory, then ``module.function(rank, *args)`` on ``world``
    forked ranks."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # gettempdir() reads the launch's TMPDIR, not the server's
    os.chdir(cwd)
    if ROOT.as_posix() not in sys.path:
        sys.path.insert(0, ROOT.as_posix())
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    import importlib

    import torch.multiprocessing as mp

    if "OMP_NUM_THREADS" in env:  # the server's OpenMP read its own environment at import
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    fn = getattr(importlib.import_module(module), function)
    mp.start_processes(fn, args=args, nprocs=world, join=True, start_method="fork")


class Launch:
    """``module.function(rank, *args)`` on ``world`` forked ranks, started now.

    ``env`` is added to this process's environment for the launch. ``returncode`` is None
    while it runs; :meth:`kill` ends it with every rank.
    """

    def __init__(self, module: str, function: str, world: int, *args: Any,
                 env: Mapping[str, str] | None = None, cwd: str | Path = ROOT) -> None:
        self._dir = tempfile.mkdtemp(prefix="launch-")
        self._out, self._err = f"{self._dir}/stdout", f"{self._dir}/stderr"
        self.process = _server().Process(
            target=_launch_main,
            args=(module, function, world, args, {**os.environ, **(env or {})}, str(cwd),
                  self._out, self._err))
        self.process.start()

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode  # type: ignore[no-any-return]

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the launch and every rank (its session), and reap it."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.kill()
        self.process.join()

    def output(self) -> tuple[str, str]:
        """What the launch printed so far: (stdout, stderr)."""
        return tuple(Path(p).read_text() if Path(p).exists() else ""  # type: ignore[return-value]
                     for p in (self._out, self._err))

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class Launched:
    """A finished launch: its exit code (negative: killed by that signal) and output."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


def launch(module: str, function: str, world: int, *args: Any, timeout_s: float = 400,
           env: Mapping[str, str] | None = None) -> Launched:
    """``module.function(rank, *args)`` on ``world`` forked ranks (see :class:`Launch`),
    waited for; killed with every rank after ``timeout_s`` seconds (``timed_out``)."""
    run = Launch(module, function, world, *args, env=env)
    try:
        timed_out = run.wait(timeout_s) is None
    finally:  # a timeout, or the test interrupted
        if run.returncode is None:
            run.kill()
    out, err = run.output()
    run.close()
    return Launched(run.returncode, out, err, timed_out=timed_out)


def _script_rank(rank: int, world: int, port: int, script: str, argv: list[str]) -> None:
    """Rank ``rank`` of :func:`run_script`: torchrun's environment, then ``script`` as
    ``__main__`` with ``argv``."""
    import runpy

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


def run_script(script: str | Path, world: int, *, args: list[str] | None = None,
               timeout_s: float = 600, env: Mapping[str, str] | None = None) -> Launched:
    """A script written for torchrun, on ``world`` forked ranks (:class:`Launch`) that each
    get the variables torchrun sets for a one-host world (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and run it as
    ``__main__``: the same ``env://`` rendezvous without torchrun's agent and its fresh
    interpreters. Tests of torchrun itself launch it (:mod:`tests.distributed.torchrun_launch`).
    """
    return launch(__name__, "_script_rank", world, world, free_port(), str(script),
                  list(args or []), timeout_s=timeout_s, env=env)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_problems(module: str, function: str, world: int, *args: Any,
                  timeout_s: float = 400) -> dict[int, list[str]]:
    """``module.function(rank, world, port, out_dir, *args)`` on ``world`` spawned ranks in a
    (:func:`launch`); each rank writes the checks it saw
    fail to ``out_dir/<rank>.json``. Returns them by rank.

    Raises:
        AssertionError: the launch exited non-zero (its stderr's tail in the message).
    """
    with tempfile.TemporaryDirectory() as out:
        proc = launch(module, function, world, world, free_port(), out, *args,
                      timeout_s=timeout_s)
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
    while todo:
        for key, _, _ in todo:  # what an earlier launch left of these cases
            shutil.rmtree(case_dir(root, key), ignore_errors=True)
            for marker in (root / "status").glob(f"{key}.*"):
                marker.unlink()
        run = Launch(module, function, world, world, free_port(), str(root), todo)
        timed_out, progress = False, 0
        deadline = time.monotonic() + case_timeout_s
        while run.wait(timeout=0.5) is None:
            done = sum(_status(root, key, world)[0] for key, _, _ in todo)
            if done > progress:
                progress, deadline = done, time.monotonic() + case_timeout_s
            elif time.monotonic() > deadline:
                timed_out = True
                run.kill()
                break
        stderr = run.output()[1]
        run.close()
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
            outcome[key] = "\n".join(
                [f"{key}: the launch exited with code {run.returncode}"
                 + (f", killed after {case_timeout_s:g} s without progress" if timed_out else ""),
                 *(f"rank {r} crashed:\n{text}" for r, text in sorted(crashes.items())),
                 "stderr's tail:", stderr[-3000:]])
            rest = rest[1:]
        todo = rest
    return outcome
