"""What a collective among CPU ranks costs beyond its ring steps, measured on this host.

A tensor-parallel stage computes a little, then all-reduces, again and again; a data-parallel
replica reduces its gradients after the flush. Between gloo processes each such collective
costs far more than its ring steps of point-to-point latency: the group's ranks arrive at
different times (one was preempted, or shares its core with another rank) and a rank that
waited must be woken and scheduled again. That cost grows with the work done since the last
collective (a longer computation is more often preempted) and with the ranks per core, and it
depends on the load of the host: it is measured when a plan is made, not cached.

:func:`measure_collective_overhead` starts ``world`` gloo processes (as many as the plan's
world, so that they share the host's cores as its ranks will), in groups of consecutive
ranks (tp innermost). Each alternates two arms: ``k`` units of work followed by a
functional-collective all-reduce within its group (as ``autopart::tp_reduce`` runs it), and
the same work alone; per work size, the difference of the arms' means is the collective's
cost. A third arm posts a receive from the pair's other rank before the work, as the
distributed runtime posts a step's receives first on gloo, then sends it a message and waits
for both (a pipeline's neighbours exchange an activation and its gradient): half its
difference is the cost of one transfer. Every work size is timed in every block, so each
spans the whole probe; the arms' means over the blocks are compared (a step pays the
occasional long wait too). Ranks that have a core each are pinned to it, as the distributed
runtime pins them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopart.core.errors import ProfileError
from autopart.core.jsonio import write_text_atomic
from autopart.profiler.links import run_rank_pair

__all__ = ["UNITS", "MESSAGE_BYTES", "LARGE_BYTES", "ProbeFigures", "measure_collective_overhead",
           "probe_points"]

#: Work sizes timed, in units of one ``tanh((128 x 256) @ (256 x 256))`` (about 60 µs on one
#: core of this project's CPU): from a layer's small op to a whole block (200 units, about
#: 12 ms: the work between context parallelism's exchanges, one per attention, or a
#: data-parallel reduction after a backward; past 40 units the wait still grew, 2.1 -> 2.6 ms
#: per collective in cp 2's attention on this project's CPU).
UNITS = (1, 6, 40, 200)
#: The all-reduced message, bytes: small, so that its ring time is a few µs.
MESSAGE_BYTES = 16 << 10
#: The large message whose all-reduce, beside the small one's, gives the bandwidth gloo's
#: collectives reach, bytes.
LARGE_BYTES = 2 << 20
_BLOCKS = 15
_ITERS = 4
#: Work from which each sample is one iteration, in units (the 200-unit samples are as long
#: as 4 of 40 units; the probe stays a few seconds).
_LONG_UNITS = 100
#: Blocks of the bandwidth's two arms (each a few ms).
_BANDWIDTH_BLOCKS = 31


@dataclass(frozen=True)
class ProbeFigures:
    """What :func:`measure_collective_overhead` measured, per work size, in core time.

    Attributes:
        collective_points: ``(work µs, µs per collective)``
            (``RuntimeDescription.collective_overhead_points``).
        transfer_points: ``(work µs, µs per transfer)``: one message between two ranks after
            that work, beyond the link's time (``RuntimeDescription.transfer_wait_points``).
        bandwidth_bytes_per_s: the bus bandwidth of an all-reduce (``2 (g - 1) / g`` times
            its bytes over its time, as :func:`autopart.solver.collectives.all_reduce_us`
            prices it), from a :data:`LARGE_BYTES` and a :data:`MESSAGE_BYTES` all-reduce
            after the least work (``RuntimeDescription.collective_bandwidth_bytes_per_s``).
        copy_bytes_per_s: bytes per second of one copy, from a data-parallel reduction's
            three passes (``torch.cat`` of 32 gradients into one flat bucket, the division by
            the replicas, a copy back into each) over :data:`LARGE_BYTES`
            (``RuntimeDescription.copy_bytes_per_s``).
    """

    collective_points: tuple[tuple[float, float], ...]
    transfer_points: tuple[tuple[float, float], ...]
    bandwidth_bytes_per_s: float
    copy_bytes_per_s: float


def probe_points(rank: int, world: int, group_size: int, ranks_per_core: float,
                 units: Sequence[int] = UNITS) -> dict[str, Any]:
    """On every rank of an initialised gloo process group of ``world`` ranks (even): per work
    size, ``(work µs, µs per collective)`` under ``"points"`` and ``(work µs, µs per
    transfer)`` under ``"transfer_points"``, in core time (divided by ``ranks_per_core``),
    and the all-reduce's bus bandwidth in core time under ``"bandwidth_bytes_per_s"``
    (:class:`ProbeFigures`), the medians over the ranks; every rank returns the same.

    Args:
        rank, world: this rank and the world size.
        group_size: ranks per all-reduce group, consecutive ranks (``world`` must be a
            multiple).
        ranks_per_core: rank processes per core of the host (>= 1).
        units: work sizes timed, in units (:data:`UNITS`).
    """
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    groups = [dist.new_group(list(range(s, s + group_size)))
              for s in range(0, world, group_size)]
    group = groups[rank // group_size]
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(256, 256, generator=gen) / 16
    a = torch.randn(128, 256, generator=gen)
    msg = torch.ones(MESSAGE_BYTES // 4)  # (MESSAGE_BYTES / 4,) float32
    large = torch.ones(LARGE_BYTES // 4)

    def work(k: int) -> torch.Tensor:
        y = a
        for _ in range(k):
            y = torch.tanh(y @ w)
        return y

    def reduce() -> None:
        funcol.wait_tensor(funcol.all_reduce(msg, "sum", group))

    peer = rank ^ 1
    inbox = torch.empty_like(msg)

    def posted() -> Any:  # the runtime posts a step's receives before it computes
        return dist.irecv(inbox, peer)

    def exchange(receive: Any) -> None:  # then sends after the work and waits for both
        send = dist.isend(msg, peer)
        receive.wait()
        send.wait()

    for k in units:
        for _ in range(3):
            receive = posted()
            work(k)
            reduce()
            exchange(receive)
    dist.barrier()
    # every work size in every block, so that each is timed across the whole probe (the
    # scheduler's placement of the processes on the cores shifts as it runs)
    timed: dict[int, list[list[float]]] = {k: [[], [], []] for k in units}
    for block in range(_BLOCKS):
        for k in units:
            for arm in (block % 3, (block + 1) % 3, (block + 2) % 3):
                iters = 1 if k >= _LONG_UNITS else _ITERS
                t0 = time.perf_counter()
                for _ in range(iters):
                    receive = posted() if arm == 2 else None
                    work(k)
                    if arm == 0:
                        reduce()
                    elif receive is not None:
                        exchange(receive)
                timed[k][arm].append((time.perf_counter() - t0) / iters * 1e6)
            reduce()  # the arms of every rank start together
    mine: list[tuple[float, float, float]] = []
    for k in units:
        # means, not medians: a step pays every collective's wait, and the waits are skewed
        # (a preempted peer now and then): on this project's 2-core CPU the means of the
        # 16 KiB all-reduce's cost ran 20-30 % above the medians, and in cp 2's attention
        # the 1 MiB all-gathers waited 1.8-2.4 ms on the mean where their median was 1.0-1.6
        r_us, a_us, x_us = (statistics.mean(t) for t in timed[k])
        mine.append((a_us / ranks_per_core, max(r_us - a_us, 0.0) / ranks_per_core,
                     max(x_us - a_us, 0.0) / 2 / ranks_per_core))
    # the bandwidth: a large all-reduce against the small one, after the least work
    sizes: list[list[float]] = [[], []]
    for block in range(_BANDWIDTH_BLOCKS):
        for arm in ((0, 1) if block % 2 == 0 else (1, 0)):
            buf = msg if arm == 0 else large
            t0 = time.perf_counter()
            for _ in range(_ITERS):
                work(units[0])
                funcol.wait_tensor(funcol.all_reduce(buf, "sum", group))
            sizes[arm].append((time.perf_counter() - t0) / _ITERS * 1e6)
    extra_us = max(statistics.median(sizes[1]) - statistics.median(sizes[0]), 1e-3)
    ring_bytes = 2 * (group_size - 1) / group_size * (LARGE_BYTES - MESSAGE_BYTES)
    bandwidth = ring_bytes / (extra_us / ranks_per_core) * 1e6
    # the bucket's copies: 32 gradients packed, divided, copied back
    grads = list(large.chunk(32))
    copies = []
    for _ in range(_BANDWIDTH_BLOCKS):
        t0 = time.perf_counter()
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(group_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        copies.append((time.perf_counter() - t0) * 1e6)
    copy_rate = 3 * LARGE_BYTES / (max(statistics.median(copies), 1e-3) / ranks_per_core) * 1e6
    every: list[tuple[list[tuple[float, float, float]], float, float]] = [([], 0.0, 0.0)] * world
    dist.all_gather_object(every, (mine, bandwidth, copy_rate))
    med = [tuple(statistics.median(r[0][i][j] for r in every) for j in range(3))
           for i in range(len(units))]
    return {"points": [(m[0], m[1]) for m in med],
            "transfer_points": [(m[0], m[2]) for m in med],
            "bandwidth_bytes_per_s": statistics.median(r[1] for r in every),
            "copy_bytes_per_s": statistics.median(r[2] for r in every)}


def measure_collective_overhead(world: int, *, group_size: int = 2,
                                ranks_per_core: float = 1.0, ring_us: float = 0.0,
                                link_us: float = 0.0, timeout_s: float = 120.0,
                                ) -> ProbeFigures:
    """:func:`probe_points` run in ``world`` fresh gloo processes on this host (about 3-15 s,
    most of it starting them), the probe's own :data:`MESSAGE_BYTES` message's time as the
    cost model prices it taken off (``ring_us`` from each collective, ``link_us`` from each
    transfer, so it is not counted twice), never below 0.

    Args:
        world: processes, as many as the plan's ranks on this host (>= 2).
        group_size: ranks per group (default 2, the smallest tp; divides ``world``).
        ranks_per_core: rank processes per core (``RuntimeDescription.ranks_per_core``).
        ring_us: µs to take off each collective's cost.
        link_us: µs to take off each transfer's cost.
        timeout_s: the processes are killed after this long.

    Raises:
        ProfileError: a bad world or group, or the processes failed or timed out.
    """
    if world < 2 or group_size < 2 or world % group_size:
        raise ProfileError(f"a collective probe needs world >= 2 ranks in groups of >= 2 that "
                           f"divide it, got world {world}, groups of {group_size}")
    data = run_rank_pair("autopart.profiler.collective_probe",
                         [str(world), str(group_size), repr(float(ranks_per_core))],
                         what=f"timing gloo collectives in {world} processes",
                         timeout_s=timeout_s, ranks=world,
                         fix="check that the host allows local TCP connections")
    return ProbeFigures(
        tuple((float(wk), max(float(us) - ring_us, 0.0)) for wk, us in data["points"]),
        tuple((float(wk), max(float(us) - link_us, 0.0)) for wk, us in data["transfer_points"]),
        float(data["bandwidth_bytes_per_s"]), float(data["copy_bytes_per_s"]))


def _rank_main(rank: int, store: str, out: str, world: int, group_size: int,
               ranks_per_core: float) -> None:
    """One of :func:`measure_collective_overhead`'s processes; rank 0 writes
    ``{"points": [[work_us, us], ...], "transfer_points": [...], "bandwidth_bytes_per_s": x,
    "copy_bytes_per_s": y}`` to ``out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as each CPU rank runs
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cores and world <= len(cores):  # a core (or more) each: pinned, as the runtime does
        share = len(cores) // world
        os.sched_setaffinity(0, cores[rank * share:(rank + 1) * share])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    try:
        points = probe_points(rank, world, group_size, ranks_per_core)
        if rank == 0:
            write_text_atomic(Path(out), json.dumps(points))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
               float(sys.argv[6]))
