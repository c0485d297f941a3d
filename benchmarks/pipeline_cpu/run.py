"""Two-rank CPU pipeline efficiency: autopart vs torch.distributed.pipelining's Schedule1F1B.

Measures, in one run on this machine, a GPT-2-like model (8 layers, n_embd 256, batch 16 x
128, m = 8) trained for a few steps:
  (a) one process, one thread, the unpartitioned model;
  (b) torch.distributed.pipelining Schedule1F1B driving autopart's two stage modules
      (the same cuts, the same m), two gloo ranks with one thread each;
  (c) autopart's distributed pipeline (its own plan and schedule), same ranks and threads;
  (d) what users do today: torch.distributed.pipelining's pipeline() split by hand at
      transformer.h.4 (SplitPoint.BEGINNING), run by Schedule1F1B with the same m.
(b) and (d) all-reduce the tied wte / lm_head gradient as (c) does, so all three compute
the same gradients. (a) is timed before and after the two-rank runs, and its median over
both is the reference; each pipeline's speed-up over (a) is reported as a fraction of the
ideal m*p/(m+p-1).

    .venv/bin/python benchmarks/pipeline_cpu/run.py [--steps 5] [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYERS, N_EMBD, BATCH, SEQ, M, P = 8, 256, 16, 128, 8, 2


def build() -> tuple[Any, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=LAYERS, n_embd=N_EMBD, n_head=8, vocab_size=8192, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg), torch.randint(0, 8192, (BATCH, SEQ))


def single(steps: int) -> list[float]:
    from autopart.demo import gpt2_loss

    torch.set_num_threads(1)
    model, tokens = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        gpt2_loss(model(tokens), tokens).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[2:]


def ranked(rank: int, world: int, port: int, steps: int, plan_path: str, out_dir: str) -> None:
    import autopart
    from autopart.demo import gpt2_loss
    from autopart.plan import Plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    model, tokens = build()
    plan = Plan.load(plan_path)
    results: dict[str, list[float]] = {"autopart": [], "torch_1f1b": [], "torch_hand_split": []}
    # (c) autopart
    pipe = autopart.compile(model, (tokens,), loss_fn=gpt2_loss, plan=plan, backend="distributed")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

    def autopart_step() -> None:
        opt.zero_grad()
        pipe.train_step(tokens, target=tokens)
        opt.step()

    # (b) torch Schedule1F1B driving the same stage modules with the same m
    import torch.utils._pytree as pytree
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    stage_mod = pipe._stages_pp[0].submod
    out_spec = pipe._out_spec

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        return gpt2_loss(pytree.tree_unflatten(flat, out_spec), target)

    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(stage, plan.num_microbatches, loss_fn=loss)
    opt2 = torch.optim.AdamW(stage_mod.parameters(), lr=1e-4)

    def torch_step() -> None:
        opt2.zero_grad()
        if rank == 0:
            sched.step(tokens)
        else:
            sched.step(target=tokens)
        pipe._reduce_grads()  # the tied wte / lm_head replicas: the same tensors as (c)'s
        opt2.step()

    # (d) the hand split users write today: pipeline() + SplitPoint at layer 4, Schedule1F1B
    from torch.distributed.pipelining import SplitPoint, pipeline

    class Logits(torch.nn.Module):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm(x, use_cache=False).logits

    hand_model, _ = build()
    ir = pipeline(Logits(hand_model), mb_args=(tokens.chunk(M)[0],),
                  split_spec={f"lm.transformer.h.{LAYERS // 2}": SplitPoint.BEGINNING})
    hand_stage = ir.build_stage(rank, torch.device("cpu"))
    hand_sched = Schedule1F1B(hand_stage, M, loss_fn=lambda out, target: gpt2_loss(
        SimpleNamespace(logits=out), target))
    hand_mod = hand_stage.submod
    # the tied matrix: wte on stage 0 (stage 0 also lists an unused lm_head copy), lm_head on 1
    tied_name = "transformer.wte.weight" if rank == 0 else "lm_head.weight"
    tied = [p for n, p in hand_mod.named_parameters() if n.endswith(tied_name)]
    assert len(tied) == 1, [n for n, _ in hand_mod.named_parameters()]
    opt3 = torch.optim.AdamW(hand_mod.parameters(), lr=1e-4)

    def hand_step() -> None:
        opt3.zero_grad()
        if rank == 0:
            hand_sched.step(tokens)
        else:
            hand_sched.step(target=tokens)
        for p in tied:
            dist.all_reduce(p.grad)
        opt3.step()

    # Alternate step by step, so that any drift in the machine's load hits all alike.
    for i in range(steps + 2):
        for name, fn in (("autopart", autopart_step), ("torch_1f1b", torch_step),
                         ("torch_hand_split", hand_step)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                results[name].append(time.perf_counter() - t0)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    pipe.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", default=None,
                        help="fix autopart's schedule kind (default: the solver chooses)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    args = parser.parse_args()
    import tempfile

    import autopart
    from autopart.demo import gpt2_loss

    # plan with autopart on one thread (as the ranks will run), 2 ranks, m fixed to 8
    torch.set_num_threads(1)
    model, tokens = build()
    t0 = time.perf_counter()
    pipe = autopart.compile(copy.deepcopy(model), (tokens,), loss_fn=gpt2_loss, num_stages=P,
                            num_microbatches=M, schedule=args.schedule)
    plan_s = time.perf_counter() - t0
    tmp = tempfile.mkdtemp()
    plan_path = os.path.join(tmp, "plan.json")
    pipe.plan.save(plan_path)
    base = single(args.steps)  # (a) before and after the pipelines: drift hits it alike
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ranked, args=(P, port, args.steps, plan_path, tmp), nprocs=P, join=True)
    base += single(args.steps)
    per_rank = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(P)]
    ideal = M * P / (M + P - 1)
    t1 = statistics.median(base)
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
        "torch": torch.__version__, "model": f"GPT-2 {LAYERS} layers, n_embd {N_EMBD}, batch {BATCH}x{SEQ}",
        "num_microbatches": M, "ranks": P, "threads_per_rank": 1, "ideal_speedup": round(ideal, 4),
        "plan": {"schedule": pipe.plan.schedule_kind, "cuts": [c.position for c in pipe.plan.cuts],
                 "predicted_step_ms": round(pipe.plan.predicted_step_time_us / 1e3, 1),
                 "plan_s": round(plan_s, 1)},
        "single_process_step_s": round(t1, 4),
        "single_process_steps_s": [round(t, 4) for t in base],
    }
    for name in ("autopart", "torch_1f1b", "torch_hand_split"):
        tp = statistics.median(max(r[name][i] for r in per_rank) for i in range(args.steps))
        report[name] = {"step_s": round(tp, 4), "speedup": round(t1 / tp, 4),
                        "fraction_of_ideal": round(t1 / tp / ideal, 4),
                        "steps_s": [round(max(r[name][i] for r in per_rank), 4)
                                    for i in range(args.steps)]}
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
