"""Two-rank CPU pipeline efficiency: autopart vs torch.distributed.pipelining's schedules.

Measures, in one run on this machine, a GPT-2-like model (8 layers, n_embd 256, batch 16 x
128, m = 8) trained step after step:
  (a) one process, one thread, the unpartitioned model;
  (b) torch.distributed.pipelining's Schedule1F1B driving autopart's stage modules with the
      same m, two gloo ranks with one thread each. When autopart's plan has one stage per
      rank these are (c)'s own modules; when it interleaves (Schedule1F1B runs one stage per
      rank), they come from the best one-stage-per-rank 1F1B plan solved on the same costs;
  (b') with an interleaved plan: torch's ScheduleInterleaved1F1B driving (c)'s own stages;
  (c) autopart's distributed pipeline (its plan and schedule), same ranks and threads;
  (d) what users do today: torch.distributed.pipelining's pipeline() split by hand at
      transformer.h.4 (SplitPoint.BEGINNING), run by Schedule1F1B with the same m.
(b), (b') and (d) all-reduce the tied wte / lm_head gradient as (c) does, so all compute
the same gradients. The pipelines alternate step by step, in an order rotated each step, in
the same processes; (a) is timed before and after them and its median over both is the
reference. Each pipeline's speed-up over (a) is reported as a fraction of the ideal
m*p/(m+p-1), and each other arm's step time over autopart's, paired step by step, with a
bootstrap 95% interval of the median ratio.

    .venv/bin/python benchmarks/pipeline_cpu/run.py [--steps 15] [--schedule KIND]
        [--stages-per-rank V] [--out results.json]
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

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYERS, N_EMBD, BATCH, SEQ, M, P = 8, 256, 16, 128, 8, 2
WARMUP = 3  # untimed steps first


def build() -> tuple[Any, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=LAYERS, n_embd=N_EMBD, n_head=8, vocab_size=8192, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg), torch.randint(0, 8192, (BATCH, SEQ))


def single(steps: int) -> list[float]:
    from autopart.apps.demo import gpt2_loss

    torch.set_num_threads(1)
    model, tokens = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + WARMUP):
        t0 = time.perf_counter()
        opt.zero_grad()
        gpt2_loss(model(tokens), tokens).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[WARMUP:]


def ranked(rank: int, world: int, port: int, steps: int, plan_path: str, plan_1f1b_path: str,
           out_dir: str, pin_torch: bool = True) -> None:
    from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B

    import autopart
    from autopart.apps.demo import gpt2_loss
    from autopart.core.plan import Plan
    from autopart.runtime.host import on_cores

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    model, tokens = build()
    plan, plan_1f1b = Plan.load(plan_path), Plan.load(plan_1f1b_path)
    steps_of: dict[str, Any] = {}

    # (c) autopart: its plan and schedule
    pipe = autopart.compile(copy.deepcopy(model), (tokens,), loss_fn=gpt2_loss, plan=plan,
                            backend="distributed")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

    def autopart_step() -> None:
        opt.zero_grad()
        pipe.train_step(tokens, target=tokens)
        opt.step()

    steps_of["autopart"] = autopart_step

    def torch_step(sched: Any, params: list[torch.Tensor], tied: Any) -> Any:
        """One step of a torch schedule; ``tied()`` all-reduces the tied wte / lm_head grad."""
        optim = torch.optim.AdamW(params, lr=1e-4)

        def step() -> None:
            optim.zero_grad()
            # on the cores autopart's train_step runs on (pipe.cpu_cores, when it pins): a
            # like-for-like comparison of the schedules; --unpinned-torch-arms leaves them
            with on_cores(pipe.cpu_cores if pin_torch else None):
                if rank == 0:
                    sched.step(tokens)
                else:
                    sched.step(target=tokens)
                tied()
            optim.step()
        return step

    loss = pipe.loss_of_flat  # gpt2_loss on the last stage's flat output

    # (b) torch's Schedule1F1B driving autopart's stage modules with the same m: (c)'s own
    # modules when its plan has one stage per rank, else the best one-stage-per-rank 1F1B
    # plan solved on the same costs
    pipe_b = pipe if plan_1f1b == plan else autopart.compile(
        copy.deepcopy(model), (tokens,), loss_fn=gpt2_loss, plan=plan_1f1b, backend="distributed")
    stage_mod = pipe_b.pipeline_stages[0].submod
    sched = Schedule1F1B(PipelineStage(stage_mod, rank, world, torch.device("cpu")),
                         plan.num_microbatches, loss_fn=loss)
    steps_of["torch_1f1b"] = torch_step(sched, list(stage_mod.parameters()), pipe_b.reduce_grads)

    # (b') with an interleaved plan: torch's ScheduleInterleaved1F1B driving (c)'s very stages
    if plan.schedule_kind == "interleaved_1f1b":
        stages = [PipelineStage(st.submod, st.stage_index, plan.num_stages, torch.device("cpu"))
                  for st in pipe.pipeline_stages]
        isched = ScheduleInterleaved1F1B(stages, plan.num_microbatches, loss_fn=loss)
        params = [p for st in stages for p in st.submod.parameters()]
        steps_of["torch_interleaved_1f1b"] = torch_step(isched, params, pipe.reduce_grads)

    # (d) the hand split users write today: pipeline() + SplitPoint at layer 4, Schedule1F1B
    class Logits(torch.nn.Module):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm(x, use_cache=False).logits

    ir = pipeline(Logits(copy.deepcopy(model)), mb_args=(tokens.chunk(M)[0],),
                  split_spec={f"lm.transformer.h.{LAYERS // 2}": SplitPoint.BEGINNING})
    hand_stage = ir.build_stage(rank, torch.device("cpu"))
    hand_sched = Schedule1F1B(hand_stage, M, loss_fn=lambda out, target: gpt2_loss(
        SimpleNamespace(logits=out), target))
    hand_mod = hand_stage.submod
    # the tied matrix: wte on stage 0 (stage 0 also lists an unused lm_head copy), lm_head on 1
    tied_name = "transformer.wte.weight" if rank == 0 else "lm_head.weight"
    tied = [p for n, p in hand_mod.named_parameters() if n.endswith(tied_name)]
    assert len(tied) == 1, [n for n, _ in hand_mod.named_parameters()]

    def reduce_hand() -> None:
        for p in tied:
            dist.all_reduce(p.grad)

    steps_of["torch_hand_split"] = torch_step(hand_sched, list(hand_mod.parameters()), reduce_hand)

    # Alternate step by step, so that any drift in the machine's load hits all alike, and
    # rotate the order each step, so that no arm always runs first or after the same one.
    results: dict[str, list[float]] = {name: [] for name in steps_of}
    names = list(steps_of)
    for i in range(steps + WARMUP):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = steps_of[name]
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= WARMUP:
                results[name].append(time.perf_counter() - t0)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    pipe.close()
    if pipe_b is not pipe:
        pipe_b.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--schedule", default=None,
                        help="fix autopart's schedule kind (default: the solver chooses)")
    parser.add_argument("--stages-per-rank", type=int, default=None,
                        help="fix autopart's virtual stages per rank (default: the solver chooses)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    parser.add_argument("--unpinned-torch-arms", action="store_true",
                        help="run torch's arms on every core (autopart's steps still run on "
                             "their own cores); default: on the same cores as autopart's")
    args = parser.parse_args()
    import tempfile

    import autopart

    # Plan with autopart on one thread (as the ranks will run), 2 ranks, m fixed to 8. One
    # profile serves both plans: autopart's choice, and the best one-stage-per-rank 1F1B
    # plan that (b) runs when autopart's choice has more stages per rank.
    torch.set_num_threads(1)
    model, tokens = build()
    devices = ["cpu"] * P
    plan, profile = autopart.plan_model(copy.deepcopy(model), (tokens,), devices=devices,
                                        num_microbatches=M, schedule_kind=args.schedule,
                                        stages_per_rank=args.stages_per_rank,
                                        backend="distributed")  # what (b) and (c) run
    timings = profile.timings_s
    tmp = tempfile.mkdtemp()
    plan_path = os.path.join(tmp, "plan.json")
    plan.save(plan_path)
    plan_1f1b, plan_1f1b_path = plan, plan_path
    if plan.stages_per_rank > 1:
        plan_1f1b = profile.solve(schedule_kind="1f1b", stages_per_rank=1)
        plan_1f1b_path = os.path.join(tmp, "plan_1f1b.json")
        plan_1f1b.save(plan_1f1b_path)
    base = single(args.steps)  # (a) before and after the pipelines: drift hits it alike
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ranked, args=(P, port, args.steps, plan_path, plan_1f1b_path, tmp,
                           not args.unpinned_torch_arms), nprocs=P,
             join=True)
    base += single(args.steps)
    per_rank = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(P)]
    ideal = M * P / (M + P - 1)
    t1 = statistics.median(base)

    def describe(p: Any) -> dict[str, Any]:
        return {"schedule": p.schedule_kind, "stages_per_rank": p.stages_per_rank,
                "cuts": [c.position for c in p.cuts],
                "predicted_step_ms": round(p.predicted_step_time_us / 1e3, 1)}

    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
        "torch": torch.__version__, "model": f"GPT-2 {LAYERS} layers, n_embd {N_EMBD}, batch {BATCH}x{SEQ}",
        "num_microbatches": M, "ranks": P, "threads_per_rank": 1, "ideal_speedup": round(ideal, 4),
        "torch_arms_pinned": not args.unpinned_torch_arms,
        "plan": {**describe(plan), "split_backward_us_per_node": profile.runtime.split_backward_us_per_node,
                 "timings_s": {k: round(v, 1) for k, v in timings.items()}},
        "plan_torch_1f1b": describe(plan_1f1b),
        "single_process_step_s": round(t1, 4),
        "single_process_steps_s": [round(t, 4) for t in base],
    }
    step_times = {name: [max(r[name][i] for r in per_rank) for i in range(args.steps)]
                  for name in per_rank[0]}
    for name, times in step_times.items():
        tp = statistics.median(times)
        report[name] = {"step_s": round(tp, 4), "speedup": round(t1 / tp, 4),
                        "fraction_of_ideal": round(t1 / tp / ideal, 4),
                        "steps_s": [round(t, 4) for t in times]}
        if name != "autopart":
            # paired, step by step: the arms ran one after another within each step
            ratios = np.array([t / a for t, a in zip(times, step_times["autopart"], strict=True)])
            # 95% bootstrap interval of the median ratio (10,000 resamples, fixed seed)
            rng = np.random.default_rng(0)
            boot = np.median(rng.choice(ratios, (10_000, len(ratios))), axis=1)
            report[name]["time_over_autopart"] = {
                "median": round(float(np.median(ratios)), 4),
                "median_95ci": [round(float(q), 4) for q in np.quantile(boot, [0.025, 0.975])],
                "min": round(float(ratios.min()), 4), "max": round(float(ratios.max()), 4),
                "autopart_faster_in": f"{int((ratios > 1).sum())}/{len(ratios)} steps"}
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
