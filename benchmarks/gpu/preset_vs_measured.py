"""A named GPU's model against the GPU itself: the analytical costs autopart plans with for a
device the user does not have (``profile_analytical`` with a preset) next to the same graph
measured node by node on that device (``profile_graph``), and both next to a plain eager
training step.

Workload: the GPT-2-like model of ``fidelity_gpu.py`` (12 x 768, vocab 32768, fp32), captured
at one microbatch of ``--microbatch`` rows x 256 tokens. Per op family (matmuls, attention,
everything else): forward and backward µs, modeled and measured, and their ratio; per graph:
saved activation bytes, modeled and measured. Then the step of ``--m`` microbatches: the sum
of node times (modeled and measured) x m against a timed eager forward + backward of those m
microbatches (median of ``--steps``), which says how far node-by-node sums are from a real
step on this device (launch gaps, caching allocator, overlap). Not run in CI.

    python benchmarks/gpu/preset_vs_measured.py [--preset h200] [--out benchmarks/gpu/out]
    python benchmarks/gpu/preset_vs_measured.py --device cpu --small   # checks the script
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity_gpu import device_name, synchronize, workload  # noqa: E402

FAMILIES = {"matmul": ("mm", "addmm", "bmm", "linear", "matmul", "baddbmm"),
            "attention": ("scaled_dot_product",)}


def family(op: str) -> str:
    """``matmul``, ``attention`` or ``other`` for an op string like ``aten.addmm.default``."""
    base = op.split(".")[1] if op.startswith("aten.") else op
    for name, keys in FAMILIES.items():
        if any(base == k or base.startswith(k) for k in keys):
            return name
    return "other"


def totals(costs) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    """Per family: forward and backward µs summed over the graph's nodes, and node count."""
    out: dict[str, dict[str, float]] = {}
    for n in costs.nodes:
        row = out.setdefault(family(n.op), {"nodes": 0, "fwd_us": 0.0, "bwd_us": 0.0})
        row["nodes"] += 1
        row["fwd_us"] += n.fwd_us
        row["bwd_us"] += n.bwd_input_us + n.bwd_weight_us
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default=None,
                        help="the named GPU to model (default: the one matching the device's "
                             "name, h200 on an H200, else h100-sxm)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--small", action="store_true", help="a 2-layer model, for checking")
    parser.add_argument("--m", type=int, default=8, help="microbatches per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).with_name("out")))
    opts = parser.parse_args()

    from autopart.core.capture import capture
    from autopart.core.cluster import device_preset
    from autopart.core.signature import microbatch_inputs
    from autopart.profiler import profile_graph
    from autopart.profiler.analytical import profile_analytical

    dev = opts.device
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    model, args, target, loss_fn = workload(dev, opts.small)
    mb_args, _ = microbatch_inputs(args, {}, opts.m)
    chunks = list(zip(args[0].chunk(opts.m), target.chunk(opts.m), strict=True))
    captured = capture(model, mb_args, {})
    flat = captured.flatten_inputs(mb_args, {})
    preset = opts.preset or ("h200" if torch.cuda.is_available()
                             and "H200" in torch.cuda.get_device_name(opts.device) else "h100-sxm")
    spec = device_preset(preset)
    modeled = profile_analytical(captured, None, spec)
    t0 = time.perf_counter()
    measured = profile_graph(captured, flat, device=dev)
    profile_s = time.perf_counter() - t0

    # a plain eager step of m microbatches (gradient accumulation), on the same device
    times = []
    for i in range(opts.steps + 2):
        model.zero_grad(set_to_none=True)
        synchronize(dev)
        t0 = time.perf_counter()
        for tokens, tgt in chunks:
            loss_fn(model(tokens), tgt).backward()
        synchronize(dev)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    eager_step = statistics.median(times)

    fam_modeled, fam_measured = totals(modeled), totals(measured)
    families = []
    for name in sorted(set(fam_modeled) | set(fam_measured)):
        a, b = fam_modeled.get(name, {}), fam_measured.get(name, {})
        row = {"family": name, "nodes": int(b.get("nodes", 0))}
        for col in ("fwd_us", "bwd_us"):
            row[f"modeled_{col}"] = a.get(col, 0.0)
            row[f"measured_{col}"] = b.get(col, 0.0)
            row[f"{col}_ratio"] = (a.get(col, 0.0) / b[col]) if b.get(col) else None
        families.append(row)
    node_sum = {src: sum(n.fwd_us + n.bwd_input_us + n.bwd_weight_us for n in c.nodes)
                for src, c in (("modeled", modeled), ("measured", measured))}
    saved = {src: sum(n.saved_bytes for n in c.nodes)
             for src, c in (("modeled", modeled), ("measured", measured))}
    report = {
        "device": device_name(dev), "preset": spec.name, "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "microbatch_rows": int(args[0].shape[0]) // opts.m, "m": opts.m,
        "families": families,
        "step_modeled_s": node_sum["modeled"] * opts.m / 1e6,
        "step_node_sum_measured_s": node_sum["measured"] * opts.m / 1e6,
        "step_eager_measured_s": eager_step,
        "saved_bytes_modeled": saved["modeled"], "saved_bytes_measured": saved["measured"],
        "profile_wall_s": profile_s,
    }
    (out / "preset_vs_measured.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['device']} against preset {spec.name}, microbatch "
          f"{report['microbatch_rows']} rows, m={opts.m}")
    for r in families:
        fr, br = r["fwd_us_ratio"], r["bwd_us_ratio"]
        print(f"  {r['family']:>9} ({r['nodes']:3d} nodes): fwd modeled {r['modeled_fwd_us']:9.0f} "
              f"measured {r['measured_fwd_us']:9.0f} µs ({fr or 0:.2f}x); bwd modeled "
              f"{r['modeled_bwd_us']:9.0f} measured {r['measured_bwd_us']:9.0f} µs "
              f"({br or 0:.2f}x)")
    print(f"  step of m microbatches: modeled {report['step_modeled_s'] * 1e3:.1f} ms, node sum "
          f"measured {report['step_node_sum_measured_s'] * 1e3:.1f} ms, eager step measured "
          f"{eager_step * 1e3:.1f} ms")
    print(f"  saved activations per microbatch: modeled {saved['modeled'] / 2**20:.1f} MiB, "
          f"measured {saved['measured'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
