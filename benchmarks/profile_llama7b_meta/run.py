"""Benchmark: capture + analytical H100 profile of a Llama-2-7B-shaped model on the meta device."""

from __future__ import annotations

import json
import platform
import resource
import time

import torch
import transformers

from autopart.core.capture import capture
from autopart.core.cluster import PRESETS
from autopart.profiler import profile_analytical


def main() -> None:
    """Build on meta (no weights), capture, profile for h100-sxm; print wall time and peak RSS."""
    t0 = time.perf_counter()
    cfg = transformers.LlamaConfig(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                   max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    x = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    captured = capture(model, (x,))
    t1 = time.perf_counter()
    costs = profile_analytical(captured, None, PRESETS["h100-sxm"], dtype=torch.bfloat16)
    t2 = time.perf_counter()
    params = sum(costs.param_numel.values())
    tokens = 4096
    print(json.dumps({
        "model": "LlamaForCausalLM 7B shape (h4096, 32 layers, ffn 11008, 32 heads, vocab 32000), "
                 "batch 1 x seq 4096, bf16, meta device",
        "capture_s": t1 - t0, "profile_s": t2 - t1, "total_s": t2 - t0,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "nodes": len(costs.nodes), "params": params,
        "fwd_tflop": sum(n.flops for n in costs.nodes) / 1e12,
        "closed_form_6PT_over_3_tflop": 2 * params * tokens / 1e12,
        "predicted_fwd_ms": costs.total_fwd_us() / 1e3, "predicted_bwd_ms": costs.total_bwd_us() / 1e3,
        "saved_gib": sum(n.saved_bytes for n in costs.nodes) / 2**30,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__, "transformers": transformers.__version__,
    }, indent=2))


if __name__ == "__main__":
    main()
