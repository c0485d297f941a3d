"""A published MoE training run held against autopart's prediction: GPT-OSS 120B on 64 H100s,
BF16, as NVIDIA's Megatron-Bridge performance summary lists it, planned as a user plans it
(``autopart profile`` then ``autopart plan``).

The published row (Megatron-Bridge, ``docs/performance-summary-archive.md``, "26.02 NeMo
Container", "Model: GPT OSS 120B", system DGX-H100): 64 GPUs, BF16, global batch 1280,
micro batch 1, sequence 4096, FSDP 0, TP 1, PP 4, CP 1, VP n/a, EP 8: 5993 tokens/s per GPU
(163 model TFLOP/s per GPU); "we force-balance the token distribution among experts and all
benchmarks are token-dropless", which is how autopart prices routing (balanced).

Profiles (meta capture, analytical bf16 H100 costs, one sequence of 4096 tokens):

- ``stand-in``: ``MixtralForCausalLM`` at GPT-OSS 120B's dimensions (36 layers, hidden 2880,
  expert FFN 2880, 128 experts, top-4, 64 query / 8 key-value heads of 64, vocabulary
  201088): the same GEMMs, attention through ``scaled_dot_product_attention`` (a fused
  kernel, as Megatron runs it). Not modelled: GPT-OSS's attention sinks and biases, and
  its sliding-window (128-token) layers, priced here as full causal attention (half the
  layers; attention is 4 % of the forward).
- ``hf-gpt-oss``: ``GptOssForCausalLM`` as transformers writes it (GptOssConfig's defaults
  are the 120B shape): eager attention with sinks, which the capture fuses into one
  ``scaled_dot_product_attention`` over an extra sink key (``autopart/core/
  _sink_attention.py``), experts with biases, the sliding-window layers' masks kept.

Plans: the published layout fixed (``--tp 1 --pp 4 --dp 16 --ep 8 --zero-stage 1``, 1F1B,
m = 1280 / 16 = 80 microbatches of one sequence), and the layout searched (``--3d
--experts 128``).

    .venv/bin/python benchmarks/expert_parallel/published.py [--out DIR]

Writes ``published.json`` and ``published.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI = [str(Path(sys.executable).parent / "autopart")]  # the console script beside python
GPUS, BATCH, SEQ = 64, 1280, 4096
#: Megatron-Bridge's published figures for the row above
PUBLISHED = {"tokens_per_s_per_gpu": 5993, "model_tflops_per_gpu": 163,
             "layout": "tp 1 x pp 4 x dp 16, ep 8, distributed optimizer, 1F1B (VP n/a), "
                       "m 80", "source": "NVIDIA-NeMo/Megatron-Bridge "
                       "docs/performance-summary-archive.md, 26.02 NeMo Container, "
                       "GPT OSS 120B, DGX-H100, BF16"}
STAND_IN = {"num_hidden_layers": 36, "hidden_size": 2880, "intermediate_size": 2880,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "num_local_experts": 128, "num_experts_per_tok": 4, "vocab_size": 201088,
            "max_position_embeddings": SEQ}
PROFILES = {"stand-in": ("hf:MixtralForCausalLM", STAND_IN), "hf-gpt-oss":
            ("hf:GptOssForCausalLM", {})}  # GptOssConfig's defaults are the 120B shape
FIXED = ["--tp", "1", "--pp", "4", "--dp", "16", "--ep", "8", "--zero-stage", "1",
         "--schedule", "1f1b", "--num-microbatches", "80"]
CASES = [("stand-in", "published layout", FIXED), ("stand-in", "searched", ["--3d"]),
         ("hf-gpt-oss", "published layout", FIXED), ("hf-gpt-oss", "searched", ["--3d"])]


def _run(args: list[str]) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        profiles = {}
        for name, (spec, config) in PROFILES.items():
            path = Path(tmp) / f"{name}.json"
            flags = [x for k, v in config.items() for x in ("--config", f"{k}={v}")]
            rc, out, _ = _run(["profile", spec, *flags, "--seq-len", str(SEQ), "--dtype",
                               "bfloat16", "--device", "h100", "--out", str(path)])
            if rc:
                raise SystemExit(out[-3000:])
            profiles[name] = path
        for profile, request, flags in CASES:
            plan_path = Path(tmp) / f"plan_{profile}_{request}.json".replace(" ", "_")
            rc, out, wall = _run(["plan", str(profiles[profile]), "--cluster",
                                  f"h100-sxm:{GPUS}", "--batch-size", str(BATCH),
                                  "--experts", "128", "--heads", "64", *flags,
                                  "--out", str(plan_path)])
            row = {"profile": profile, "request": request, "wall_s": wall}
            if rc == 0:
                plan = json.loads(plan_path.read_text())
                step_s = plan["predicted_step_time_us"] / 1e6
                tokens = BATCH * SEQ / GPUS / step_s
                row.update({"tp": plan["tp"], "pp": len(plan["ranks"]), "dp": plan["dp"],
                            "ep": plan["ep"], "zero_stage": plan["zero_stage"],
                            "schedule": plan["schedule_kind"],
                            "v": plan["stages_per_rank"], "m": plan["num_microbatches"],
                            "recompute": sum(s["recompute"] for s in plan["stages"]),
                            "step_s": step_s, "tokens_per_s_per_gpu": tokens,
                            "vs_published": tokens / PUBLISHED["tokens_per_s_per_gpu"] - 1,
                            "peak_gib": max(r["peak_memory_bytes"] for r in plan["ranks"])
                            / 2**30})
            else:
                row["refused"] = " ".join(out.split())[-400:]
            rows.append(row)
            print(row, flush=True)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "published": PUBLISHED,
            "stand_in": STAND_IN, "load_average": os.getloadavg()[0]}
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "published.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1)
                                            + "\n")
    lines = [f"# GPT-OSS 120B on 64 H100s against Megatron-Bridge's published run "
             f"({meta['date']})", "",
             f"{meta['machine']}; Python {meta['python']}; analytical bf16 h100 profiles. "
             f"Published: {PUBLISHED['tokens_per_s_per_gpu']} tokens/s per GPU, "
             f"{PUBLISHED['layout']} ({PUBLISHED['source']}).", "",
             "| profile | layout | plan (tp x pp x dp, ep, ZeRO, schedule, m) | stages "
             "recomputed | predicted step | tokens/s per GPU | vs published | largest peak | "
             "solve |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['profile']} | {r['request']} |"
        if "refused" in r:
            lines.append(f"{head} refused: {r['refused'][-200:]} | | | | | | {r['wall_s']:.1f} s |")
            continue
        lines.append(f"{head} {r['tp']} x {r['pp']} x {r['dp']}, ep {r['ep']}, "
                     f"ZeRO-{r['zero_stage']}, {r['schedule']} v {r['v']}, m {r['m']} | "
                     f"{r['recompute']} | {r['step_s']:.2f} s | "
                     f"{r['tokens_per_s_per_gpu']:.0f} | {r['vs_published']:+.1%} | "
                     f"{r['peak_gib']:.1f} GiB | {r['wall_s']:.1f} s |")
    (out_dir / "published.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
