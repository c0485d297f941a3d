"""Ending a test's rank process once its results are written."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import torch.distributed as dist


def end_rank(pipe: Any = None) -> NoReturn:
    """Close ``pipe`` (if given), destroy the process group and end this rank's process with
    exit code 0 at once, without the interpreter's finalization.

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
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
