"""Liveness and progress of the ranks of a pipeline: who died, who hangs, and in which action."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

import torch.distributed as dist

__all__ = ["Heartbeat", "RankState", "DEFAULT_STEP_TIMEOUT_S", "HUNG_EXIT_CODE", "in_collective"]

DEFAULT_STEP_TIMEOUT_S = 300.0
HUNG_EXIT_CODE = 75  # what a rank told it hangs exits with (EX_TEMPFAIL)


@dataclass(frozen=True)
class RankState:
    """What a rank last published.

    Attributes:
        stamp: wall time of its last beat, seconds since the epoch (the process is alive).
        action: the schedule action its main thread is computing (``"1F3"``), ``""`` when it
            is between actions (sending, receiving, waiting).
        since: wall time it entered ``action`` (or left the last one), seconds.
        waiting: its main thread was waiting in a collective (:func:`in_collective`) when it
            published this: a tensor-parallel all-reduce or an FSDP gather inside an action
            waits for its peers, it does not hang.
    """

    stamp: float
    action: str
    since: float
    waiting: bool = False


class Heartbeat:
    """Liveness and progress beside a multi-process pipeline (one per rank).

    The main thread marks every action it computes (:meth:`action`); a background thread
    publishes ``autopart/state/<rank>`` in the rendezvous store every ``period_s``: a time
    stamp (the process lives), the action being computed and since when (it progresses).
    A thread that beats says nothing about the main thread, so a hang is read from the
    action, not the stamp: a rank inside one action for longer than the step timeout hangs,
    unless its main thread waits in a collective there (a tensor-parallel all-reduce or a
    ZeRO gather for a peer that hangs: :func:`in_collective`, read at each beat), which
    makes it a victim of the hang rather than its cause.

    After a step fails, :meth:`diagnose` names the ranks that died (stale stamp) or hang
    (stuck in an action), and :meth:`tell_to_exit` asks a hung rank's own heartbeat thread
    to end its process (exit code ``HUNG_EXIT_CODE``), since its main thread cannot.

    The thread is stopped and joined at interpreter exit if :meth:`stop` was not called: a
    daemon thread still inside a store call when Python finalizes aborts the process
    (``terminate called without an active exception``, SIGABRT), which failed jobs that
    had finished.

    Args:
        store: the process group's rendezvous store.
        rank: this process's global rank; ``world``: the global world size.
        period_s: seconds between beats (default 0.5).
        hung_after_s: when the store is gone (rank 0, which serves it, has ended) and the
            main thread has been inside one action this long, nobody can tell this rank to
            exit any more, so it exits by itself (default: the step timeout, 300 s).
    """

    def __init__(self, store: dist.Store, rank: int, world: int, period_s: float = 0.5,
                 hung_after_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        self.store, self.rank, self.world, self.period_s = store, rank, world, period_s
        self.hung_after_s = hung_after_s
        self._action, self._since = "", time.time()
        self._marker = threading.get_ident()  # the thread that marks actions
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="autopart-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    @contextlib.contextmanager
    def action(self, text: str) -> Iterator[None]:
        """Mark the main thread as computing ``text`` (e.g. ``"1F3"``) while inside."""
        self._marker = threading.get_ident()
        self._action, self._since = text, time.time()
        try:
            yield
        finally:
            self._action, self._since = "", time.time()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                waiting = bool(self._action) and in_collective(
                    sys._current_frames().get(self._marker))
                state = {"stamp": time.time(), "action": self._action, "since": self._since,
                         "waiting": waiting}
                self.store.set(f"autopart/state/{self.rank}", json.dumps(state))
                if self.store.check([f"autopart/exit/{self.rank}"]):
                    reason = self.store.get(f"autopart/exit/{self.rank}").decode()
                    self.store.set(f"autopart/exited/{self.rank}", reason)
                    self._exit(reason)
            except Exception:  # the store went away with rank 0: the job is over
                if self._action and time.time() - self._since > self.hung_after_s:
                    self._exit(f"it hangs in action {self._action} and the job has ended")
            self._stop.wait(self.period_s)

    def _exit(self, reason: str) -> None:
        print(f"autopart: rank {self.rank} exits: {reason}", file=sys.stderr, flush=True)
        os._exit(HUNG_EXIT_CODE)

    def state(self, rank: int) -> RankState | None:
        """What ``rank`` last published, or None when nothing can be read."""
        try:
            self.store.wait([f"autopart/state/{rank}"], _timedelta(0.2))
            raw = json.loads(self.store.get(f"autopart/state/{rank}").decode())
            return RankState(float(raw["stamp"]), str(raw["action"]), float(raw["since"]),
                             bool(raw.get("waiting", False)))
        except Exception:
            return None

    def diagnose(self, hung_after_s: float, within_s: float = 5.0,
                 ) -> tuple[list[int], dict[int, tuple[str, float]]]:
        """The other ranks that died and those that hang.

        Polls up to ``within_s`` seconds, since a dead peer's stamp needs a few periods to
        go stale.

        Args:
            hung_after_s: a rank inside one action for longer than this hangs.
            within_s: how long to wait for a verdict, seconds.

        Returns:
            The dead ranks (stamp older than four periods, or none), and per hung rank its
            action and how long it has been in it, seconds: a rank inside one action for
            longer than ``hung_after_s`` and not waiting in a collective there, or one that
            another rank told to exit (it hung) and that has exited since.
        """
        deadline = time.time() + within_s
        while True:
            now, dead, hung = time.time(), [], {}
            for r in range(self.world):
                if r == self.rank:
                    continue
                st = self.state(r)
                fresh = st is not None and now - st.stamp <= 4 * self.period_s
                if st is not None and st.action and (
                        (fresh and not st.waiting and now - st.since > hung_after_s)
                        or (not fresh and self._exited(r))):
                    hung[r] = (st.action, now - st.since)
                elif not fresh:
                    dead.append(r)
            if dead or hung or time.time() >= deadline:
                return dead, hung
            time.sleep(self.period_s)

    def _exited(self, rank: int) -> bool:
        """Whether ``rank``'s heartbeat said it exits because it was told to (it hung)."""
        try:
            return bool(self.store.check([f"autopart/exited/{rank}"]))
        except Exception:
            return False

    def tell_to_exit(self, rank: int, reason: str, wait_s: float = 5.0) -> bool:
        """Ask ``rank``'s heartbeat thread to end its process (it hangs), and wait up to
        ``wait_s`` seconds for it to say it does (this rank may serve the store, which
        ends with it). Returns whether it acknowledged."""
        with contextlib.suppress(Exception):
            self.store.set(f"autopart/exit/{rank}", reason)
            self.store.wait([f"autopart/exited/{rank}"], _timedelta(wait_s))
            return True
        return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating and wait up to ``timeout_s`` seconds for the thread to end (call
        before the process group is destroyed; also run at interpreter exit)."""
        self._stop.set()
        atexit.unregister(self.stop)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


def in_collective(frame: FrameType | None) -> bool:
    """Whether a thread whose innermost Python frame is ``frame`` waits in a collective: that
    frame is torch.distributed's (a c10d call and its ``wait``, FSDP2's gathers and
    reduce-scatters) or calls a functional collective op (``torch.ops._c10d_functional``:
    the tensor-parallel all-reduces and gathers of :mod:`autopart.codegen`'s stages). A
    thread blocked in C code is seen at the Python frame that called it
    (``sys._current_frames``), so a stage computing (an aten op) or stalled in Python does
    not count. On CUDA, NCCL collectives return at once and a backward's run on autograd's
    device threads, so there this sees a collective only while a gloo one or a wait blocks
    the thread."""
    if frame is None:
        return False
    module = str(frame.f_globals.get("__name__", ""))
    if module.startswith("torch.distributed") and not module.startswith(
            "torch.distributed.pipelining"):
        return True
    if module == "torch._ops":  # a torch.ops call: which op (OpOverload[Packet].__call__)
        return str(frame.f_locals.get("self", "")).startswith("_c10d_functional.")
    return False


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
