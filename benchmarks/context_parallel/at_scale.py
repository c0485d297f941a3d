"""Context parallelism at scale: a Llama-3-8B shape on 64 H100s at 131072 and 8192 tokens per
sequence, planned as a user plans it (``autopart profile`` then ``autopart plan --seq-len``).

Llama-3-8B's shape (32 layers, hidden 4096, FFN 14336, 32 / 8 heads, vocabulary 128256,
bf16), profiled analytically for an H100 with one sequence, then planned on
``h100-sxm:64`` with cp and its attention (all-gathered keys and values, or Ulysses where
tp x cp divides the 32 heads: ``--heads 32``) searched (``--seq-len``), with the all-gather
form only (``--cp-attention all_gather``), and with ``--cp 1`` for comparison. Global
batches: 16 sequences at 131072 tokens, 512 at 8192 (NVIDIA NeMo's Llama 3 8B pre-training
recipe: ``seq_length=8192, global_batch_size=512, micro_batch_size=1`` with
``context_parallelism=2``, ``nemo/collections/llm/recipes/llama3_8b.py``).

    .venv/bin/python benchmarks/context_parallel/at_scale.py [--out DIR]

Writes ``at_scale.json`` and ``at_scale.md`` into ``--out`` (default: this folder).
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
CONFIG = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
          "max_position_embeddings": 131072, "use_cache": "false"}
#: (tokens per sequence, global batch, cp asked (None: searched), cp attention asked (None:
#: searched, Ulysses where tp x cp divides the 32 heads))
CASES = [(131072, 16, None, None), (131072, 16, None, "all_gather"), (131072, 16, 1, None),
         (8192, 512, None, None), (8192, 512, 1, None)]


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
        for seq in sorted({c[0] for c in CASES}):
            path = Path(tmp) / f"llama8b_{seq}.json"
            config = [x for k, v in CONFIG.items() for x in ("--config", f"{k}={v}")]
            rc, out, _ = _run(["profile", "hf:LlamaForCausalLM", *config, "--seq-len", str(seq),
                               "--dtype", "bfloat16", "--device", "h100", "--out", str(path)])
            if rc:
                raise SystemExit(out[-3000:])
            profiles[seq] = path
        for seq, batch, cp, attention in CASES:
            plan_path = Path(tmp) / f"plan_{seq}_{cp}_{attention}.json"
            args = ["plan", str(profiles[seq]), "--cluster", "h100-sxm:64", "--batch-size",
                    str(batch), "--heads", str(CONFIG["num_attention_heads"]),
                    "--out", str(plan_path)]
            args += ["--seq-len", str(seq)] if cp is None else ["--cp", str(cp)]
            args += [] if attention is None else ["--cp-attention", attention]
            rc, out, wall = _run(args)
            row = {"seq": seq, "batch": batch, "cp_asked": cp or "searched",
                   "attention_asked": attention or "searched", "wall_s": wall}
            if rc == 0:
                plan = json.loads(plan_path.read_text())
                row.update({"tp": plan["tp"], "pp": len(plan["ranks"]), "dp": plan["dp"],
                            "cp": plan["cp"], "zero_stage": plan["zero_stage"],
                            "cp_attention": plan["cp_attention"],
                            "m": plan["num_microbatches"],
                            "recompute": sum(s["recompute"] for s in plan["stages"]),
                            "step_s": plan["predicted_step_time_us"] / 1e6,
                            "peak_gib": max(r["peak_memory_bytes"] for r in plan["ranks"])
                            / 2**30})
            else:
                row["refused"] = out.strip().splitlines()[-1][:300]
            rows.append(row)
            print(row, flush=True)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "config": CONFIG,
            "load_average": os.getloadavg()[0]}
    out_dir = Path(opts.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "at_scale.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1)
                                           + "\n")
    lines = [f"# Llama-3-8B shape on 64 H100s, cp searched ({meta['date']})", "",
             f"{meta['machine']}; Python {meta['python']}; analytical h100 profile, bf16.", "",
             "| tokens / sequence | global batch | cp asked | cp attention asked | layout (tp x "
             "pp x dp x cp, ZeRO, cp attention) | m | stages recomputed | predicted step | "
             "largest peak | solve |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        asked = f"| {r['seq']} | {r['batch']} | {r['cp_asked']} | {r['attention_asked']} |"
        if "refused" in r:
            lines.append(f"{asked} refused: {r['refused']} | | | | | {r['wall_s']:.1f} s |")
            continue
        attention = f", {r['cp_attention']}" if r["cp"] > 1 else ""
        lines.append(f"{asked} {r['tp']} x {r['pp']} x {r['dp']} x {r['cp']}, "
                     f"ZeRO-{r['zero_stage']}{attention} | {r['m']} | "
                     f"{r['recompute']} | {r['step_s']:.2f} s | {r['peak_gib']:.1f} GiB | "
                     f"{r['wall_s']:.1f} s |")
    (out_dir / "at_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
