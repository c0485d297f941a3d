"""What time-sharing a core costs a rank's computation, in CPU time.

The shared-core model (``RuntimeDescription.ranks_per_core``) lets ``n`` rank processes on
``c`` cores do ``c`` cores' worth of work: each action's core time is the profile's. This
script checks that premise. ``--procs`` processes (one thread each, unpinned) run the same
work over and over for ``--seconds``; each reports the median CPU time (``thread_time``) and
wall time of one call. With as many processes as cores (2 here) each has a core; with
twice as many, two share each core and the wall time doubles, so any rise in CPU time is
what sharing itself costs (context switches, caches refilled after another process ran).

Two kinds of work: ``gpt2``, one forward and backward of the fidelity benchmark's GPT-2-like
model (4 layers, n_embd 128, vocabulary 2048) on one microbatch of ``--rows`` x 64 tokens
(2 rows: the pp2xdp2 arm's microbatch); and ``matmul``, a chain of ``tanh((128 x 256) @ (256 x
256))`` as the collective probe computes (about as long per call), which barely touches
memory beyond its operands.

    .venv/bin/python benchmarks/fidelity_3d/time_slicing.py [--seconds 6] [--rows 2]

Prints a table; writes ``time_slicing.json`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, kind: str, rows: int, seconds: float, out: str) -> None:
    torch.set_num_threads(1)
    if kind == "gpt2":
        from autopart.apps.bench import load_workload

        config = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 2048,
                  "n_positions": 64, "batch": rows, "seq": 64}
        model, args, target, loss_fn = load_workload("hf:GPT2LMHeadModel", config)

        def work() -> None:
            loss_fn(model(*args), target).backward()
    else:
        gen = torch.Generator().manual_seed(rank)
        w = torch.randn(256, 256, generator=gen) / 16
        a = torch.randn(128, 256, generator=gen)

        def work() -> None:
            y = a
            for _ in range(40):
                y = torch.tanh(y @ w)
    for _ in range(5):
        work()
    cpu, wall = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c0, w0 = time.thread_time(), time.perf_counter()
        work()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    Path(out, f"rank_{rank}.json").write_text(json.dumps({
        "cpu_ms": statistics.median(cpu) * 1e3, "wall_ms": statistics.median(wall) * 1e3,
        "calls": len(cpu)}))


def measure(kind: str, procs: int, rows: int, seconds: float) -> list[dict[str, Any]]:
    """``procs`` spawned processes running ``kind``; each one's medians."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autopart-slicing-") as out:
        mp.start_processes(_worker, args=(kind, rows, seconds, out), nprocs=procs,
                           start_method="spawn")
        return [json.loads(Path(out, f"rank_{r}.json").read_text()) for r in range(procs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    for _ in range(opts.repeats):
        for kind in ("gpt2", "matmul"):
            for procs in (cores, 2 * cores):
                got = measure(kind, procs, opts.rows, opts.seconds)
                rows.append({"kind": kind, "procs": procs,
                             "cpu_ms": statistics.median(g["cpu_ms"] for g in got),
                             "wall_ms": statistics.median(g["wall_ms"] for g in got),
                             "load_1min": os.getloadavg()[0]})
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {cores} usable",
            "python": platform.python_version(), "torch": torch.__version__,
            "rows": opts.rows, "seconds": opts.seconds}
    print(f"{meta['machine']}, Python {meta['python']}, torch {meta['torch']}, {meta['date']}")
    print("| work | processes | CPU per call | wall per call | CPU against a core each |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        alone = [x["cpu_ms"] for x in rows if x["kind"] == r["kind"] and x["procs"] == cores]
        r["cpu_ratio"] = r["cpu_ms"] / statistics.median(alone)
        print(f"| {r['kind']} | {r['procs']} | {r['cpu_ms']:.2f} ms | {r['wall_ms']:.2f} ms "
              f"| {r['cpu_ratio']:.3f} |")
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    Path(opts.out, "time_slicing.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
