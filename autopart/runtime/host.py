"""CPU hosts: keep freed memory in the process (glibc ``mallopt``) so steps stop page-faulting."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["tune_cpu_allocator", "MALLOC_ENV", "MMAP_THRESHOLD_BYTES"]

#: Set to ``0``/``off``/``no``/``false`` to leave the C allocator as it is.
MALLOC_ENV = "AUTOPART_MALLOC_TUNING"
#: Allocations at least this large are still mapped fresh from the OS (glibc's ceiling for
#: ``M_MMAP_THRESHOLD`` on 64-bit hosts: 32 MiB, ``DEFAULT_MMAP_THRESHOLD_MAX``).
MMAP_THRESHOLD_BYTES = 32 << 20
_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
_M_MMAP_THRESHOLD = -3
_TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest value mallopt takes (an int): never trim

_done: str | None = None


def tune_cpu_allocator() -> str | None:
    """Make glibc's ``malloc`` keep the memory CPU tensors free, once per process.

    torch's CPU allocator takes tensor storage from ``malloc``. By default glibc serves a
    block of 128 KiB or more (rising to the largest block freed, up to 32 MiB) with a fresh
    ``mmap``, and gives the top of its heap back to the OS whenever more than twice that is
    free. A training step frees its activations microbatch after microbatch, so the next one
    takes its memory from the OS again, one zero-filled page at a time. Here (2-core x86_64,
    torch 2.13.0+cpu) one ResNet-50-like step took 1.60 s with about 120,000 minor page faults
    and 1.34 s with 6,600 once the thresholds below were set; see
    ``benchmarks/pipeline_cpu/README.md``.

    Sets ``M_MMAP_THRESHOLD`` to :data:`MMAP_THRESHOLD_BYTES` (fixed: the dynamic rule is off)
    and ``M_TRIM_THRESHOLD`` to its largest value, as ``mallopt(3)`` describes
    (https://man7.org/linux/man-pages/man3/mallopt.3.html). The process then keeps its peak
    heap: resident memory stays at the most it has held, as with CUDA's caching allocator.
    Tensor memory figures (``measure_peak_bytes``) count tensors and are unchanged.

    Called by the runtimes and the profiler when they run on CPU, so profiles are measured
    with the allocator the pipeline runs with. A no-op off glibc (macOS, musl, Windows) and
    when ``$AUTOPART_MALLOC_TUNING`` is ``0``/``off``/``no``/``false``.

    Returns:
        What was set (``"M_MMAP_THRESHOLD=33554432 M_TRIM_THRESHOLD=2147483647"``), or None
        when nothing was (not glibc, turned off, or ``mallopt`` refused).
    """
    global _done
    if _done is not None:
        return _done
    if os.environ.get(MALLOC_ENV, "1").strip().lower() in ("0", "off", "no", "false"):
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
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)):
        return None
    _done = f"M_MMAP_THRESHOLD={MMAP_THRESHOLD_BYTES} M_TRIM_THRESHOLD={_TRIM_THRESHOLD_BYTES}"
    return _done
