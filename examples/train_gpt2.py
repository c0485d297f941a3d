"""Train GPT-2 as an autopart pipeline under torchrun, for as long as it takes.

Two CPU ranks (gloo), 200 steps, a checkpoint every 50, resumable::

    torchrun --nproc-per-node=2 examples/train_gpt2.py --out runs/gpt2 --steps 200
    torchrun --nproc-per-node=2 examples/train_gpt2.py --out runs/gpt2 --steps 200 --resume

Data: a file of uint16 token ids (``--data``, nanoGPT's ``.bin`` layout). Without one, the
script writes ``<out>/tokens.bin`` from a text file (``--text``, default this repository's
README) with a byte-level tokenizer (vocabulary 256): nothing is downloaded. Step ``k``
reads batch ``k`` (random offsets from ``--seed`` and ``k``), so a resumed run sees the
batches the uninterrupted run would have.

Training: AdamW (weight decay on matrices only), linear warm-up then cosine decay of the
learning rate (computed from the step, so nothing extra to checkpoint), gradient clipping
by the whole model's norm (``pipe.clip_grad_norm_``), bf16 autocast (``--amp none`` for
float32), a checkpoint of model + optimizer every ``--ckpt-every`` steps (``pipe.save``,
DCP, atomic), ``--resume`` from the latest. Rank 0 shows a rich progress bar and logs each
step's loss, tokens/s and step time (and MFU on GPU) to ``<out>/log.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import GPT2Config, GPT2LMHeadModel

import autopart
from autopart.core.jsonio import write_text_atomic
from autopart.runtime.checkpoint.save_load import checkpoint_plan

ROOT = Path(__file__).resolve().parents[1]
# Dense bf16 tensor-core peak, FLOP/s: NVIDIA H100 SXM5 and H200 datasheets (989.4 TFLOPS),
# A100 datasheet (312 TFLOPS). Other GPUs: pass --peak-tflops.
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="run folder: checkpoints, log, plan")
    p.add_argument("--data", type=Path, help="uint16 token file (default: <out>/tokens.bin)")
    p.add_argument("--text", type=Path, default=ROOT / "README.md",
                   help="text to tokenize byte-level when there is no --data")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--plan", type=Path, help="replay this plan instead of solving")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--amp", choices=("bf16", "none"), default="bf16")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--resume", action="store_true", help="continue from <out>/ckpt's latest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hold-after-step", type=int, metavar="N",
                   help="fault injection for resume tests: after step N is logged, every rank "
                        "waits until it is killed (so a kill lands at a known step)")
    p.add_argument("--peak-tflops", type=float, help="GPU peak for MFU (default: datasheet)")
    return p.parse_args()


def tokens(args: argparse.Namespace) -> np.ndarray:
    """The token ids (uint16), written from ``--text`` by rank 0 when there is no ``--data``."""
    path = args.data or args.out / "tokens.bin"
    if args.data is None and (not dist.is_initialized() or dist.get_rank() == 0):
        if not path.exists():
            ids = np.frombuffer(args.text.read_bytes(), dtype=np.uint8).astype(np.uint16)
            tmp = path.with_suffix(".tmp")
            ids.tofile(tmp)
            os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return np.memmap(path, dtype=np.uint16, mode="r")


def batch(data: np.ndarray, step: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Batch ``step``: inputs and next-token targets, (batch, seq_len) int64 each."""
    g = np.random.default_rng([args.seed, step])
    starts = g.integers(0, len(data) - args.seq_len - 1, size=args.batch_size)
    rows = np.stack([data[s:s + args.seq_len + 1].astype(np.int64) for s in starts])
    return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])


def lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]  # (batch, seq, vocab)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             target.reshape(-1))


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over ``--warmup`` steps, then cosine decay to ``--min-lr`` at the end."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def main() -> None:
    args = parse()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", 1))))
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.n_embd, n_head=args.heads, vocab_size=256,
                     n_positions=args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    x0 = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
    ckpt = args.out / "ckpt"
    resuming = args.resume and (ckpt / "latest").exists()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # a resumed run replays the plan its checkpoint was saved with (the same cuts: the same
    # numbers as the uninterrupted run); any other plan would load as well
    plan = checkpoint_plan(ckpt) if resuming else args.plan
    choices = {} if plan is not None else {"num_stages": world, "schedule": args.schedule,
                                           "num_microbatches": args.microbatches}
    # under torchrun this initialises the process group (gloo on CPU, NCCL on GPU)
    pipe = autopart.compile(model, (x0,), loss_fn=lm_loss, plan=plan, **choices)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        pipe.plan.save(args.out / "plan.json")
    data = tokens(args)

    named = list(pipe.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": args.weight_decay},
         {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=False)
    start = 0
    if resuming:
        autopart.load(ckpt, pipe, optimizer=opt)
        start = int(autopart.checkpoint_extra(ckpt)["step"])

    n_params = sum(p.numel() for p in model.parameters())
    device = next(iter(pipe.parameters())).device
    peak = (args.peak_tflops * 1e12 if args.peak_tflops else next(
        (v for k, v in PEAK_BF16_FLOPS.items() if k in torch.cuda.get_device_name(device)), None)
        if device.type == "cuda" else None)
    log = open(args.out / "log.jsonl", "a", encoding="utf-8") if rank == 0 else None
    pending = None
    progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                        TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                        disable=rank != 0)
    with progress:
        task = progress.add_task("train", total=args.steps, completed=start, status="")
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            lr = learning_rate(step, args)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = batch(data, step, args)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16"):
                loss = pipe.train_step(x, target=y)
            norm = pipe.clip_grad_norm_(args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
                if pending is not None:
                    pending.wait()
                saved = pipe.save(ckpt, optimizer=opt, extra={"step": step + 1},
                                  async_save=args.async_save)
                pending = saved if args.async_save else None
            dt = time.perf_counter() - t0
            tok_s = args.batch_size * args.seq_len / dt
            entry = {"step": step + 1, "loss": float(loss), "grad_norm": float(norm), "lr": lr,
                     "step_s": dt, "tokens_per_s": tok_s}
            if peak:  # 6 N FLOPs per token for forward + backward (Kaplan et al. 2020)
                entry["mfu"] = 6 * n_params * tok_s / (peak * max(1, world))
            if log is not None:
                log.write(json.dumps(entry) + "\n")
                log.flush()
            progress.update(task, completed=step + 1, status=(
                f"loss {entry['loss']:.4f}  {tok_s:,.0f} tok/s  {dt * 1e3:.0f} ms/step"
                + (f"  MFU {entry['mfu']:.1%}" if "mfu" in entry else "")))
            if args.hold_after_step == step + 1:
                while True:  # until the test kills the launch
                    time.sleep(1.0)
    if pending is not None:
        pending.wait()
    if log is not None:
        log.close()
        write_text_atomic(args.out / "done", f"{args.steps}\n")
    if hasattr(pipe, "close"):
        pipe.close()  # the distributed pipeline's heartbeat thread
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
