"""Liveness of the ranks of a pipeline: who stopped stamping the rendezvous store."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

__all__ = ["Heartbeat"]


class Heartbeat:
    """Liveness beside a multi-process pipeline (started by :class:`DistributedPipeline`).

    Each rank stamps ``autopart/alive/<rank>`` in the rendezvous store every ``period_s``;
    after a failure the stalest stamp names the rank that died."""

    def __init__(self, store: dist.Store, rank: int, world: int, period_s: float = 0.5) -> None:
        self.store, self.rank, self.world, self.period_s = store, rank, world, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="autopart-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.set(f"autopart/alive/{self.rank}", repr(time.time()))
            except Exception:  # the store went away with rank 0; the main thread reports it
                return
            self._stop.wait(self.period_s)

    def suspect(self, within_s: float = 5.0) -> list[int]:
        """Ranks whose stamp is older than four periods (or missing), polling for up to
        ``within_s`` seconds: a dead peer's stamp needs a few periods to go stale."""
        deadline = time.time() + within_s
        while True:
            stale = self._stale()
            if stale or time.time() >= deadline:
                return stale
            time.sleep(self.period_s)

    def _stale(self) -> list[int]:
        now, stale = time.time(), []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                self.store.wait([f"autopart/alive/{r}"], _timedelta(0.2))
                stamp = float(self.store.get(f"autopart/alive/{r}").decode())
            except Exception:
                stale.append(r)
                continue
            if now - stamp > 4 * self.period_s:
                stale.append(r)
        return stale

    def stop(self) -> None:
        self._stop.set()


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
