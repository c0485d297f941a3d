"""Ending a test's rank process once its results are written."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, NoReturn

import torch.distributed as dist


def end_rank(pipe: Any = None) -> NoReturn:
    """Close ``pipe`` (if given), wait for every rank to get here, destroy the process group
    and end this rank's process with exit code 0 at once, without the interpreter's
    finalization.

    The wait (a barrier of at most 120 s) keeps the rank hosting the rendezvous store (global
    rank 0) alive until every rank has finished talking to it: a fresh-clone run on
    2026-11-29 failed ``test_tp_peak_memory`` with ``DistNetworkError: Connection reset by
    peer`` in rank 1's end-of-step gather through the store, rank 0 having ended first. A
    rank that never arrives (it failed before) does not hold the others past the barrier's
    timeout; the test then fails on that rank's exit code.

    A rank that returns instead finalizes the interpreter while gloo's worker threads may
    still drop the last reference to a tensor of a finished collective or send. That needs
    the GIL, which a finalizing interpreter no longer gives, and the process aborts with
    "terminate called without an active exception". The PyTorch pull request 179291 (an
    atexit handler in init_process_group, abandoned) describes the same race. Fresh-clone
    test runs of this project hit it twice on 2026-11-27, in three tests (test_lazy_3d and
    test_resume in one run, test_grad_scaler_dist in another), each time after the ranks had
    written their results. Call it last: what the rank printed is flushed first.
    """
    if pipe is not None:
        pipe.close()
    if dist.is_initialized():
        try:
            if dist.get_backend() == "gloo":  # names a rank that never arrives
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
            else:
                dist.barrier()
        except RuntimeError as exc:
            print(f"end_rank: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
