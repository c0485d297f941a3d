"""Benchmark: measured per-node forward sum vs whole-model forward, and FLOPs vs closed form (GPT-2)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from autopart.core.capture import capture
from autopart.core.cluster import PRESETS
from autopart.profiler import flop_formulas, profile_analytical, profile_graph_report


def main() -> None:
    """Profile GPT-2 (random weights) and print the accuracy figures as JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
    captured = capture(model, (x,))
    gm = captured.graph_module
    with torch.no_grad():
        for _ in range(2):
            gm(x)
        whole = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            gm(x)
            whole.append((time.perf_counter() - t0) * 1e6)
    costs, report = profile_graph_report(captured, [x], training=False, warmup=2, repeats=a.repeats,
                                         reuse_repeated_blocks=False)
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as fc, torch.no_grad():
        model(x)
    ana = profile_analytical(captured, None, PRESETS["h100-sxm"], training=False)
    d, v, t, n = a.embd, cfg.vocab_size, a.batch * a.seq, a.layers
    closed = 2 * (n * 12 * d * d + d * v) * t + n * 4 * a.batch * a.seq * a.seq * d
    sum_fwd = costs.total_fwd_us()
    out = {
        "model": f"GPT-2 n_layer={n} n_embd={d} batch={a.batch} seq={a.seq}",
        "whole_fwd_us_median": statistics.median(whole), "sum_node_fwd_us": sum_fwd,
        "sum_over_whole": sum_fwd / statistics.median(whole),
        "max_node_spread": max(report.fwd_spread.values()),
        "analytical_flops": sum(n_.flops for n_ in ana.nodes), "flop_counter_total": fc.get_total_flops(),
        "closed_form_flops": closed,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    out["flops_vs_counter"] = out["analytical_flops"] / out["flop_counter_total"]
    out["flops_vs_closed_form"] = out["analytical_flops"] / closed
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
