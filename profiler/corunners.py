"""Timing a rank's work while the host's other ranks compute too.

A profile times ops with the rest of the machine idle. Pipeline ranks on one host run at
once and share its caches and memory bandwidth: on this project's 2-core CPU (AMD EPYC,
torch 2.13.0+cpu, one thread per process) a microbatch's forward and backward of the
fidelity benchmark's GPT-2-like model (4 rows of 64 tokens) took 4.9 % longer while a second
process ran the same model than alone, and the ResNet-like CNN's (4 images) 5.3 % (medians
of 14 and 12 alternated runs of 3 steps). What the neighbour runs matters: a small MLP that
stays in cache slowed the GPT-2 by 0.1 %, a vocabulary-sized linear layer with its
cross-entropy by 3.7 %, and each of those figures came out between 1.00 and 1.14 when
measured for a second. So the calibration that rescales a profile's node times
(:func:`autopart.profiler.calibrate.segment_times`) runs, for a plan of several CPU ranks
on this host, beside copies of the process running the same model (:func:`co_runners`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autopart.core.capture import CapturedGraph

__all__ = ["co_runners", "available", "model_step", "time_sharing_factor", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``os.sched_getaffinity``), else
    ``os.cpu_count()``, at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def available() -> bool:
    """Whether co-runners can be made here: Linux (``os.fork``; torch is not fork-safe on
    macOS)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def model_step(captured: CapturedGraph, flat_inputs: list[Any]) -> Callable[[], None]:
    """One forward and backward of the whole captured graph on ``flat_inputs`` (the outputs
    that need a gradient summed, ``.grad`` written): what a neighbouring rank's stages do."""
    gm = captured.graph_module

    def step() -> None:
        outs = gm.forward(*flat_inputs)  # flat leaves: no input-spec hook (it wants kwargs)
        leaves = [o for o in (outs if isinstance(outs, (tuple, list)) else [outs])
                  if isinstance(o, torch.Tensor) and o.requires_grad]
        if leaves:
            torch.stack([o.float().sum() for o in leaves]).sum().backward()

    return step


@contextlib.contextmanager
def co_runners(work: Callable[[], None], count: int) -> Iterator[int]:
    """Inside the block, ``count`` forked copies of this process call ``work()`` over and
    over (one thread each); they are killed when it ends.

    A fork shares the parent's memory until either writes it, so the copies hold the same
    model without a copy made up front (each allocates its own activations and gradients).
    They never return to the caller's code, print nothing and exit without clean-up.

    Args:
        work: one unit of the neighbours' load, e.g. :func:`model_step`.
        count: copies to run; 0 (or where :func:`available` is False) runs none.

    Yields:
        How many copies run.
    """
    pids: list[int] = []
    if available():
        for _ in range(max(count, 0)):
            pid = os.fork()
            if pid == 0:  # the copy: loop until killed, never return
                try:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    torch.set_num_threads(1)
                    while True:
                        work()
                except BaseException:  # noqa: BLE001 - a copy never reports; the parent times
                    pass
                os._exit(0)
            pids.append(pid)
    try:
        yield len(pids)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def time_sharing_factor(work: Callable[[], None], world: int, cores: int, *,
                        calls: int = 9, rounds: int = 2) -> float:
    """How much more CPU time ``work()`` takes when ``world`` processes share ``cores`` cores
    than with a core each (``RuntimeDescription.time_sharing_factor``): its median CPU time
    (``time.thread_time``, one thread) beside ``world - 1`` copies of this process running it
    (:func:`co_runners`) over the median beside ``cores - 1``, the two alternated
    ``rounds`` times, ``calls`` calls each; never below 1.0. 1.0 when ``world <= cores``
    or where co-runners cannot be made (:func:`available`).

    Two processes time-sliced on one core each find the core's caches filled by the other
    after every switch; the wall time doubles whatever the work, the CPU time grows with how
    much the work leans on what the other evicted (12 % for a small GPT-2's forward and
    backward, 0 % for a chain of matmuls on this project's 2-core CPU:
    ``benchmarks/fidelity_3d/time_slicing.py``).

    Raises:
        ValueError: ``cores`` < 1 or ``calls`` < 1.
    """
    if cores < 1 or calls < 1:
        raise ValueError(f"cores={cores} and calls={calls} must be >= 1")
    if world <= cores or not available():
        return 1.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each CPU rank runs
    times: dict[int, list[float]] = {cores - 1: [], world - 1: []}
    try:
        for _ in range(rounds):
            for neighbours, got in times.items():
                with co_runners(work, neighbours):
                    work()  # the copies start; this one warms up
                    for _ in range(calls):
                        t0 = time.thread_time()
                        work()
                        got.append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    alone = statistics.median(times[cores - 1])
    return max(1.0, statistics.median(times[world - 1]) / alone) if alone > 0 else 1.0
