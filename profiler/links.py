"""The point-to-point link between CPU ranks on this host (gloo), measured: latency and bandwidth."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from autopart.core.errors import ProfileError
from autopart.core.jsonio import write_text_atomic
from autopart.profiler import cache as _cache

__all__ = ["LinkFigures", "SIZES", "fit_link", "measure_host_link", "host_link", "one_way_times",
           "cached_host_link", "store_host_link", "run_rank_pair"]

#: Message sizes timed, bytes: from an activation row to a large CNN activation.
SIZES = (16 << 10, 256 << 10, 2 << 20, 16 << 20)
#: What the measurement is; part of the cache file's name, so a change measures again.
METHOD = "gloo-pingpong-v1"


@dataclass(frozen=True, slots=True)
class LinkFigures:
    """One direction of the link between two ranks, as ``Cluster.transfer_us`` charges it:
    ``latency_us + nbytes / bandwidth_bytes_per_s * 1e6``.

    Attributes:
        latency_us: fixed cost of one message, µs.
        bandwidth_bytes_per_s: bytes/s once the message is large.
        sizes: the message sizes timed, bytes.
        one_way_us: per size, half the fastest round trip, µs.
        backend: the process-group backend timed (``"gloo"``).
    """

    latency_us: float
    bandwidth_bytes_per_s: float
    sizes: tuple[int, ...]
    one_way_us: tuple[float, ...]
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if not (self.latency_us >= 0 and self.bandwidth_bytes_per_s > 0):
            raise ProfileError(f"link figures must have latency >= 0 and bandwidth > 0, got "
                               f"{self.latency_us} µs and {self.bandwidth_bytes_per_s} B/s")

    def transfer_us(self, nbytes: int) -> float:
        """Time of one message of ``nbytes``, µs."""
        return self.latency_us + nbytes / self.bandwidth_bytes_per_s * 1e6


def fit_link(sizes: tuple[int, ...], one_way_us: tuple[float, ...],
             backend: str = "gloo") -> LinkFigures:
    """Fit ``t(n) = latency + n / bandwidth`` to timed messages.

    Least squares on the relative error (each row divided by its time), so the small
    messages set the latency and the large ones the bandwidth; a negative intercept is
    clamped to 0 and the slope refitted through the origin.

    Args:
        sizes: message sizes, bytes (at least two distinct).
        one_way_us: their times, µs.

    Raises:
        ProfileError: fewer than two distinct sizes, or times that do not grow with size.
    """
    if len(set(sizes)) < 2 or len(sizes) != len(one_way_us):
        raise ProfileError(f"fit_link needs one time per size and two distinct sizes, got "
                           f"sizes {sizes} and times {one_way_us}")
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(one_way_us, dtype=float)
    a = np.stack([np.ones_like(n), n], axis=1) / t[:, None]
    (lat, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if lat < 0:
        lat, per_byte = 0.0, float(np.sum(n * t / t**2) / np.sum(n * n / t**2))
    if per_byte <= 0:
        seen = dict(zip(sizes, one_way_us, strict=True))
        raise ProfileError(f"timed messages do not grow with their size ({seen} µs): the "
                           "machine was probably busy; measure again when it is quiet")
    return LinkFigures(float(lat), float(1e6 / per_byte), tuple(int(x) for x in sizes),
                       tuple(float(x) for x in one_way_us), backend)


def _round_trip(rank: int, buf: torch.Tensor) -> None:
    """Rank 0 sends ``buf`` to rank 1, which sends it back."""
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def one_way_times(rank: int, sizes: tuple[int, ...] = SIZES, repeats: int = 11) -> list[float]:
    """On rank ``rank`` (0 or 1) of an initialised two-rank process group: ``repeats`` round
    trips per size, after two untimed ones (a new pair's first messages are slow); per size
    half the fastest trip, µs (a descheduled process only ever slows a trip). Both ranks
    call it; both get the same sizes' times as rank 0 measured them locally."""
    bufs = [torch.ones(size // 4) for size in sizes]  # (size / 4,) float32 each
    for buf in bufs:
        _round_trip(rank, buf)
        _round_trip(rank, buf)
    fastest = []
    for buf in bufs:
        samples = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            _round_trip(rank, buf)
            samples.append((time.perf_counter() - t0) / 2 * 1e6)
        fastest.append(min(samples))
    return fastest


def _pingpong(rank: int, store: str, out: str, sizes: tuple[int, ...], repeats: int) -> None:
    """One of the two processes: :func:`one_way_times`; rank 0 writes them."""
    torch.set_num_threads(1)  # as each pipeline rank runs on CPU
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        fastest = one_way_times(rank, sizes, repeats)
        if rank == 0:
            write_text_atomic(Path(out), json.dumps(fastest))
    finally:
        dist.destroy_process_group()


def run_rank_pair(module: str, args: Sequence[str], *, what: str, timeout_s: float,
                  fix: str, ranks: int = 2) -> Any:
    """Run ``python -m MODULE RANK STORE OUT ARGS...`` for ranks ``0 .. ranks - 1`` (default
    0 and 1) and return the JSON that rank 0 wrote to ``OUT``.

    Fresh interpreters (they never import the caller's script, which spawned processes
    would), one OpenMP thread each; ``STORE`` and ``OUT`` are files in a temporary directory,
    ``STORE`` for ``init_process_group("gloo", init_method="file://STORE")``.

    Raises:
        ProfileError: ``"{what} took over {timeout_s} s; {fix}"`` when both have not exited
            within ``timeout_s`` (they are killed), ``"{what} failed: ..."`` with a
            process's last line of stderr when one exits non-zero.
    """
    with tempfile.TemporaryDirectory(prefix="autopart-ranks-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-m", module, str(rank), store, out, *args],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
                 for rank in range(ranks)]
        errors = []
        deadline = time.monotonic() + timeout_s
        try:
            for proc in procs:
                try:
                    _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    raise ProfileError(f"{what} took over {timeout_s:g} s; {fix}") from None
                if proc.returncode:
                    lines = err.decode(errors="replace").strip().splitlines()
                    errors.append(lines[-1] if lines else f"exit code {proc.returncode}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if errors:
            raise ProfileError(f"{what} failed: {errors[0]}")
        return json.loads(Path(out).read_text())


def measure_host_link(*, sizes: tuple[int, ...] = SIZES, repeats: int = 11,
                      timeout_s: float = 120.0) -> LinkFigures:
    """Time messages between two gloo processes on this host and fit :func:`fit_link`.

    Two fresh interpreters run this module (``python -m autopart.profiler.links``,
    :func:`run_rank_pair`), one thread each. Each size makes ``repeats`` round trips after two
    warm-up trips; half the fastest round trip is its one-way time (a process that loses its
    core only ever slows a trip down, as in the profiler's timing). Takes about 3 s, most of
    it starting the processes.

    Raises:
        ProfileError: the processes failed or did not finish within ``timeout_s``.
    """
    times = run_rank_pair(
        "autopart.profiler.links", [",".join(map(str, sizes)), str(repeats)],
        what="timing the link between two gloo processes", timeout_s=timeout_s,
        fix="check that the host allows local TCP connections, or plan from device presets")
    return fit_link(tuple(sizes), tuple(times))


@functools.lru_cache(maxsize=1)
def host_link(use_cache: bool = True) -> LinkFigures | None:
    """This host's gloo link, measured once per process and kept in the profile cache.

    The cache file is named by the CPU model, torch's version and :data:`METHOD`; like CPU
    profiles, a measurement taken while the machine is oversubscribed
    (:func:`autopart.profiler.cache.machine_busy`) is used but not stored.

    Returns:
        The figures, or None (with a ``RuntimeWarning`` saying why) when the link could not
        be timed: planning then uses the ``cpu`` preset's nominal figures.
    """
    cached = cached_host_link() if use_cache else None
    if cached is not None:
        return cached
    busy = _cache.machine_busy()
    try:
        figures = measure_host_link()
    except ProfileError as exc:
        warnings.warn(f"{exc}; planning with the cpu preset's nominal link figures instead",
                      RuntimeWarning, stacklevel=2)
        return None
    if use_cache and busy is None and _cache.machine_busy() is None:
        store_host_link(figures)
    return figures


def cached_host_link() -> LinkFigures | None:
    """The link figures kept in the profile cache for this machine, or None (none, or a
    damaged file)."""
    path = _cache.host_file("link", METHOD)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return LinkFigures(**{**data, "sizes": tuple(data["sizes"]),
                              "one_way_us": tuple(data["one_way_us"])})
    except (ValueError, TypeError, KeyError, ProfileError):
        return None  # measured again and overwritten


def store_host_link(figures: LinkFigures) -> None:
    """Keep ``figures`` in the profile cache as this machine's link (atomically)."""
    path = _cache.host_file("link", METHOD)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(asdict(figures)))


if __name__ == "__main__":  # one of measure_host_link's two processes
    _pingpong(int(sys.argv[1]), sys.argv[2], sys.argv[3],
              tuple(int(x) for x in sys.argv[4].split(",")), int(sys.argv[5]))
