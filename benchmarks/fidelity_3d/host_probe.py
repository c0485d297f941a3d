"""What sharing this host's cores costs: a CPU loop in 1, c and n processes, and gloo all-reduces.

Two figures the cost model of ``run.py`` reads from elsewhere, measured directly:

- **sharing factor**: the same single-threaded torch loop (eight 512 x 512 matmuls with tanh,
  a few MB of working set) in ``c`` processes (one per core) and in ``n`` processes; the
  processor-sharing replay of the simulator assumes ``n / c`` (work conserved), so a
  measured ``t(n) / t(c)`` above it is what switching between processes on a core costs
  (caches refilled, context switches).
- **gloo all-reduce**: the time of one ``dist.all_reduce`` of 4 KiB, 64 KiB and 1 MiB among
  2 and 4 processes, beside the ring model's ``2 (k - 1)`` steps of the measured
  point-to-point latency.

    .venv/bin/python benchmarks/fidelity_3d/host_probe.py

Prints one line per figure.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (4096, 65536, 1 << 20)
REPEATS = 100


def _loop(rank: int, out: Any) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    ws = [torch.randn(512, 512, generator=gen) / 24 for _ in range(8)]
    x = torch.randn(256, 512, generator=gen)
    for _ in range(20):
        for w in ws:
            x = torch.tanh(x @ w)
    t0 = time.perf_counter()
    for _ in range(300):
        for w in ws:
            x = torch.tanh(x @ w)
    out.put(time.perf_counter() - t0)


def sharing(n: int) -> float:
    """Mean seconds of the loop over ``n`` processes running at once."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_loop, args=(i, out)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    times = [out.get() for _ in range(n)]
    return sum(times) / len(times)


def _collectives(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        for _ in range(10):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(REPEATS):
            dist.all_reduce(x)
        us = (time.perf_counter() - t0) / REPEATS * 1e6
        if rank == 0:
            print(f"all_reduce {world} ranks {nbytes:>8} B: {us:8.0f} µs", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    print(f"load average {os.getloadavg()[0]:.1f}, {cores} cores, torch {torch.__version__}")
    base = sharing(min(cores, 4))
    for n in (1, 2 * cores):
        t = sharing(n)
        print(f"loop in {n} processes: {t:.2f} s each; vs {cores} processes: {t / base:.2f}x "
              f"(work conserved: {max(1.0, n / cores):.2f}x)", flush=True)
    for world in (2, 4):
        mp.start_processes(_collectives, args=(world, 29700 + world), nprocs=world,
                           start_method="spawn")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
