"""What a runtime whose ranks are processes spends on each transfer between them, beside
its link time: fitted to a tiny pipeline run in two gloo processes, and cached per machine.

A schedule runs every action through Python: it looks the action up, posts the action's
sends and receives, waits on them, and hands the stage its received buffers. None of that is
in a profile (which times the graph's ops) or in the link's ping-pong (one bare
``send``/``recv`` pair). :func:`run_transfer_ranks` runs a pipeline of negligible compute in
two processes (the runtime names the program); :func:`fit_transfer_overhead` finds the
per-transfer cost at which the cost model's replay of it takes the measured step; and
:func:`host_figures` keeps it, with the link, in the profile cache per machine.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from autopart.core.errors import ProfileError
from autopart.core.jsonio import write_text_atomic
from autopart.profiler import cache as _cache
from autopart.profiler.links import (
    LinkFigures,
    cached_host_link,
    host_link,
    one_way_times,
    run_rank_pair,
    store_host_link,
)

__all__ = ["METHOD", "MICROBATCHES", "cached_transfer_overhead", "fit_transfer_overhead",
           "run_transfer_ranks", "store_transfer_overhead", "host_figures"]

#: What is measured, and how; part of the cache file's name, so a change measures again
#: (v2: the runtime pins each CPU rank to its own cores).
METHOD = "tiny-mlp-1f1b-m16-median-v2-pinned"
#: Microbatches of the measured 1F1B pipeline (two ranks, one stage each).
MICROBATCHES = 16


def fit_transfer_overhead(predict_us: Callable[[float], float], measured_us: float, *,
                        tolerance_us: float = 1.0, high_us: float = 100_000.0) -> float:
    """The per-transfer cost ``a`` >= 0 at which ``predict_us(a)`` (a step's predicted time,
    µs, non-decreasing in ``a``) equals ``measured_us``, found by bisection to
    ``tolerance_us``; 0.0 when the prediction without it is already at or above the
    measurement.

    Raises:
        ProfileError: no ``a`` up to ``high_us`` reaches the measurement.
    """
    if predict_us(0.0) >= measured_us:
        return 0.0
    if predict_us(high_us) < measured_us:
        raise ProfileError(f"a step of {measured_us:.0f} µs is not reached with {high_us:.0f} µs "
                           "per transfer: the pipeline ran far slower than any per-transfer cost "
                           "explains (another job loading this machine?); measure again on a "
                           "quiet machine")
    lo, hi = 0.0, high_us
    while hi - lo > tolerance_us:
        mid = (lo + hi) / 2
        if predict_us(mid) < measured_us:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def run_transfer_ranks(steps_entry: str, plan_path: str, *, timeout_s: float = 300.0,
                       ) -> tuple[list[float], list[float]]:
    """Two gloo processes on this host (``python -m autopart.profiler.transfer_overhead``,
    through :func:`autopart.profiler.links.run_rank_pair`) time the link between them
    (:func:`autopart.profiler.links.one_way_times` at :data:`autopart.profiler.links.SIZES`),
    then call the runtime's ``steps_entry`` (``"module:function"``, e.g.
    ``autopart.runtime.distributed.transfer_rank:time_steps``: ``function(rank, plan_path) -> [s, ...]``,
    each step the slower rank's) on the plan at ``plan_path``. The runtime is named, not
    imported: the profiler runs it across a process boundary.

    Returns:
        ``(steps in s, one-way times per size in µs)``.

    Raises:
        ProfileError: the processes failed or did not finish within ``timeout_s``.
    """
    data = run_rank_pair("autopart.profiler.transfer_overhead", [plan_path, steps_entry],
                         what="timing the distributed runtime on two gloo processes",
                         timeout_s=timeout_s, fix="check that the host allows local TCP connections")
    return [float(t) for t in data["steps_s"]], [float(t) for t in data["one_way_us"]]


def _rank_main(rank: int, store: str, out: str, plan_path: str, steps_entry: str) -> None:
    """One of :func:`run_transfer_ranks`' two processes; rank 0 writes
    ``{"steps_s": [...], "one_way_us": [...]}`` to ``out``."""
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as each pipeline rank runs on CPU
    module, _, function = steps_entry.partition(":")
    time_steps = getattr(importlib.import_module(module), function)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        one_way = one_way_times(rank)
        times = time_steps(rank, plan_path)
        if rank == 0:
            write_text_atomic(Path(out), json.dumps({"steps_s": times, "one_way_us": one_way}))
    finally:
        dist.destroy_process_group()


def cached_transfer_overhead() -> float | None:
    """The per-transfer cost kept in the profile cache for this machine
    (:func:`autopart.profiler.cache.host_file`, with :data:`METHOD`), µs, or None (none, or a
    damaged file)."""
    path = _cache.host_file("transfer-overhead", METHOD)
    if not path.is_file():
        return None
    try:
        value = float(json.loads(path.read_text())["transfer_overhead_us"])
    except (ValueError, TypeError, KeyError):
        return None  # measured again and overwritten
    return value if value >= 0 else None


def store_transfer_overhead(value: float) -> None:
    """Keep ``value`` (µs) in the profile cache as this machine's per-transfer cost."""
    path = _cache.host_file("transfer-overhead", METHOD)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"transfer_overhead_us": value, "method": METHOD}))


def host_figures(measure: Callable[[], tuple[LinkFigures, float]], use_cache: bool = True,
                 ) -> tuple[LinkFigures | None, float]:
    """This host's link between CPU ranks and the runtime's cost per transfer (µs): read from
    the profile cache per machine (:func:`autopart.profiler.links.cached_host_link`,
    :func:`cached_transfer_overhead`) where both are there, else ``measure()`` (the caller's:
    it plans and runs the tiny pipeline, :func:`run_transfer_ranks`) and stored; a figure
    already cached is kept. Measured while the machine is oversubscribed
    (:func:`autopart.profiler.cache.machine_busy`), they are used but not stored. When they
    cannot be measured: a ``RuntimeWarning``, the link timed alone
    (:func:`autopart.profiler.links.host_link`) and no cost per transfer."""
    link = cached_host_link() if use_cache else None
    overhead = cached_transfer_overhead() if use_cache else None
    if link is not None and overhead is not None:
        return link, overhead
    busy = _cache.machine_busy()
    try:
        link_now, overhead_now = measure()
    except ProfileError as exc:
        warnings.warn(f"{exc}; planning with no per-transfer cost of the runtime",
                      RuntimeWarning, stacklevel=2)
        return (link if link is not None else host_link(use_cache)), overhead or 0.0
    if use_cache and busy is None and _cache.machine_busy() is None:
        if link is None:
            store_host_link(link_now)
        if overhead is None:
            store_transfer_overhead(overhead_now)
    return (link if link is not None else link_now,
            overhead if overhead is not None else overhead_now)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
