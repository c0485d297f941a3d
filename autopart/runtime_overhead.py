"""What the distributed runtime spends on each transfer between ranks beside its link time.

torch.distributed.pipelining's schedule runs every action through Python: it looks the action
up, posts the action's sends and receives as gloo work, waits on them, and hands the stage its
received buffers. None of that is in a profile (which times the graph's ops) or in the link's
ping-pong (which times one bare ``send``/``recv`` pair). On this project's 2-core CPU (torch
2.13.0+cpu, 2 gloo ranks x 1 thread) a pipeline whose compute is negligible (an 8-layer,
32-wide MLP) measured 23.7 ms a step at 1F1B m = 16 against 6.1 ms predicted without it, and
55.7 against 7.8 ms interleaved (v = 2, where a middle stage's action both receives and
sends): about half a millisecond per transfer, a few per cent of a GPT-2-like step at 2 rows
per microbatch, and more where the schedule has more transfers.

:func:`run_tiny_pipeline` runs such a pipeline through :func:`autopart.compile`'s distributed
backend in two gloo processes on this host (``python -m autopart._overhead_rank``);
:func:`autopart.planning.measure_host_figures` fits the per-transfer cost at which the
cost model's replay of it takes the measured step (:func:`fit_transfer_overhead`; each action
of that two-stage pipeline has one transfer), and
:func:`cached_transfer_overhead` keeps it in the profile cache per machine, as
:func:`autopart.profiler.links.host_link` keeps the link.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from autopart.core.errors import ProfileError
from autopart.core.jsonio import write_text_atomic
from autopart.profiler import cache as _cache
from autopart.profiler.links import run_rank_pair

__all__ = ["METHOD", "MICROBATCHES", "STEPS", "WARMUP", "cached_transfer_overhead",
           "fit_transfer_overhead", "run_tiny_pipeline", "store_transfer_overhead", "workload"]

#: What is measured, and how; part of the cache file's name, so a change measures again
#: (v2: the runtime pins each CPU rank to its own cores).
METHOD = "tiny-mlp-1f1b-m16-median-v2-pinned"
#: Microbatches of the measured 1F1B pipeline (two ranks, one stage each).
MICROBATCHES = 16
#: Untimed and timed steps of the measured pipeline.
WARMUP, STEPS = 3, 15


def workload() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]:
    """The measured model: 8 x ``Linear(32, 32)`` (about 0.1 ms of compute per action), a
    batch of 64 x 32, mean-squared error; seeded, so both ranks and the planner build the
    same one."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])
    x = torch.randn(64, 32, generator=gen)
    y = torch.randn(64, 32, generator=gen)
    return model, x, y, torch.nn.functional.mse_loss


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


def run_tiny_pipeline(plan_path: str, *, timeout_s: float = 300.0) -> tuple[list[float], list[float]]:
    """Two gloo processes on this host (``python -m autopart._overhead_rank``, through
    :func:`autopart.profiler.links.run_rank_pair`) time the link between them
    (:func:`autopart.profiler.links.one_way_times` at :data:`autopart.profiler.links.SIZES`),
    then run the plan at ``plan_path`` (a plan of :func:`workload` on two ``cpu`` ranks):
    :data:`STEPS` steps after :data:`WARMUP`, each the slower rank's, after a barrier. About
    5 s here.

    Returns:
        ``(steps in s, one-way times per size in µs)``.

    Raises:
        ProfileError: the processes failed or did not finish within ``timeout_s``.
    """
    data = run_rank_pair("autopart._overhead_rank", [plan_path],
                         what="timing the distributed runtime on two gloo processes",
                         timeout_s=timeout_s, fix="check that the host allows local TCP connections")
    return [float(t) for t in data["steps_s"]], [float(t) for t in data["one_way_us"]]


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
