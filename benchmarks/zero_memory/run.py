"""Per-rank peak memory of a pp2 x dp2 GPT-2 step under ZeRO 0-3, beside the plan's prediction.

Four gloo ranks (pp2 x dp2, one thread each) build a hand-fixed 1F1B plan (m = 2, cut at the
middle op node) for each ZeRO stage, take one warm-up step and one AdamW step (so the
optimizer state exists), then one step with ``measure_memory=True, optimizer=opt``
(``--repeats N``: N measured steps, each after another AdamW step; the table shows the
smallest and largest peak per rank).

Predictions, per pp rank: the at-rest state
(:func:`autopart.solver.data_parallel.state_multiplier`: weights 1x, gradients ``g = 1``,
AdamW's two float32 moments ``k = 2``, times the float32 parameter bytes the rank holds
before sharding, a tied parameter counted on each rank that holds it), and the plan's whole
peak: the same cuts, m and schedule costed by the layout search
(:func:`autopart.solver.layout_search.evaluate_layout` with ``positions``) on a profile of
the model (the distributed runtime's, measured here before the ranks start): state as the
runtime holds it at the step's peak, activations and working sets. Writes ``results.json``
and ``results.md`` beside this file.

Run: ``OMP_NUM_THREADS=1 python benchmarks/zero_memory/run.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
BATCH, SEQ, VOCAB, M, LAYERS = 8, 64, 4096, 2, 8
# (ZeRO stage, one FSDP unit per layer): whole-stage units for 0-3, then per-layer for 1-3
ARMS = ((0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True))


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # (batch, seq, vocab)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=256, n_head=4, vocab_size=VOCAB,
                                      n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                                      eos_token_id=0))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return x, y


def predicted_peaks() -> tuple[int, dict[int, list[int]]]:
    """(the cut, ZeRO stage -> the plan's predicted peak per pp rank, bytes): the layout
    search's costing of the benchmark's hand plan on a profile of the distributed runtime,
    profiled at the global batch with microbatches of the rows each rank runs."""
    from autopart.layout_planning import layout_request
    from autopart.options import CompileOptions
    from autopart.planning import profile_model
    from autopart.solver.layout_search import evaluate_layout, layout_candidates

    x, y = _inputs()
    # m = 2 microbatches of each replica's BATCH / 2 rows: BATCH / 4 rows each
    profile = profile_model(_gpt2(), (x,), devices=["cpu"] * 4, num_microbatches=2 * M,
                            loss_fn=_loss, example_target=y, backend="distributed")
    cut = len(profile.costs.nodes) // 2
    spec = profile.cluster().devices[0]
    options = profile.options(schedule_kind="1f1b", num_microbatches=M, stages_per_rank=1,
                              recompute=False, optimizer_state_bytes_per_param_byte=2.0)
    out = {}
    for zero, units in ARMS:
        layout = layout_request(CompileOptions(tp=1, dp=2, zero_stage=zero,
                                               zero_layer_units=units), 4, spec)
        cand = next(c for c in layout_candidates(profile.costs, spec, options, layout)
                    if c.pp == 2)
        plan = evaluate_layout(profile.costs, spec, options, layout, cand, positions=(cut,))
        assert plan.zero_layer_units == units
        out[f"{zero}{' per layer' if units else ''}"] = [r.peak_memory_bytes for r in plan.ranks]
    return cut, out


def _one(zero: int, units: bool, mesh: Any, cut: int, repeats: int) -> dict[str, Any]:
    from autopart.codegen import build_stages
    from autopart.core.capture import capture, op_nodes
    from autopart.core.memory import optimizer_tensors, resident_bytes
    from autopart.core.signature import InputSignature
    from autopart.runtime.distributed.pipeline import DistributedPipeline
    from autopart.solver.data_parallel import state_multiplier
    from tests.plans import manual_plan

    model = _gpt2()
    x, y = _inputs()
    part = BATCH // 2
    mine = slice(mesh.get_local_rank("dp") * part, (mesh.get_local_rank("dp") + 1) * part)
    captured = capture(copy.deepcopy(model), (x[mine][: part // M],))
    assert cut == len(op_nodes(captured.graph_module.graph)) // 2, "profile and capture differ"
    plan = manual_plan(captured, [cut], M, BATCH, schedule_kind="1f1b")
    plan = dataclasses.replace(plan, dp=2, zero_stage=zero, zero_layer_units=units)
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    cpu = torch.device("cpu")
    stages = build_stages(captured, plan, [cpu, cpu], ranks={dist.get_rank(pp)})
    held = sum(t.numel() * t.element_size() for (s, _), t in stages.placement.tensors.items()
               if s in stages.local and isinstance(t, nn.Parameter))
    pipe = DistributedPipeline(model, stages, InputSignature.of(captured), cpu, loss_fn=_loss,
                               pp_group=pp, dp_group=dp)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    pipe.train_step(x[mine], target=y[mine])
    opt.step()
    opt.zero_grad(set_to_none=True)
    between = resident_bytes([*pipe.parameters(), *optimizer_tensors(opt)])
    runs: list[list[int]] = []
    for i in range(repeats):
        if i:
            opt.step()
            opt.zero_grad(set_to_none=True)
        pipe.train_step(x[mine], target=y[mine], measure_memory=True, optimizer=opt)
        peaks = dict(pipe.last_peak_memory_bytes.by_rank)
        runs.append([peaks[r] for r in sorted(peaks)])
    state = [int(state_multiplier(zero, 2, 2.0, 1.0) * h)
             for h in _gather_ints(held, pp)]
    pipe.close()
    return {"zero_stage": zero, "arm": f"{zero}{' per layer' if units else ''}",
            "param_bytes_by_rank": _gather_ints(held, pp),
            "predicted_state_bytes_by_rank": state,
            "held_between_steps_bytes_by_rank": _gather_ints(between, pp),
            "measured_peak_bytes_by_rank": [max(col) for col in zip(*runs, strict=True)],
            "measured_min_peak_bytes_by_rank": [min(col) for col in zip(*runs, strict=True)]}


def _gather_ints(value: int, group: dist.ProcessGroup) -> list[int]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return [int(v) for v in out]


def worker(rank: int, world: int, port: int, out_dir: str, cut: int, repeats: int) -> None:
    """Every ZeRO stage on one pp2 x dp2 mesh; rank 0 writes the rows."""
    sys.path.insert(0, str(HERE.parents[1]))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    rows = [_one(zero, units, mesh, cut, repeats) for zero, units in ARMS]
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _markdown(rows: list[dict[str, Any]]) -> str:
    mib = 2 ** 20
    lines = ["| ZeRO | pp rank | params held (MiB) | at-rest state (MiB) | held between steps "
             "(MiB) | predicted peak (MiB) | measured peak, min-max (MiB) | predicted / max "
             "measured |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for r, (held, state, rest, want, lo, hi) in enumerate(zip(
                row["param_bytes_by_rank"], row["predicted_state_bytes_by_rank"],
                row["held_between_steps_bytes_by_rank"], row["predicted_peak_bytes_by_rank"],
                row["measured_min_peak_bytes_by_rank"], row["measured_peak_bytes_by_rank"],
                strict=True)):
            lines.append(f"| {row['arm']} | {r} | {held / mib:.1f} | {state / mib:.1f} | "
                         f"{rest / mib:.1f} | {want / mib:.1f} | {lo / mib:.1f}-{hi / mib:.1f} "
                         f"| {want / hi:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="measured steps per ZeRO stage (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cut, predicted = predicted_peaks()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(4, port, out, cut, args.repeats), nprocs=4, join=True)
        rows = json.loads(Path(out, "rows.json").read_text())
    for row in rows:
        row["predicted_peak_bytes_by_rank"] = predicted[row["arm"]]
    load = os.getloadavg()
    meta = {"machine": os.uname().nodename, "torch": torch.__version__, "cpus": os.cpu_count(),
            "load_average_1_5_15": [round(v, 1) for v in load], "repeats": args.repeats,
            "model": f"GPT-2 {LAYERS} layers, n_embd 256, vocab {VOCAB}, seq {SEQ}, global batch "
                     f"{BATCH}, m {M}, 1F1B, pp2 x dp2, float32, AdamW"}
    (HERE / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (HERE / "results.md").write_text(
        f"{meta['model']}; torch {meta['torch']}; {meta['cpus']} CPUs, load average "
        f"{meta['load_average_1_5_15']} at the end; {args.repeats} measured steps per ZeRO "
        "stage\n\n" + _markdown(rows))
    print(_markdown(rows))


if __name__ == "__main__":
    main()
