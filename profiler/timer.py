"""Device seam of the profiler: device checks, per-call timers (CPU clock, CUDA events), RNG."""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from autopart.core.errors import ProfileError

__all__ = ["check_device", "time_calls", "time_samples", "spread", "RngState"]

_DEVICE_RE = re.compile(r"^(cpu|cuda:(\d+))$")

# A factory does the untimed set-up of one call (e.g. cloning tensors the op writes to)
# and returns the thunk that is timed.
CallFactory = Callable[[], Callable[[], Any]]


def check_device(device: str) -> torch.device:
    """Validate a profiling device string.

    Args:
        device: ``"cpu"`` or ``"cuda:N"``.

    Returns:
        The parsed :class:`torch.device`.

    Raises:
        ProfileError: the string is malformed, CUDA is asked for but
            ``torch.cuda.is_available()`` is False, or ``N`` is not a visible GPU.
    """
    match = _DEVICE_RE.match(device)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        choices = "'cpu', " + ", ".join(f"'cuda:{i}'" for i in range(count))
    else:
        count = 0
        choices = "'cpu' (torch.cuda.is_available() is False)"
    if match is None:
        raise ProfileError(f"profile device {device!r} is not valid; choose one of {choices}")
    if match.group(2) is not None:
        if count == 0:
            raise ProfileError(f"profile device {device!r} needs CUDA, but "
                               f"torch.cuda.is_available() is False; choose one of {choices}")
        if int(match.group(2)) >= count:
            raise ProfileError(f"profile device {device!r} is not a visible GPU "
                               f"({count} visible); choose one of {choices}")
    return torch.device(device)


def time_calls(device: torch.device, factory: CallFactory, warmup: int, repeats: int,
               long_us: float = math.inf, host: list[float] | None = None,
               ) -> tuple[float, Any]:
    """Median of :func:`time_samples`: ``(median µs, result of the last call)``; ``host``
    as there."""
    samples, result = time_samples(device, factory, warmup, repeats, long_us, host)
    return float(statistics.median(samples)), result


def spread(samples: list[float]) -> float:
    """Relative spread of timing samples: ``(max - min) / median`` (0 for one sample)."""
    if len(samples) < 2:
        return 0.0
    med = statistics.median(samples)
    return (max(samples) - min(samples)) / med if med > 0 else 0.0


def time_samples(device: torch.device, factory: CallFactory, warmup: int, repeats: int,
                 long_us: float = math.inf, host: list[float] | None = None,
                 ) -> tuple[list[float], Any]:
    """Call ``factory()()`` ``warmup + repeats`` times and time the repeats.

    Only the thunk is timed, never the factory's set-up. On CPU each call is timed with
    ``time.perf_counter``; on CUDA with a ``torch.cuda.Event`` pair per call, recorded on
    the current stream, and one synchronize after the last call (none inside a timed
    region). When the first call takes ``long_us`` or more, it is the warm-up and the
    faster of two more calls is the only sample (after ``timeit.Timer.autorange``, a long
    call needs few samples; a first call also pays for touching fresh memory, and on this
    project's shared CPU machine a call that allocates hundreds of MB, e.g. a loss over
    134 MB of logits, was 3x slower once in four from page-fault stalls, which only ever
    slow a call down); on CUDA that check synchronizes once, after the first call's end
    event.

    On CUDA, when ``host`` is given, the two figures of each timed call are taken apart (the
    cost model's device time and host issue time):

    - host: ``time.perf_counter`` around the thunk alone (inside the event pair, no
      synchronize), appended to ``host`` in µs, one per sample (the smaller of the two
      after a long first call). The host waits for the device only where the op itself
      synchronizes, which the figure then rightly includes.
    - device: the timed calls are queued behind a wait on the device (a spin kernel,
      :func:`_device_wait`) three times as long as issuing them takes at the slowest
      warm-up call's pace (200 µs to 20 ms), so the device reaches each call's start
      event after its kernels are queued: the event pair
      spans the kernels and not the gaps in which the device waited for the host to launch
      them (with a pair per call on an idle device, small ops measured about 5x their cost
      in a step on an H100, ``benchmarks/gpu/README.md``).

    On the CPU the host runs the op: ``host`` is left as it is.

    Args:
        device: where the calls run.
        factory: untimed set-up; returns the thunk to time.
        warmup: untimed calls first (>= 0).
        repeats: timed calls (>= 1).
        long_us: first-call duration, µs, from which the faster of two more calls is the
            only sample.
        host: on CUDA, receives each timed call's host issue time, µs (default None).

    Returns:
        ``(µs of each timed call, result of the last call)``.
    """
    result: Any = None
    samples: list[float] = []
    calls, i, long_first = warmup + repeats, 0, False
    if device.type == "cuda":
        pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        issued: list[float] = []
        while i < calls:
            thunk = factory()
            if i == warmup and host is not None:  # queue the timed calls behind a wait
                _device_wait(device, min(max(3 * (calls - warmup) * max(issued, default=0.0),
                                             _MIN_WAIT_US), _MAX_WAIT_US))
                issued.clear()
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            h0 = time.perf_counter()
            result = thunk()
            h1 = time.perf_counter()
            end.record()
            if i == 0 and math.isfinite(long_us):
                end.synchronize()
                first_us = float(start.elapsed_time(end)) * 1e3  # ms -> µs
                if first_us >= long_us:
                    warmup, calls, long_first = 1, 3, True
            issued.append((h1 - h0) * 1e6)
            if i >= warmup:
                pairs.append((start, end))
            i += 1
        torch.cuda.synchronize(device)
        samples = [float(s.elapsed_time(e)) * 1e3 for s, e in pairs]
        if host is not None:
            host.extend([min(issued)] if long_first else issued)
    else:
        while i < calls:
            thunk = factory()
            t0 = time.perf_counter()
            result = thunk()
            us = (time.perf_counter() - t0) * 1e6
            if i == 0 and us >= long_us:
                warmup, calls, long_first = 1, 3, True
            if i >= warmup:
                samples.append(us)
            i += 1
    if long_first:
        samples = [min(samples)]
    return samples, result


#: The device wait before timed calls, µs: at least (the warm-up's issue may be too fast to
#: time), at most (ops that long are not launch-bound).
_MIN_WAIT_US, _MAX_WAIT_US = 200.0, 20_000.0

#: Spin-kernel cycles per µs, per CUDA device index (:func:`_device_wait`).
_CYCLES_PER_US: dict[int, float] = {}


def _device_wait(device: torch.device, us: float) -> None:
    """Queue about ``us`` µs of waiting on ``device``'s current stream, returning at once:
    ``torch.cuda._sleep``, a spin kernel of a number of clock cycles (torch's own tests use
    it to hold a stream), calibrated once per device against a pair of CUDA events."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_US:
        cycles = 1_000_000
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda._sleep(1_000)  # load the kernel
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_US[index] = cycles / max(float(start.elapsed_time(end)) * 1e3, 1e-3)
    torch.cuda._sleep(int(us * _CYCLES_PER_US[index]))


class RngState:
    """Snapshot of the CPU (and, on CUDA, that device's) random state, restored on exit."""

    def __init__(self, device: torch.device) -> None:
        """Capture the random state now.

        Args:
            device: the profiling device; its CUDA generator is saved too when it is a GPU.
        """
        self._device = device
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def __enter__(self) -> RngState:
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state(self._cuda, self._device)
