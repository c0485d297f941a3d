"""The main job on the embedded default: GPT-2 (124M) compiled into 4 stages, trained 3 steps."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

__all__ = ["run_demo", "gpt2_loss"]


def gpt2_loss(output: object, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over tokens.

    Args:
        output: a causal-LM output with ``logits`` of shape ``(batch, seq, vocab)``.
        target: token ids ``(batch, seq)``; position t predicts ``target[:, t + 1]``.
    """
    logits = output.logits  # type: ignore[attr-defined]
    vocab = logits.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab),  # (batch * (seq - 1), vocab)
        target[:, 1:].reshape(-1))  # (batch * (seq - 1),)


def run_demo(out_dir: str | Path = "autopart-out", *, n_layer: int = 12, n_embd: int = 768,
             n_head: int = 12, vocab_size: int = 50257, batch_size: int = 8, seq_len: int = 128,
             num_stages: int = 4, steps: int = 3,
             console: Console | None = None) -> list[tuple[float, float]]:
    """Compile a randomly initialised GPT-2 into ``num_stages`` CPU stages and train it.

    Builds ``GPT2LMHeadModel(GPT2Config(n_layer, n_embd, n_head, vocab_size))`` with seed 0
    and dropout off (nothing is downloaded), compiles it with a next-token loss, prints the
    plan and phase timings, then runs ``steps`` AdamW steps on the pipeline and on an
    unpartitioned copy with the same batch, printing both losses per step. Writes the plan
    and each stage's source under ``out_dir``.

    Returns:
        Per step, (pipeline loss, unpartitioned loss).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    import autopart
    from autopart.apps.report import print_plan
    from autopart.core.progress import phase

    console = console or Console(width=None if Console().is_terminal else 120)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                        n_positions=max(1024, seq_len), resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len))  # (batch, seq)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"GPT-2: {n_layer} layers, n_embd {n_embd}, {n_params / 1e6:.1f} M parameters; "
                  f"batch {batch_size} x {seq_len}; {num_stages} stages on cpu; "
                  f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    pipe = autopart.compile(model, (tokens,), loss_fn=gpt2_loss, devices=["cpu"] * num_stages)
    compile_s = time.perf_counter() - t0
    print_plan(pipe.plan, console)
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in pipe.timings_s.items())
    console.print(f"compile took {compile_s:.1f} s ({phases})")
    written = pipe.save_plan(Path(out_dir) / "gpt2.plan.json")
    console.print(f"wrote {written[0]} and {len(written) - 1} stage sources in {Path(out_dir)}/")

    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    table = Table(title=f"{steps} AdamW steps: pipeline vs unpartitioned model")
    for col in ("step", "pipeline loss", "unpartitioned loss", "|diff|", "pipeline s", "plain s"):
        table.add_column(col, justify="right")
    losses = []
    with phase("train") as shown:  # on stderr, with the steps done
        for step in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = pipe.train_step(tokens, target=tokens)
            opt.step()
            t_pipe = time.perf_counter() - t0
            t0 = time.perf_counter()
            ref_opt.zero_grad()
            ref_loss = gpt2_loss(reference(tokens), tokens)
            ref_loss.backward()
            ref_opt.step()
            t_ref = time.perf_counter() - t0
            losses.append((loss.item(), ref_loss.item()))
            table.add_row(str(step), f"{loss.item():.6f}", f"{ref_loss.item():.6f}",
                          f"{abs(loss.item() - ref_loss.item()):.2e}", f"{t_pipe:.2f}", f"{t_ref:.2f}")
            shown.count(step + 1, steps)
    console.print(table)
    console.print(f"The plan's predicted step ({pipe.plan.predicted_step_time_us / 1e6:.2f} s) is "
                  f"for {num_stages} devices working in parallel. Here the {num_stages} stages "
                  "share one CPU process and take turns, so a pipeline step takes as long as "
                  "the plain one or longer (its microbatches make smaller matmuls); run the "
                  "plan on several ranks (README, torchrun) for the parallel speed-up.")
    return losses
