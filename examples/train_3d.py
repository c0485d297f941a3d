"""Train a GPT-2-like model on a solver-chosen 3D plan (tp x pp x dp, ZeRO stage) across processes.

Launch on one host with four CPU ranks (gloo)::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=4 examples/train_3d.py [--tp 1] [--dp 2]
        [--zero-stage 0] [--steps 6]

Rank 0 profiles the model (random weights from a ``GPT2Config``) and searches the layouts of the
world's ranks, tensor-parallel degree, pipeline ranks, data-parallel replicas and ZeRO stage,
with the flags fixing any of them; every rank receives the plan, joins its (pp, dp, tp) mesh
and builds only its own stages. Every rank passes the same global batch; each data-parallel
replica trains on its rows. Rank 0 also trains the unpartitioned model on the same batches
and prints both losses, then the predicted and measured step time and per-rank peak memory.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import autopart
from autopart.apps.demo import gpt2_loss

VOCAB = 2048


def _at_least(low: int):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The example's flags; ``--tp``, ``--dp`` and ``--zero-stage`` fix those axes (default:
    the solver chooses), ``--plan`` replays a saved plan instead."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tp", type=_at_least(1), default=None,
                        help="tensor-parallel degree (default: the solver's)")
    parser.add_argument("--dp", type=_at_least(1), default=None,
                        help="data-parallel replicas (default: the solver's)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage over dp (default: the solver's)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with tp > 1: Megatron's sequence parallelism (layer norms and "
                             "residuals on 1/tp of the tokens)")
    parser.add_argument("--steps", type=_at_least(2), default=6,
                        help="training steps; the first is warm-up, the rest are timed")
    parser.add_argument("--layers", type=_at_least(1), default=4)
    parser.add_argument("--n-embd", type=_at_least(8), default=128)
    parser.add_argument("--n-head", type=_at_least(1), default=4)
    parser.add_argument("--batch-size", type=_at_least(1), default=16, help="global batch")
    parser.add_argument("--seq-len", type=_at_least(2), default=64)
    parser.add_argument("--num-microbatches", type=_at_least(1), default=None,
                        help="microbatches per replica (default: the solver's)")
    parser.add_argument("--plan", default=None, help="replay this plan file instead of solving")
    parser.add_argument("--save-plan", default=None, help="write the plan here (rank 0)")
    args = parser.parse_args(argv)
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.plan is not None and any(v is not None for v in (args.tp, args.dp, args.zero_stage)):
        parser.error("--plan fixes the layout; drop --tp/--dp/--zero-stage to replay it")
    return args


def _model(args: argparse.Namespace) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=args.layers, n_embd=args.n_embd, n_head=args.n_head,
                        vocab_size=VOCAB, n_positions=args.seq_len, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                        eos_token_id=0)  # dropout off: the losses must match exactly
    torch.manual_seed(0)  # every rank builds the same weights
    return GPT2LMHeadModel(config)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = _model(args)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    reference = copy.deepcopy(model) if rank0 else None
    batches = [torch.randint(0, VOCAB, (args.batch_size, args.seq_len),
                             generator=torch.Generator().manual_seed(1000 + step))
               for step in range(args.steps)]  # (batch, seq), the same on every rank
    layout = {"tp": args.tp, "dp": args.dp, "zero_stage": args.zero_stage,
              "sequence_parallel": args.sequence_parallel}
    pipe = autopart.compile(model, (batches[0],), loss_fn=gpt2_loss, example_target=batches[0],
                            plan=args.plan, num_microbatches=args.num_microbatches,
                            **({} if args.plan else {**layout, "layout_search": True}))
    plan = pipe.plan
    if rank0:
        print(f"plan: tp {plan.tp}{' (sequence parallel)' if plan.sequence_parallel else ''} x "
              f"pp {len(plan.ranks)} x dp {plan.dp}, ZeRO-{plan.zero_stage};"
              f" {plan.num_stages} stages, m={plan.num_microbatches} per replica, "
              f"{plan.schedule_kind}, cuts at {[c.position for c in plan.cuts]}", flush=True)
        if args.save_plan:
            plan.save(args.save_plan)
    # one parameter group, which may be empty: a rank whose only stage holds no parameter
    # (an embedding's reshape) still steps, and torch refuses an empty parameter list
    opt = torch.optim.AdamW([{"params": list(pipe.parameters())}], lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3) if reference else None
    steps_s = []
    for step, tokens in enumerate(batches):
        opt.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        loss = pipe.train_step(tokens, target=tokens)  # this replica's rows; the batch's loss
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends on its slowest rank
        steps_s.append(float(elapsed))
        opt.step()
        if reference is not None and ref_opt is not None:
            ref_opt.zero_grad()
            ref = gpt2_loss(reference(tokens), tokens)
            ref.backward()
            ref_opt.step()
            ref_loss = ref.item()
            print(f"step {step}: loss {float(loss):.6f}, unpartitioned {ref_loss:.6f} "
                  f"(diff {abs(float(loss) - ref_loss):.1e}), {steps_s[-1]:.3f} s",
                  flush=True)
    opt.zero_grad()
    pipe.train_step(batches[0], target=batches[0], measure_memory=True, optimizer=opt)
    peak = pipe.last_peak_memory_bytes
    mine = peak.by_device["cpu" if pipe.device.type == "cpu" else str(pipe.device)] if peak else 0
    peaks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, mine)
    if rank0:
        measured = statistics.median(steps_s[1:])  # the first step warms up
        predicted = plan.predicted_step_time_us / 1e6
        print(f"step time: predicted {predicted:.3f} s, measured {measured:.3f} s (median of "
              f"{len(steps_s) - 1} after the first), predicted {predicted / measured - 1:+.1%}",
              flush=True)
        for r, got in enumerate(peaks):
            pp_rank = r // (plan.tp * plan.dp)  # r = (pp * dp + dp_i) * tp + tp_i
            want = plan.ranks[pp_rank].peak_memory_bytes
            print(f"rank {r} (pp {pp_rank}, dp {r // plan.tp % plan.dp}, tp {r % plan.tp}): "
                  f"peak predicted {want / 2**20:.1f} MiB, measured {got / 2**20:.1f} MiB",
                  flush=True)
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
