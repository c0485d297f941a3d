"""Local executor overhead: a 4-stage GPT-2 small pipeline against the plain model.

Both run the same microbatching on the same device: the plain model runs its m
microbatches one after another, accumulating gradients (loss / m each), and the pipeline
runs them under the plan's schedule with every stage on that one device. The difference is
what the executor costs (issue 5 target on one GPU: at most 5% slower). Steps alternate
between the two so that drift in the machine's load hits both alike; the losses are
compared each step.

    .venv/bin/python benchmarks/executor_overhead/run.py [--device cuda:0] [--steps 5]
        [--schedules 1f1b,zero_bubble] [--batch 8] [--seq 128] [--microbatches 4]

Default device: ``cuda:0`` when one is visible, else ``cpu``. Writes ``results.json`` and
``results.md`` (or ``--out-dir``) with the device's name and library versions.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def run(device: torch.device, schedules: list[str], steps: int, batch: int, seq: int,
        m: int, stages: int) -> dict[str, Any]:
    """Time ``steps`` training steps of each schedule's pipeline against the plain model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import autopart
    from autopart.apps.demo import gpt2_loss

    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    base = GPT2LMHeadModel(config).to(device).train()
    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)  # (batch, seq)
    chunks = tokens.chunk(m)
    plain = copy.deepcopy(base)

    def plain_step() -> float:
        plain.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            loss = gpt2_loss(plain(chunk), chunk) / m
            loss.backward()
            total += loss.detach()
        return float(total)

    results: dict[str, Any] = {}
    for kind in schedules:
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        pipe = autopart.compile(model, (tokens,), loss_fn=gpt2_loss, devices=[str(device)] * stages,
                                num_microbatches=m, schedule=kind)
        compile_s = time.perf_counter() - t0

        def pipe_step(pipe: Any = pipe) -> float:
            pipe.zero_grad(set_to_none=True)
            return float(pipe.train_step(tokens, target=tokens))

        times: dict[str, list[float]] = {"pipeline": [], "plain": []}
        max_diff = 0.0
        for i in range(steps + 2):  # two warm-up steps
            losses = {}
            for name, fn in (("pipeline", pipe_step), ("plain", plain_step)):
                _sync(device)
                t = time.perf_counter()
                losses[name] = fn()
                _sync(device)
                if i >= 2:
                    times[name].append(time.perf_counter() - t)
            max_diff = max(max_diff, abs(losses["pipeline"] - losses["plain"]))
        tp, tb = statistics.median(times["pipeline"]), statistics.median(times["plain"])
        results[kind] = {
            "pipeline_step_s": round(tp, 4), "plain_step_s": round(tb, 4),
            "overhead": round(tp / tb - 1, 4),
            # step i of each ran back to back: the median of their ratios cancels slow drift
            "overhead_paired": round(statistics.median(
                a / b for a, b in zip(times["pipeline"], times["plain"], strict=True)) - 1, 4),
            "max_abs_loss_diff": max_diff,
            "pipeline_steps_s": [round(t, 4) for t in times["pipeline"]],
            "plain_steps_s": [round(t, 4) for t in times["plain"]],
            "compile_s": round(compile_s, 1),
            "cuts": [c.position for c in pipe.plan.cuts],
            "predicted_step_ms": round(pipe.plan.predicted_step_time_us / 1e3, 2),
        }
        print(f"{kind}: pipeline {tp:.3f} s, plain {tb:.3f} s, overhead {tp / tb - 1:+.1%}, "
              f"max |loss diff| {max_diff:.2e}", file=sys.stderr)
    return results


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table."""
    lines = [f"Device: {report['device_name']}; Python {report['python']}, torch "
             f"{report['torch']}; GPT-2 small, batch {report['batch']} x {report['seq']}, "
             f"m = {report['microbatches']}, {report['stages']} stages on {report['device']}; "
             f"medians of {report['steps']} steps after 2 warm-up steps.", "",
             "| schedule | pipeline s | plain s (same microbatching) | overhead (medians) | "
             "overhead (median of paired steps) | max loss diff |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, r in report["schedules"].items():
        lines.append(f"| {kind} | {r['pipeline_step_s']:.3f} | {r['plain_step_s']:.3f} | "
                     f"{r['overhead']:+.1%} | {r['overhead_paired']:+.1%} | "
                     f"{r['max_abs_loss_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--schedules", default="gpipe,1f1b,zero_bubble")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is visible; use --device cpu")
    schedules = [s for s in args.schedules.split(",") if s]
    report = {
        "device": str(device), "device_name": _device_name(device),
        "python": platform.python_version(), "torch": torch.__version__,
        "batch": args.batch, "seq": args.seq, "microbatches": args.microbatches,
        "stages": args.stages, "steps": args.steps,
        "schedules": run(device, schedules, args.steps, args.batch, args.seq,
                         args.microbatches, args.stages),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out_dir / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
