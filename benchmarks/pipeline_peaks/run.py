"""Pipeline peaks on gloo CPU ranks: each pipeline rank's predicted peak against the measured
one, per schedule, microbatch count and recompute policy.

A Llama-shaped model (4 layers, hidden 256, 4 / 2 heads, FFN 512, vocabulary 2048, random
weights), global batch 4 x 1024 tokens, next-token loss, AdamW, on 2 gloo ranks (pp 2, the
distributed runtime). Each arm's plan is the solver's for its schedule, m and recompute
setting (``autopart.planning.plan_model(..., backend="distributed")``, its cut timing-driven);
its predicted peaks are the plan's own (``Plan.ranks[r].peak_memory_bytes``). Measured: one
``train_step(measure_memory=True)`` per rank after one AdamW step, each arm in processes of
its own (:func:`autopart.apps.bench.run_arms` with the arm untimed). Memory does not follow
the machine's load; the plans' cuts can.

    .venv/bin/python benchmarks/pipeline_peaks/run.py [--arms gpipe:2 1f1b:4:full ...] [--out DIR]

An arm is ``kind:m`` (no recompute) or ``kind:m:policy`` (every stage recomputes under
``policy``: ``full``, ``selective`` or ``auto``). Writes ``results.json`` and ``results.md``
into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORKLOAD = "hf:LlamaForCausalLM"
CONFIG = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
          "max_position_embeddings": 1024, "batch": 4, "seq": 1024}
ARMS = ("gpipe:1", "gpipe:2", "gpipe:4", "1f1b:2", "1f1b:4", "zero_bubble:2", "zero_bubble:4",
        "1f1b:4:full", "1f1b:4:selective", "1f1b:4:auto")
MIB = 2 ** 20


def _plan(arm: str, model: Any, args: tuple[Any, ...], target: Any, loss_fn: Any) -> Any:
    """The solver's plan for ``arm`` (``kind:m[:policy]``) on 2 CPU ranks."""
    from autopart.planning import plan_model

    kind, m, *policy = arm.split(":")
    if not m.isdigit() or len(policy) > 1:
        raise SystemExit(f"arm {arm!r}: expected kind:m or kind:m:policy, e.g. 1f1b:4 or "
                         "1f1b:4:selective")
    extra: dict[str, Any] = {"recompute_policy": policy[0]} if policy else {}
    plan, _ = plan_model(model, args, devices=["cpu", "cpu"], num_microbatches=int(m),
                         schedule_kind=kind, recompute=bool(policy), loss_fn=loss_fn,
                         example_target=target, backend="distributed", time_limit_s=5,
                         **extra)
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS))
    parser.add_argument("--out", default=str(Path(__file__).parent))
    opts = parser.parse_args()
    from autopart.apps.bench import load_workload, run_arms

    torch.set_num_threads(1)
    model, args, target, loss_fn = load_workload(WORKLOAD, dict(CONFIG))
    rows = []
    for arm in opts.arms:
        plan = _plan(arm, model, args, target, loss_fn)
        measured = run_arms(WORKLOAD, {arm: plan}, ranks=2, steps=0, warmup=1,
                            config=dict(CONFIG), single=False, trace=False,
                            measure_memory=True, untimed=[arm])[arm].peak_bytes
        predicted = [r.peak_memory_bytes for r in plan.ranks]
        rows.append({"arm": arm, "cuts": [c.position for c in plan.cuts],
                     "recompute": [st.recompute for st in plan.stages],
                     "recompute_policy": plan.recompute_policy,
                     "predicted_bytes": predicted, "measured_bytes": list(measured)})
        print(arm, " ".join(f"{p / MIB:.1f}/{q / MIB:.1f}" for p, q in zip(predicted, measured,
                                                                       strict=True)), flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env = {"machine": platform.machine(), "cpus": os.cpu_count(), "python":
           platform.python_version(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "utc": stamp}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"env": env, "config": CONFIG, "rows": rows},
                                                 indent=1) + "\n", encoding="utf-8")
    lines = [f"# Pipeline peaks on 2 gloo CPU ranks ({stamp})", "",
             f"{env['machine']}, {env['cpus']} CPUs; Python {env['python']}, torch "
             f"{env['torch']}, transformers {env['transformers']}. MiB, predicted / measured.",
             "", "| arm | cut | recompute | rank 0 | rank 1 |", "|---|---|---|---|---|"]
    for r in rows:
        flags = ", ".join(r["recompute_policy"] if f else "no" for f in r["recompute"])
        cells = [f"{p / MIB:.1f} / {q / MIB:.1f} ({p / q:.2f}x)"
                 for p, q in zip(r["predicted_bytes"], r["measured_bytes"], strict=True)]
        lines.append(f"| {r['arm']} | {r['cuts']} | {flags} | {' | '.join(cells)} |")
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
