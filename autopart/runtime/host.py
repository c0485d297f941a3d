"""CPU hosts: keep freed memory in the process (glibc ``mallopt``) so steps stop page-faulting,
and give each pipeline rank on a host its own cores."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["tune_cpu_allocator", "on_rank_cores", "MALLOC_ENV", "AFFINITY_ENV", "core_share", "pin_threads",
           "thread_affinity", "affinity_enabled", "on_cores"]

#: Set to ``0``/``off``/``no``/``false`` to leave the C allocator as it is.
MALLOC_ENV = "AUTOPART_MALLOC_TUNING"
#: Set to ``0``/``off``/``no``/``false`` to leave CPU ranks' core affinity as it is.
AFFINITY_ENV = "AUTOPART_CPU_AFFINITY"
_OFF = ("0", "off", "no", "false")
_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
_M_MMAP_MAX = -4
_TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest value mallopt takes (an int): never trim

_done: str | None = None


def tune_cpu_allocator() -> str | None:
    """Make glibc's ``malloc`` keep the memory CPU tensors free, once per process.

    torch's CPU allocator takes tensor storage from ``malloc``. By default glibc serves a
    block of 128 KiB or more (rising to the largest block freed, up to 32 MiB) with a fresh
    ``mmap``, and gives the top of its heap back to the OS whenever more than twice that is
    free. A training step frees its activations microbatch after microbatch, so the next one
    takes its memory from the OS again, one zero-filled page at a time
    (``benchmarks/pipeline_cpu/allocator.py`` measures what that costs).

    Sets ``M_MMAP_MAX`` to 0 (the main heap serves every block; a thread's own arena still
    maps a block its 64 MiB heap cannot hold) and ``M_TRIM_THRESHOLD`` to its largest value,
    as ``mallopt(3)`` describes (https://man7.org/linux/man-pages/man3/mallopt.3.html).
    ``M_MMAP_THRESHOLD`` alone would not do: glibc caps it at 32 MiB, and a 50k-vocabulary
    head's logits for 2 x 128 tokens are 51 MB. The process then keeps its peak heap:
    resident memory stays at the most it has held, as with CUDA's caching allocator.
    Tensor memory figures (``measure_peak_bytes``) count tensors and are unchanged.

    Called by the runtimes and the profiler when they run on CPU, so profiles are measured
    with the allocator the pipeline runs with. A no-op off glibc (macOS, musl, Windows) and
    when ``$AUTOPART_MALLOC_TUNING`` is ``0``/``off``/``no``/``false``.

    Returns:
        What was set (``"M_MMAP_MAX=0 M_TRIM_THRESHOLD=2147483647"``), or None
        when nothing was (not glibc, turned off, or ``mallopt`` refused).
    """
    global _done
    if _done is not None:
        return _done
    if os.environ.get(MALLOC_ENV, "1").strip().lower() in _OFF:
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success and 0 on error
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)):
        return None
    _done = f"M_MMAP_MAX=0 M_TRIM_THRESHOLD={_TRIM_THRESHOLD_BYTES}"
    return _done


def affinity_enabled() -> bool:
    """Whether CPU ranks may be pinned: the OS can set a thread's affinity (Linux) and
    ``$AUTOPART_CPU_AFFINITY`` is not ``0``/``off``/``no``/``false``."""
    return (hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")
            and os.environ.get(AFFINITY_ENV, "1").strip().lower() not in _OFF)


def core_share(cores: Sequence[int], local_rank: int, local_size: int) -> tuple[int, ...]:
    """Rank ``local_rank``'s share of ``cores`` when ``local_size`` ranks split them: the
    sorted cores cut into ``local_size`` contiguous, disjoint parts whose sizes differ by at
    most one (the first parts take the remainder). Empty when there are fewer cores than
    ranks (sharing cores is then unavoidable and nothing is pinned).

    Example: 4 cores, 2 ranks: ``(0, 1)`` and ``(2, 3)``; 5 cores: ``(0, 1, 2)`` and
    ``(3, 4)``.

    Raises:
        ValueError: ``local_rank`` is not in ``[0, local_size)``.
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank={local_rank} must be in [0, local_size={local_size})")
    ordered = sorted(set(cores))
    if len(ordered) < local_size:
        return ()
    size, extra = divmod(len(ordered), local_size)
    start = local_rank * size + min(local_rank, extra)
    return tuple(ordered[start:start + size + (local_rank < extra)])


def thread_affinity() -> dict[int, frozenset[int]]:
    """Every thread of this process (Linux thread id) and the cores it may run on."""
    out: dict[int, frozenset[int]] = {}
    for name in os.listdir("/proc/self/task"):
        try:
            out[int(name)] = frozenset(os.sched_getaffinity(int(name)))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def pin_threads(cores: Sequence[int] | dict[int, frozenset[int]]) -> None:
    """Set the cores every thread of this process may run on: ``cores`` for all of them, or
    per thread id (``thread_affinity()``'s result, to restore it; threads that have ended
    are skipped, threads started since keep what they have). Threads started afterwards
    inherit the affinity of the thread that starts them.

    Raises:
        OSError: the OS refused (a core outside the process's cgroup).
    """
    wanted = cores if isinstance(cores, dict) else None
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        target = wanted.get(tid) if wanted is not None else frozenset(cores)  # type: ignore[arg-type]
        if target is None:
            continue
        try:
            os.sched_setaffinity(tid, target)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


@contextlib.contextmanager
def on_cores(cores: Sequence[int] | None) -> Iterator[None]:
    """Every thread of this process on ``cores`` meanwhile (:func:`pin_threads`), then each
    back on the cores it had; nothing when ``cores`` is None or empty.

    Raises:
        OSError: the OS refused to pin (raised on entry, with every thread given its cores
            back; the body does not run).
    """
    if not cores:
        yield
        return
    before = thread_affinity()
    try:
        pin_threads(cores)
    except OSError:
        with contextlib.suppress(OSError):
            pin_threads(before)
        raise
    try:
        yield
    finally:
        pin_threads(before)


@contextlib.contextmanager
def on_rank_cores(rank: Any) -> Iterator[None]:
    """Every thread of this process on ``rank.cpu_cores`` meanwhile (when set), then back on
    the cores each had (:func:`on_cores`): what runs between steps (the optimizer, a
    profile, processes started from this one) is left as it was. Where the OS refuses, this
    warns once, sets ``rank.cpu_cores`` to None (later steps run unpinned) and runs the body.

    Args:
        rank: a pipeline rank: its ``cpu_cores`` (a tuple of core ids, or None) and its
            ``pp_rank`` (for the warning).
    """
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(on_cores(rank.cpu_cores))
        except OSError as exc:  # e.g. a core the cgroup took away since
            warnings.warn(f"rank {rank.pp_rank}: could not pin its threads to cores "
                          f"{list(rank.cpu_cores or ())} ({exc}); its steps run unpinned "
                          "(set AUTOPART_CPU_AFFINITY=0 to skip trying)", RuntimeWarning,
                          stacklevel=3)
            rank.cpu_cores = None
        yield
