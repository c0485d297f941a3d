"""GPT-OSS's attention with learned sinks on one GPU: transformers' eager code against the
one fused attention autopart's capture makes of it (``autopart/core/_sink_attention.py``),
measured and as the analytical profiler prices each.

One attention of GPT-OSS 120B's shape by default (1 sequence of 4096 tokens, 64 query / 8
key-value heads of 64, bf16, causal), forward and backward:

- ``eager``: the module as transformers writes it (scores, the sink column concatenated,
  the max subtracted, softmax, the column dropped, the product with the values);
- ``fused``: the same module captured (``autopart.core.capture.capture``), whose graph runs
  one ``scaled_dot_product_attention`` over the extra sink key.

Prints, per arm, the median of ``--repeats`` timed forward + backward calls (CUDA events),
the peak memory above the inputs, the analytical profile's forward + backward for the same
graph (``--preset``; the eager arm's graph captured with the rewrite turned off), and the
largest difference of the fused output and gradients from the eager ones.

    .venv/bin/python benchmarks/gpu/sink_attention.py [--device cuda] [--seq 4096]
    .venv/bin/python benchmarks/gpu/sink_attention.py --device cpu --seq 256 --heads 8 \\
        --kv-heads 2 --dtype float32     # a CPU smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class SinkAttention(nn.Module):
    """transformers' GPT-OSS eager attention (``eager_attention_forward``) after the q/k/v
    projections: ``[B, S, H*D]`` queries, ``[B, S, Hkv*D]`` keys and values in, ``[B, S,
    H*D]`` out, causal."""

    def __init__(self, heads: int, kv_heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, _ = q.shape
        q = q.view(b, s, self.heads, self.dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        group = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, group, s, self.dim).reshape(
            b, self.heads, s, self.dim)
        v = v[:, :, None].expand(b, self.kv_heads, group, s, self.dim).reshape(
            b, self.heads, s, self.dim)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.dim ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = torch.zeros(s, s, dtype=q.dtype, device=q.device).masked_fill(
            ~causal, torch.finfo(q.dtype).min)
        scores = scores + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1).to(scores.dtype)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        out = torch.matmul(probs.to(v.dtype), v)
        return out.transpose(1, 2).reshape(b, s, self.heads * self.dim)


def _time(fn: Any, inputs: list[torch.Tensor], device: torch.device, repeats: int,
          ) -> tuple[float, int]:
    """Median forward + backward ms and peak bytes above what was allocated before."""
    def once() -> None:
        out = fn(*inputs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().square().mean().backward()

    once()  # warm-up
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return statistics.median(times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--preset", default=None,
                    help="the analytical profile's GPU (default: h200 on an H200, else h100-sxm)")
    a = ap.parse_args()
    import autopart.core.capture as capture_module
    from autopart.core.capture import capture
    from autopart.core.cluster import PRESETS
    from autopart.profiler import profile_analytical

    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if a.preset is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        a.preset = "h200" if "H200" in name else "h100-sxm"
    torch.manual_seed(0)
    module = SinkAttention(a.heads, a.kv_heads, a.dim).to(device)
    shapes = [(1, a.seq, a.heads * a.dim), (1, a.seq, a.kv_heads * a.dim),
              (1, a.seq, a.kv_heads * a.dim)]
    inputs = [torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes]
    fused = capture(module, tuple(inputs))
    rewrite = capture_module.sink_attention_as_sdpa
    capture_module.sink_attention_as_sdpa = lambda graph: 0  # the eager graph, for its price
    try:
        eager_graph = capture(module, tuple(inputs))
    finally:
        capture_module.sink_attention_as_sdpa = rewrite
    spec = PRESETS[a.preset]
    priced = {}
    for name, graph in (("eager", eager_graph), ("fused", fused)):
        costs = profile_analytical(graph, None, spec)
        priced[name] = sum(n.fwd_us + n.bwd_input_us + n.bwd_weight_us for n in costs.nodes) / 1e3

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device)
                               if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "shape": vars(a)}
    grads: dict[str, list[torch.Tensor]] = {}
    outs: dict[str, torch.Tensor] = {}
    for name, fn in (("eager", module), ("fused", fused.graph_module.forward)):
        ms, peak = _time(fn, inputs, device, a.repeats)
        for t in [*inputs, module.sinks]:
            t.grad = None
        out = fn(*inputs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().square().mean().backward()
        outs[name] = out.detach().float().clone()
        grads[name] = [t.grad.float().clone() for t in [*inputs, module.sinks]]
        for t in [*inputs, module.sinks]:
            t.grad = None
        results[name] = {"measured_ms": ms, "peak_bytes": peak,
                         f"priced_ms_{a.preset}": priced[name]}
        print(f"{name}: {ms:.2f} ms forward + backward, peak {peak / 2**20:.0f} MiB; "
              f"priced {priced[name]:.2f} ms ({a.preset})", flush=True)
    diffs = [float((outs["fused"] - outs["eager"]).abs().max())] + [
        float((x - y).abs().max()) for x, y in zip(grads["fused"], grads["eager"], strict=True)]
    scale = [float(outs["eager"].abs().max())] + [float(g.abs().max()) for g in grads["eager"]]
    results["max_abs_diff"] = dict(zip(("out", "dq", "dk", "dv", "dsinks"), diffs, strict=True))
    results["max_abs"] = dict(zip(("out", "dq", "dk", "dv", "dsinks"), scale, strict=True))
    print("largest difference / largest value, output and gradients (q, k, v, sinks): "
          + ", ".join(f"{d:.2g} / {m:.2g}" for d, m in zip(diffs, scale, strict=True)))
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
