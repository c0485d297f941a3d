"""The zoo at tp = 2: each model on 2 gloo ranks (pp = 1), sharded as the solver finds, one step.

For each model type (default: the 20-type CI subset, :data:`benchmarks.zoo.models.CI_SUBSET`)
two forked processes join a gloo group (``tp = 2``, one pipeline stage) and each:

1. builds the tiny model (``models.build``: seed 0, the same weights on both ranks) and
   captures it at the microbatch size;
2. takes the parameter styles ``find_tensor_parallel`` finds in its analytical profile
   (``a100-80gb``; the pairs do not depend on the device): column/row pairs (attention's
   q/k/v -> output projection, the MLP's up/gate -> down, BERT's sibling modules) and the
   vocabulary-parallel embedding / head. A model with none is recorded as ``no_pairs``;
3. builds its one stage sharded for its tp rank (``build_stages(..., tp=)``); a
   :class:`~autopart.PlanError` (an op the pass cannot split, heads that 2 does not divide)
   is recorded as ``refused`` with its first line;
4. runs one ``train_step`` of 2 microbatches and compares, on rank 0, the loss, every
   parameter's gradient (sharded ones all-gathered to full) and every floating buffer with
   the unpartitioned model run by hand on the same microbatches, as the 2-stage sweep does
   (``run.py``'s relative error, :data:`benchmarks.zoo.run.TOLERANCE` = 1e-5, fp32).

``status`` is ``match``, ``mismatch``, ``no_pairs``, ``refused``, ``failed`` (another
error; its type and first line) or ``timeout``. Results go to ``results_tp2.json`` and
``results_tp2.md`` (``--out``), with the command and the machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zoo/tp.py [--only TYPE ...] [--timeout 240]

The runtime for tp > 1 is not yet reachable from ``autopart.compile`` (``CompileOptions``
refuses tp > 1 until the 3-D mesh lands), so this arm builds the stage with
``autopart.codegen.build_stages`` and wraps it in :class:`autopart.DistributedPipeline`, as
``tests/distributed/tp_worker.py`` does.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import platform
import socket
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.zoo.models import CI_SUBSET, Built, Entry, build, entries  # noqa: E402
from benchmarks.zoo.run import TOLERANCE, _errors, _first_line, _reference  # noqa: E402

__all__ = ["TP", "full_grads", "rank_main", "run_ranks", "run_tp_one", "markdown", "main"]

TP = 2
"""Tensor-parallel degree of the arm (2 gloo ranks)."""
MICROBATCHES = 2


def _plan(captured: Any, batch: int, styles: dict[str, str]) -> Any:
    """A one-stage plan of ``captured`` (no cuts, 1F1B of :data:`MICROBATCHES`) at tp =
    :data:`TP`, sharding ``styles``; predictions zero (nothing is solved)."""
    from autopart.core.plan import Plan, RankPlan, ShardedParameter, SolverReport, StagePlan

    stage = StagePlan(0, 0, "cpu", "", "", 0, ("", ""), 0, 0, 0.0, 0.0, 0.0, 0)
    return Plan(graph_fingerprint=captured.fingerprint, cluster_fingerprint="1xcpu",
                cost_source="manual", library_versions={}, optimize="speed", batch_size=batch,
                num_microbatches=MICROBATCHES, schedule_kind="1f1b", stages_per_rank=1,
                cuts=(), stages=(stage,), ranks=(RankPlan(0, "cpu", (0,), 0),),
                predicted_step_time_us=0.0, bubble_fraction=0.0,
                solver=SolverReport("MANUAL", 0.0, 0.0, 0.0, 0.0, name="manual"), tp=TP,
                sharded_parameters=tuple(ShardedParameter(k, v)
                                         for k, v in sorted(styles.items())))


def _styles(built: Built) -> tuple[Any, dict[str, str], int]:
    """(the capture at the microbatch size, the parameter styles, the number of pairs)."""
    from autopart.core.capture import capture
    from autopart.core.cluster import PRESETS
    from autopart.profiler import profile_analytical
    from autopart.solver.tensor_parallel import find_tensor_parallel

    kwargs = {k: v[: v.shape[0] // MICROBATCHES] for k, v in built.kwargs.items()}
    captured = capture(copy.deepcopy(built.model), (), kwargs)
    split = find_tensor_parallel(profile_analytical(captured, None, PRESETS["a100-80gb"]))
    return captured, dict(split.params), len(split.pairs)


def _step(built: Built, captured: Any, styles: dict[str, str], group: Any,
          ) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor], int]:
    """One train step on this tp rank: (loss, full gradients, buffers, the tp collectives
    in the stage's source); raises PlanError where the stage cannot be sharded."""
    import torch.distributed as dist

    from autopart import DistributedPipeline
    from autopart.codegen import TensorParallelRank, build_stages
    from autopart.core.signature import InputSignature

    plan = _plan(captured, next(iter(built.kwargs.values())).shape[0], styles)
    stages = build_stages(captured, plan, ["cpu"], ranks={0},
                          tp=TensorParallelRank.of_group(group))
    pp_group = [dist.new_group([r]) for r in range(TP)][dist.get_rank()]
    pipe = DistributedPipeline(copy.deepcopy(built.model), stages,
                               InputSignature.of(captured), torch.device("cpu"),
                               loss_fn=built.loss_fn, pp_group=pp_group, tp_group=group)
    collectives = sum(src.count("autopart.tp_") for src in pipe.stage_sources().values())
    loss = pipe.train_step(**built.kwargs, target=built.target)
    grads = full_grads(pipe, stages.shards, group, TP)
    buffers = {n: b for n, b in pipe.named_buffers()}
    pipe.close()
    return loss, grads, buffers, collectives


def full_grads(pipe: Any, shards: dict[str, Any], group: Any, size: int) -> dict[str, Any]:
    """Every parameter's gradient, those split in ``shards`` (FQN -> layout over ``group``
    of ``size`` ranks) all-gathered to full."""
    import torch.distributed as dist

    grads: dict[str, Any] = {}
    for fqn, p in pipe.named_parameters():
        grad = p.grad
        layout = shards.get(fqn)
        if layout is not None:
            g = grad if grad is not None else torch.zeros_like(p)
            parts = [torch.empty_like(g) for _ in range(size)]
            dist.all_gather(parts, g.contiguous(), group=group)
            grad = layout.full(parts)
        grads[fqn] = grad
    return grads


def _tp_arm(built: Built, rec: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """This tp rank's step of ``built``, its figures in ``rec``; None when ``rec`` is
    complete without one (no pairs)."""
    import torch.distributed as dist

    group = dist.new_group(list(range(TP)))
    captured, styles, pairs = _styles(built)
    rec.update(pairs=pairs, sharded=len(styles),
               vocab=sorted(k for k, v in styles.items() if v == "vocab"))
    if not styles:
        rec.update(status="no_pairs", error="no pairs found")
        return None
    loss, grads, buffers, rec["collectives"] = _step(built, captured, styles, group)
    return loss, grads, buffers


def rank_main(entry: Entry, rank: int, port: int, conn: Any, *, world: int,
              arm: Callable[[Built, dict[str, Any]], tuple[Any, Any, Any] | None]) -> None:
    """One rank of one model (a forked process of :func:`run_ranks`): join the gloo world,
    build the tiny model, run ``arm(built, rec)`` and, on rank 0, compare the ``(loss,
    gradients, buffers)`` it returns with the plain model; rank 0 sends the record. A
    :class:`~autopart.PlanError` from the arm is ``refused``, any other error ``failed``;
    an arm returning None has completed the record itself."""
    import warnings

    import torch.distributed as dist

    from autopart.core.errors import PlanError

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rec: dict[str, Any] = {"family": entry.family, "model_type": entry.model_type,
                           "class": entry.class_name}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        built = build(entry)
        try:
            result = arm(built, rec)
        except PlanError as exc:
            rec.update(status="refused", error=_first_line(exc))
        else:
            if result is not None and rank == 0:
                errs, missing = _errors(*result, _reference(built, True))
                worst = max(errs, key=errs.__getitem__)
                ok = errs[worst] <= TOLERANCE and not missing
                rec.update(status="match" if ok else "mismatch", max_rel_err=errs[worst],
                           worst=worst, missing_grads=missing[:5], checked=len(errs))
    except Exception as exc:
        rec.update(status="failed", error=_first_line(exc), error_type=type(exc).__name__,
                   traceback_tail=traceback.format_exc().strip().splitlines()[-4:])
    if rank == 0:
        conn.send(json.dumps(rec, default=str))
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_tp_one(entry: Entry, timeout_s: float = 240.0) -> dict[str, Any]:
    """Run ``entry`` at tp = 2 in two forked processes (one thread each); its record.

    A rank that does not answer within ``timeout_s`` seconds gives ``status="timeout"``;
    both processes are killed when the record is in.
    """
    return run_ranks(entry, functools.partial(rank_main, world=TP, arm=_tp_arm), TP, timeout_s)


def run_ranks(entry: Entry, rank_main: Any, world: int, timeout_s: float) -> dict[str, Any]:
    """Run ``rank_main(entry, rank, port, conn)`` in ``world`` forked processes; the record
    rank 0 sends through ``conn`` (JSON), with ``wall_s``.

    A rank that does not answer within ``timeout_s`` seconds gives ``status="timeout"``;
    every process is killed when the record is in.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    port = _free_port()
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=rank_main, args=(entry, r, port, send), daemon=True)
             for r in range(world)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    send.close()
    rec: dict[str, Any] = {"family": entry.family, "model_type": entry.model_type,
                           "class": entry.class_name, "status": "timeout",
                           "error": f"no answer within {timeout_s:.0f} s"}
    if recv.poll(timeout_s):
        try:
            rec = json.loads(recv.recv())
        except EOFError:
            rec.update(status="failed", error="rank 0 exited without a record")
    for p in procs:
        p.join(10.0)
        if p.is_alive():
            p.kill()
            p.join()
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    return rec


def markdown(result: dict[str, Any]) -> str:
    """The results as a Markdown page: counts by status, then one row per model."""
    counts = Counter(r["status"] for r in result["models"])
    lines = ["# zoo at tp = 2", "",
             f"Machine: {result['machine']}; python {result['python']}, torch "
             f"{result['torch']}, transformers {result['transformers']}. Command: "
             f"`{result['command']}`; {result['wall_s']:.0f} s wall. tp = 2 gloo ranks, pp = 1, "
             f"{MICROBATCHES} microbatches, the styles `find_tensor_parallel` finds; loss, "
             f"every gradient (gathered) and buffer within {TOLERANCE:g} (relative, fp32) of "
             "the plain model run by hand on the same microbatches.", "",
             "| status | models |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(counts.items())]
    lines += ["", "pairs: column/row pairs found; vocab: vocabulary-parallel embeddings and "
              "heads; collectives: `autopart::tp_*` calls in the sharded stage's source.", "",
              "| family | model type | pairs | vocab | collectives | status | max rel err | s "
              "| reason |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["models"], key=lambda r: (r["family"], r["model_type"])):
        err = r.get("max_rel_err")
        why = (r.get("error") or "").replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| {r['family']} | {r['model_type']} | {r.get('pairs', '')} | "
                     f"{len(r.get('vocab', []))} | {r.get('collectives', '')} | {r['status']} | "
                     f"{'' if err is None else f'{err:.1e}'} | {r.get('wall_s', '')} | {why} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="model types to run (default: the CI subset)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per model")
    ap.add_argument("--out", type=Path, default=HERE, help="folder for results_tp2.*")
    a = ap.parse_args()
    os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"})
    torch.set_num_threads(1)
    import transformers

    import autopart.codegen  # noqa: F401  (imported once, before the forks)
    import autopart.runtime.distributed.pipeline  # noqa: F401
    from autopart.core.jsonio import write_text_atomic

    wanted = a.only or [t for types in CI_SUBSET.values() for t in types]
    pairs = {(f, t) for f, types in CI_SUBSET.items() for t in types}
    todo = [e for e in entries() if e.model_type in wanted
            and (a.only or (e.family, e.model_type) in pairs)]
    t0 = time.perf_counter()
    records = []
    for i, entry in enumerate(todo):
        rec = run_tp_one(entry, a.timeout)
        records.append(rec)
        print(f"[{i + 1}/{len(todo)}] {entry.family}/{entry.model_type}: {rec['status']} "
              f"{rec.get('wall_s')} s {rec.get('error', '')[:120]}", flush=True)
    result = {"command": " ".join(["benchmarks/zoo/tp.py", *sys.argv[1:]]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), one thread "
                         "per rank", "python": platform.python_version(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "tp": TP, "microbatches": MICROBATCHES, "tolerance": TOLERANCE,
              "wall_s": round(time.perf_counter() - t0, 1),
              "counts": dict(Counter(r["status"] for r in records)), "models": records}
    a.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(a.out / "results_tp2.json", json.dumps(result, indent=1, default=str) + "\n")
    write_text_atomic(a.out / "results_tp2.md", markdown(result))
    print(json.dumps(result["counts"]))


if __name__ == "__main__":
    main()
