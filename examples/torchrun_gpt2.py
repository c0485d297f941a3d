"""Train a GPT-2-shaped model as a pipeline across processes with autopart.

Launch on one host with two ranks (CPU, gloo)::

    torchrun --nproc-per-node=2 examples/torchrun_gpt2.py --steps 3

Rank 0 profiles the model and solves the plan; every rank receives it, builds only its own
stages and runs the schedule. On GPUs the same script uses NCCL and one GPU per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import autopart
from autopart.apps.demo import gpt2_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--plan", default=None, help="replay this plan instead of solving")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)  # every rank builds the same weights
    config = GPT2Config(n_layer=args.layers, n_embd=args.n_embd, n_head=8, vocab_size=8192,
                        n_positions=args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 8192, (args.batch_size, args.seq_len))  # (batch, seq)
    # example_target: the loss's time on the last stage is measured, not guessed
    pipe = autopart.compile(model, (tokens,), loss_fn=gpt2_loss, example_target=tokens,
                            plan=args.plan, num_microbatches=args.num_microbatches)
    if dist.get_rank() == 0:
        plan = pipe.plan
        print(f"plan: {plan.num_stages} stages, {plan.schedule_kind}, m={plan.num_microbatches}, "
              f"cuts at {[c.position for c in plan.cuts]}", flush=True)
    # one parameter group, which may be empty (a rank whose stages hold no parameter)
    opt = torch.optim.AdamW([{"params": list(pipe.parameters())}], lr=1e-4)
    steps_s = []
    for step in range(args.steps):
        opt.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        loss = pipe.train_step(tokens, target=tokens)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends on its slowest rank
        steps_s.append(float(elapsed))
        opt.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}, {steps_s[-1]:.3f} s", flush=True)
    if dist.get_rank() == 0 and len(steps_s) > 1:
        measured = statistics.median(steps_s[1:])  # the first step warms up
        predicted = pipe.plan.predicted_step_time_us / 1e6
        print(f"step time: predicted {predicted:.3f} s, measured {measured:.3f} s (median of "
              f"{len(steps_s) - 1} after the first), predicted {predicted / measured - 1:+.1%}",
              flush=True)
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
