"""A lazy pipeline's new sequence lengths: the per-rank peak it predicts at each new shape
(the plan's peak plus the analytical model's difference between the two graphs,
:func:`autopart.steps.shape_memory.peaks_at_shape`) against the peak measured there, and
against the peak a plan profiled at that shape predicts.

GPT-2 and Llama shapes (4 layers, hidden 256, 4 heads, vocabulary 2048), one CPU rank (so the
process's peak is the rank's), batch 4 in m = 2 microbatches, AdamW. Per model, a lazy
pipeline plans at the first length (128 tokens) and is called at 256, 512 and 1024; its
``peaks_bytes`` are the prediction. The measured peak is one step under
:func:`autopart.core.memory.measure_peak_bytes` (parameters, gradients and AdamW's state
held), after one unmeasured step. The reference: ``autopart.compile`` on a batch of that
length with the same m, schedule and stages, its profile measured there. Every arm runs in
a process of its own (torch's CPU memory profiler crashed when one process measured several
arms, see ``benchmarks/context_parallel``).

    .venv/bin/python benchmarks/lazy_shapes/run.py [--lengths 256 512 1024] [--out DIR]

Writes ``results.json`` and ``results.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PLANNED = 128
MIB = 2**20


def _model(name: str) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048,
                                          n_positions=2048, use_cache=False))
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=256,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=512, vocab_size=2048,
                                        max_position_embeddings=4096, use_cache=False))


def _loss(out: Any, target: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _measured(pipe: Any, x: Any, optimizer: Any) -> int:
    pipe.train_step(x, target=x)
    optimizer.step()  # AdamW's state exists from here on
    optimizer.zero_grad()
    pipe.train_step(x, target=x, measure_memory=True, optimizer=optimizer)
    return int(pipe.last_peak_memory_bytes.by_rank[0])


def one(model_name: str, length: int, arm: str) -> dict[str, Any]:
    """One arm in this process: ``lazy`` (planned at PLANNED, run at ``length``) or
    ``planned`` (compiled at ``length``)."""
    import torch

    import autopart

    model = _model(model_name)
    x = torch.randint(0, 2048, (4, length))
    choices = dict(devices=["cpu"], num_microbatches=2, schedule_kind="1f1b", recompute=False,
                   time_limit_s=5)
    if arm == "lazy":
        pipe = autopart.compile(model, loss_fn=_loss, **choices)
        first = torch.randint(0, 2048, (4, PLANNED))
        pipe.train_step(first, target=first)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        measured = _measured(pipe, x, optimizer)
        peaks = pipe.peaks_bytes[next(k for k in pipe.pipelines if k in pipe.peaks_bytes)]
        return {"predicted": peaks.bytes[0], "planned": peaks.planned_bytes[0],
                "measured": measured}
    pipe = autopart.compile(model, (x,), loss_fn=_loss, example_target=x, **choices)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    return {"predicted": pipe.plan.ranks[0].peak_memory_bytes,
            "measured": _measured(pipe, x, optimizer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "LENGTH", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]), args.one[2])))
        return
    import torch
    import transformers

    rows = []
    for model in args.models:
        for length in args.lengths:
            row: dict[str, Any] = {"model": model, "length": length}
            for arm in ("lazy", "planned"):
                done = subprocess.run([sys.executable, __file__, "--one", model, str(length), arm],
                                      capture_output=True, text=True, cwd=ROOT, check=False)
                line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")),
                            None)
                if line is None:
                    raise SystemExit(f"{model} {length} {arm} failed:\n{done.stderr[-3000:]}")
                row[arm] = json.loads(line[len("RESULT "):])
            row["lazy_error"] = row["lazy"]["predicted"] / row["lazy"]["measured"] - 1
            row["planned_error"] = row["planned"]["predicted"] / row["planned"]["measured"] - 1
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "planned_length": PLANNED}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# A lazy pipeline's peak at new sequence lengths ({meta['date']})", "",
             f"{meta['machine']}; Python {meta['python']}, torch {meta['torch']}, transformers "
             f"{meta['transformers']}. One CPU rank, batch 4, m 2, 1F1B, AdamW; planned at "
             f"{PLANNED} tokens. MiB.", "",
             "| model | tokens | planned peak (at 128) | lazy prediction | measured | error | "
             "plan profiled at that length: prediction | measured | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lz, pl = r["lazy"], r["planned"]
        lines.append(f"| {r['model']} | {r['length']} | {lz['planned'] / MIB:.1f} | "
                     f"{lz['predicted'] / MIB:.1f} | {lz['measured'] / MIB:.1f} | "
                     f"{r['lazy_error']:+.1%} | {pl['predicted'] / MIB:.1f} | "
                     f"{pl['measured'] / MIB:.1f} | {r['planned_error']:+.1%} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
