"""Each runtime as the profiler and the solver see it: one RuntimeDescription per backend."""

from __future__ import annotations

from autopart.core.errors import PlanError
from autopart.core.runtime_model import BACKENDS, RuntimeDescription
from autopart.runtime.split_engines import LocalSplit, TorchPipeliningSplit

__all__ = ["describe"]


def describe(backend: str, *, issue_threads: int | None = 1) -> RuntimeDescription:
    """The description of ``backend`` before anything is measured of it.

    ``"local"``: one process runs every stage (the stream executor); ``issue_threads``
    host threads issue the ranks' work (default 1: the caller's thread issues every stage,
    ``pipe.issue_threads = 1``; None: a worker thread per rank,
    :class:`autopart.runtime.local.issue_threads.IssueThreads`); a stage's receive
    buffers are allocated as values arrive; the backward is split with
    :class:`~autopart.runtime.split_engines.LocalSplit`.
    ``"distributed"``: each rank is a process (torch.distributed.pipelining's stages) with
    its own issuing thread (``issue_threads=None``): one
    receive buffer per microbatch for the whole step, torch's backward split on copies of the
    outputs, and a cost per transfer timed by
    :func:`autopart.runtime.distributed.transfer_rank.time_steps`.

    Args:
        backend: ``"local"`` or ``"distributed"``.
        issue_threads: the local runtime's issuing threads (ignored for ``"distributed"``).

    Raises:
        PlanError: an unknown backend, or ``issue_threads`` below 1.
    """
    if backend == "local":
        return RuntimeDescription(name="local", issue_threads=issue_threads,
                                  split_engine=LocalSplit())
    if backend == "distributed":
        return RuntimeDescription(name="distributed", receive_buffers_per_microbatch=True,
                                  ranks_are_processes=True, issue_threads=None,
                                  split_engine=TorchPipeliningSplit(),
                                  transfer_steps="autopart.runtime.distributed.transfer_rank:time_steps")
    raise PlanError(f"backend={backend!r}; expected one of {BACKENDS}")
