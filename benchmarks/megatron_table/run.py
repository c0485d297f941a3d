"""Benchmark: autopart's 3D predictions against Megatron-LM's weak-scaling table (SC'21, Table 1).

For each of the ten GPT rows (Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", SC'21, arXiv:2104.04473, Table 1) the model is built as a
``GPT2LMHeadModel`` on the meta device (sequence 2048, vocabulary 51,200, bf16), captured at
batch 1 and profiled analytically for an A100 80GB (``profile_analytical``). Then:

(a) Megatron's own configuration: tp, pp and dp fixed as published, microbatch 1, the
    interleaved schedule (1F1B when pp = 1), full recompute, no ZeRO; autopart's predicted
    TFLOP/s per GPU by Megatron's FLOP count ``F = 96 B s l h^2 (1 + s/6h + V/16lh)`` is
    compared with the published figure.
(b) autopart's own plan: tp, pp, dp, ZeRO stage, schedule, v, recompute and its policy
    (whole stage or selective, ``recompute_policy="auto"``) chosen by ``solve_layout``
    (microbatch 1, 2 or 4 rows), solved twice (same plan JSON?), timed; where it recomputes,
    the same search with whole-stage recompute only, for the gain.

(c) ``--korthikanti``: the predicted gain of sequence parallelism with selective recompute
    over full recompute, held against Korthikanti et al., "Reducing Activation Recomputation
    in Large Transformer Models" (MLSys 2023, arXiv:2205.05198), whose abstract reports the
    530B GPT-3-style model on 2240 A100s at 54.2 % model FLOPs utilization that way against
    42.1 % with full recompute. Writes ``korthikanti.json`` and ``korthikanti.md``.

Costs are cached under ``--cache`` (CostGraph JSON per shape) so a rerun skips the captures.
Writes ``results.json`` and ``results.md`` (and ``figure.png`` with matplotlib).

    .venv/bin/python benchmarks/megatron_table/run.py [--rows 0,1,2] [--skip-own]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SEQ, VOCAB = 2048, 51200
A100_PEAK = 312e12  # dense BF16, NVIDIA A100 datasheet
OPTIMIZER_STATE = 6.0  # fp32 master weights + Adam moments = 12 bytes per 2-byte parameter


@dataclass(frozen=True)
class Row:
    """One row of Table 1 (published values)."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved teraFLOP/s per GPU
    peak_pct: int  # percentage of theoretical peak


#: Narayanan et al., SC'21, Table 1 (weak scaling, A100 80GB in DGX A100 hosts; interleaved
#: schedule; full activation recomputation).
ROWS = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)


#: Korthikanti et al. (MLSys 2023, arXiv:2205.05198), abstract: "when training a 530B
#: parameter GPT-3 style model on 2240 NVIDIA A100 GPUs, we achieve a Model Flops Utilization
#: of 54.2%, which is 29% faster than the 42.1% we achieve using recomputation". The model is
#: Table 1's 529.6B shape (105 layers, hidden 20480, 128 heads); tp 8 and pp 35 as in SC'21's
#: row, so dp = 2240 / 280 = 8. The abstract states neither the global batch nor the schedule:
#: the run takes SC'21's convention of one sequence per GPU (batch 2240, microbatches of one
#: row) and the interleaved schedule, and the ratio of the two plans is what is compared.
SCHEDULES = ("1f1b", "interleaved_1f1b")
KORTHIKANTI = {"row": 8, "gpus": 2240, "batch": 2240, "mfu_full_recompute": 0.421,
               "mfu_selective_sequence_parallel": 0.542}


def megatron_flops(row: Row) -> float:
    """FLOPs of one step by Megatron's count (SC'21, section 5.1: recompute included)."""
    b, s, n, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


def profile_row(row: Row, cache: Path) -> Any:
    """The row's analytical CostGraph on an A100 80GB (cached)."""
    from autopart.core.costgraph import CostGraph

    path = cache / f"gpt_l{row.layers}_h{row.hidden}_a{row.heads}.json"
    if path.exists():
        return CostGraph.load(path)
    import torch
    import transformers

    from autopart.core.capture import capture
    from autopart.core.cluster import PRESETS
    from autopart.profiler import profile_analytical

    config = transformers.GPT2Config(n_layer=row.layers, n_embd=row.hidden, n_head=row.heads,
                                     n_positions=SEQ, vocab_size=VOCAB, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    # the masks kept: Megatron-LM's 2021 attention (a masked softmax over the whole S x S
    # scores) computed every block, where capture would give attention is_causal
    captured = capture(model.train(), (x,), attention_flags=False)
    costs = profile_analytical(captured, None, PRESETS["a100-80gb"], dtype=torch.bfloat16)
    cache.mkdir(parents=True, exist_ok=True)
    costs.save(path)
    return costs


def model_flops_no_recompute(row: Row, batch: int) -> float:
    """Model FLOPs of one step, the numerator of model FLOPs utilization: SC'21's count
    without the recomputed forward, ``72 B s l h^2 (1 + s/6h + V/12lh)`` (the layers' three
    passes instead of four; the logits' ``6 B s h V`` unchanged)."""
    s, n, h, v = SEQ, row.layers, row.hidden, VOCAB
    return 72 * batch * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))


def _plan_json(plan: Any) -> str:
    d = plan.to_dict()
    d["solver"]["wall_s"] = 0.0
    return json.dumps(d, sort_keys=True)


def _summary(plan: Any, row: Row, wall: float) -> dict[str, Any]:
    step_s = plan.predicted_step_time_us / 1e6
    return {
        "tp": plan.tp, "pp": len(plan.ranks), "dp": plan.dp, "zero_stage": plan.zero_stage,
        "num_microbatches": plan.num_microbatches,
        "microbatch_rows": plan.batch_size // (plan.dp * plan.num_microbatches),
        "schedule_kind": plan.schedule_kind, "stages_per_rank": plan.stages_per_rank,
        "recompute_stages": sum(st.recompute for st in plan.stages),
        "recompute_policy": plan.recompute_policy,
        "num_stages": plan.num_stages,
        "step_s": step_s, "bubble_fraction": plan.bubble_fraction,
        "tflops_per_gpu_megatron_count": megatron_flops(row) / step_s / row.gpus / 1e12,
        "tflops_per_gpu_model_flops": plan.model_flops / step_s / row.gpus / 1e12,
        "max_peak_memory_gib": max(r.peak_memory_bytes for r in plan.ranks) / 2**30,
        "solver": plan.solver.name, "gap": plan.solver.gap, "wall_s": wall,
        "load_avg_1min": os.getloadavg()[0],
    }


def run_row(row: Row, costs: Any, *, own: bool) -> dict[str, Any]:
    """(a) Megatron's configuration and (b) autopart's own plan for one row."""
    from autopart.core.cluster import PRESETS
    from autopart.core.topology import TOPOLOGY_PRESETS
    from autopart.solver import SolveOptions
    from autopart.solver.layout_search import LayoutOptions, solve_layout

    device, topo = PRESETS["a100-80gb"], TOPOLOGY_PRESETS["dgx-a100"]
    dp = row.gpus // (row.tp * row.pp)
    out: dict[str, Any] = {"row": row.__dict__, "dp": dp, "nodes": len(costs.nodes),
                           "megatron_flops": megatron_flops(row)}
    base = dict(batch_size=row.batch, optimizer_state_bytes_per_param_byte=OPTIMIZER_STATE,
                max_cpsat_solves=2, library_versions={"autopart": version("autopart")})
    meg_opts = SolveOptions(**base, recompute=True,  # type: ignore[arg-type]
                            schedule_kind="interleaved_1f1b" if row.pp > 1 else "1f1b",
                            stages_per_rank=None if row.pp > 1 else 1)
    meg_layout = LayoutOptions(num_gpus=row.gpus, topology=topo, tp=row.tp, pp=row.pp, dp=dp,
                               zero_stage=0, num_heads=row.heads, microbatch_sizes=(1,),
                               refine=1, overlap_grad_reduce=False)  # SC'21: after the flush
    t0 = time.perf_counter()
    meg = solve_layout(costs, device, meg_opts, meg_layout)
    out["megatron_config"] = _summary(meg, row, time.perf_counter() - t0)
    pred = out["megatron_config"]["tflops_per_gpu_megatron_count"]
    out["megatron_config"]["error_vs_published"] = pred / row.tflops - 1
    print(f"{row.params_b}B: megatron config predicted {pred:.1f} TFLOP/s per GPU "
          f"(published {row.tflops}), {out['megatron_config']['wall_s']:.1f} s",
          file=sys.stderr, flush=True)
    if not own:
        return out
    # the recompute policy chosen too: selective (torchtitan's op policy) where it beats a
    # whole-stage recompute (autopart.solver.solve's "auto")
    own_opts = SolveOptions(**base, recompute_policy="auto")  # type: ignore[arg-type]
    own_layout = LayoutOptions(num_gpus=row.gpus, topology=topo, num_heads=row.heads,
                               microbatch_sizes=(1, 2, 4), max_layouts=24, refine=1)
    texts, runs = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        plan = solve_layout(costs, device, own_opts, own_layout)
        runs.append(_summary(plan, row, time.perf_counter() - t0))
        texts.append(_plan_json(plan))
    out["own_plan"] = runs[0]
    if runs[0]["recompute_stages"]:
        # the same search with whole-stage recompute only: what the policy choice gained
        t0 = time.perf_counter()
        whole = solve_layout(costs, device, SolveOptions(**base, recompute_policy="full"),  # type: ignore[arg-type]
                             own_layout)
        out["own_full_recompute"] = _summary(whole, row, time.perf_counter() - t0)
    out["own_runs_wall_s"] = [r["wall_s"] for r in runs]
    out["own_identical_json"] = texts[0] == texts[1]
    out["own_at_least_as_fast"] = runs[0]["step_s"] <= out["megatron_config"]["step_s"] + 1e-9
    out["own_fits_memory"] = runs[0]["max_peak_memory_gib"] * 2**30 <= device.memory_bytes
    print(f"  own plan: tp {runs[0]['tp']} pp {runs[0]['pp']} dp {runs[0]['dp']} "
          f"ZeRO-{runs[0]['zero_stage']}, {runs[0]['tflops_per_gpu_megatron_count']:.1f} "
          f"TFLOP/s, {runs[0]['wall_s']:.1f} s / {runs[1]['wall_s']:.1f} s, same JSON "
          f"{out['own_identical_json']}", file=sys.stderr, flush=True)
    return out


def run_korthikanti(costs: Any) -> dict[str, Any]:
    """(c) Full recompute against sequence parallelism with selective / op-level recompute,
    on Korthikanti et al.'s 530B layout (tp 8, pp 35, dp 8), each arm's layout fixed, under
    1F1B and interleaved 1F1B (the abstract does not say which ran); each arm's gain is over
    full recompute under the same schedule."""
    from autopart.core.cluster import PRESETS
    from autopart.core.errors import PlanError
    from autopart.core.topology import TOPOLOGY_PRESETS
    from autopart.solver import SolveOptions
    from autopart.solver.layout_search import LayoutOptions, solve_layout

    row, gpus, batch = ROWS[KORTHIKANTI["row"]], KORTHIKANTI["gpus"], KORTHIKANTI["batch"]
    device, topo = PRESETS["a100-80gb"], TOPOLOGY_PRESETS["dgx-a100"]
    dp = gpus // (row.tp * row.pp)
    flops = model_flops_no_recompute(row, batch)
    arms = {  # name: (recompute, policy, sequence parallel)
        "full recompute": (True, "full", False),
        "full recompute + sequence parallel": (True, "full", True),
        "selective (every stage) + sequence parallel": (True, "selective", True),
        "op-level (solver's choice) + sequence parallel": (None, "op", True),
        "no recompute + sequence parallel": (False, "full", True),
    }
    out: dict[str, Any] = {"source": "Korthikanti et al., MLSys 2023 (arXiv:2205.05198), abstract",
                           "params_b": row.params_b, "tp": row.tp, "pp": row.pp, "dp": dp,
                           "gpus": gpus, "batch": batch, "model_flops": flops,
                           "published": {k: KORTHIKANTI[k] for k in (
                               "mfu_full_recompute", "mfu_selective_sequence_parallel")},
                           "arms": {}}
    for (arm, (recompute, policy, sp)), schedule in itertools.product(arms.items(), SCHEDULES):
        name = f"{arm}, {schedule}"
        opts = SolveOptions(batch_size=batch, recompute=recompute,  # type: ignore[arg-type]
                            recompute_policy=policy,
                            optimizer_state_bytes_per_param_byte=OPTIMIZER_STATE,
                            schedule_kind=schedule, max_cpsat_solves=2,
                            stages_per_rank=1 if schedule == "1f1b" else None,
                            library_versions={"autopart": version("autopart")})
        layout = LayoutOptions(num_gpus=gpus, topology=topo, tp=row.tp, pp=row.pp, dp=dp,
                               zero_stage=0, num_heads=row.heads, microbatch_sizes=(1,),
                               refine=1, overlap_grad_reduce=False, sequence_parallel=sp)
        t0 = time.perf_counter()
        try:
            plan = solve_layout(costs, device, opts, layout)
        except PlanError as err:  # an arm that does not fit (or is not found) is a result
            out["arms"][name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(f"  {name}: {type(err).__name__}", file=sys.stderr, flush=True)
            continue
        summary = _summary(plan, row, time.perf_counter() - t0)
        summary["mfu"] = flops / (summary["step_s"] * gpus * A100_PEAK)
        summary["sequence_parallel"] = plan.sequence_parallel
        summary["kept_nodes"] = len(plan.recompute_kept_nodes)
        out["arms"][name] = summary
        print(f"  {name}: {summary['step_s']:.2f} s, MFU {summary['mfu']:.1%}, "
              f"{summary['recompute_stages']}/{summary['num_stages']} recomputing, peak "
              f"{summary['max_peak_memory_gib']:.1f} GiB, {summary['wall_s']:.1f} s",
              file=sys.stderr, flush=True)
    published = KORTHIKANTI["mfu_selective_sequence_parallel"] / KORTHIKANTI["mfu_full_recompute"]
    out["published_gain"] = published
    for name, arm in out["arms"].items():
        base = out["arms"][f"full recompute, {name.rsplit(', ', 1)[1]}"]
        if "step_s" in arm and "step_s" in base and not name.startswith("full recompute"):
            arm["gain_over_full_recompute"] = base["step_s"] / arm["step_s"]
            arm["gain_error_vs_published"] = arm["gain_over_full_recompute"] / published - 1
    return out


def write_korthikanti(result: dict[str, Any], env: dict[str, Any], path: Path) -> None:
    """korthikanti.md: one line per arm."""
    pub = result["published"]
    lines = [f"{env['machine']}, {env['cpus']} CPUs; Python {env['python']}, torch "
             f"{env['torch']}, ortools {env['ortools']}, transformers {env['transformers']}.",
             "", f"{result['params_b']}B GPT, tp {result['tp']} pp {result['pp']} dp "
             f"{result['dp']} ({result['gpus']} A100 80GB), batch {result['batch']}, microbatch "
             "1, ZeRO 0, gradient all-reduce after the flush. Published (" + result["source"] + "): MFU "
             f"{pub['mfu_full_recompute']:.1%} full recompute, "
             f"{pub['mfu_selective_sequence_parallel']:.1%} selective + sequence parallel, "
             f"gain {result['published_gain']:.3f}x.", "",
             "| arm | recomputing stages | kept nodes | peak GiB | step s | MFU | gain over "
             "full recompute | vs published gain | solve s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, a in result["arms"].items():
        if "error" in a:
            lines.append(f"| {name} | no plan: {a['error'].split(':')[0]} | | | | | | | |")
            continue
        lines.append(f"| {name} | {a['recompute_stages']}/{a['num_stages']} "
                     f"{a['recompute_policy'] if a['recompute_stages'] else ''} | "
                     f"{a['kept_nodes']} | {a['max_peak_memory_gib']:.1f} | {a['step_s']:.2f} | "
                     f"{a['mfu']:.1%} | " + (
                         f"{a['gain_over_full_recompute']:.3f}x | "
                         f"{a['gain_error_vs_published']:+.1%}" if "gain_over_full_recompute"
                         in a else "- | -") + f" | {a['wall_s']:.1f} |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_markdown(results: dict[str, Any], path: Path) -> None:
    """results.md: one table for (a), one for (b)."""
    env = results["environment"]
    lines = [f"{env['machine']}, {env['cpus']} CPUs; Python {env['python']}, torch "
             f"{env['torch']}, ortools {env['ortools']}, transformers {env['transformers']}.",
             "", "## (a) Megatron's configuration, predicted vs published", "",
             "| params | GPUs | tp | pp | dp | batch | published TFLOP/s | predicted | error | "
             "bubble | peak GiB | v | solve s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        row, meg = r["row"], r["megatron_config"]
        lines.append(f"| {row['params_b']}B | {row['gpus']} | {row['tp']} | {row['pp']} | "
                     f"{r['dp']} | {row['batch']} | {row['tflops']} | "
                     f"{meg['tflops_per_gpu_megatron_count']:.1f} | "
                     f"{meg['error_vs_published']:+.1%} | {meg['bubble_fraction']:.1%} | "
                     f"{meg['max_peak_memory_gib']:.1f} | {meg['stages_per_rank']} | "
                     f"{meg['wall_s']:.1f} |")
    within = sum(abs(r["megatron_config"]["error_vs_published"]) <= 0.15 for r in results["rows"])
    lines += ["", f"Within 15 %: {within} of {len(results['rows'])} rows.", ""]
    own_rows = [r for r in results["rows"] if "own_plan" in r]
    if own_rows:
        lines += ["## (b) autopart's own plan on the same costs", "",
                  "| params | tp | pp | dp | ZeRO | mb rows | schedule | v | recompute stages | "
                  "vs whole-stage recompute | predicted TFLOP/s | vs Megatron config | peak GiB | "
                  "solve s (2 runs) | same JSON |",
                  "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for r in own_rows:
            o, meg = r["own_plan"], r["megatron_config"]
            whole = r.get("own_full_recompute")
            gain = f"{whole['step_s'] / o['step_s']:.3f}x" if whole else "-"
            policy = f" {o['recompute_policy']}" if o["recompute_stages"] else ""
            lines.append(
                f"| {r['row']['params_b']}B | {o['tp']} | {o['pp']} | {o['dp']} | "
                f"{o['zero_stage']} | {o['microbatch_rows']} | {o['schedule_kind']} | "
                f"{o['stages_per_rank']} | {o['recompute_stages']}/{o['num_stages']}{policy} | "
                f"{gain} | "
                f"{o['tflops_per_gpu_megatron_count']:.1f} | "
                f"{meg['step_s'] / o['step_s']:.2f}x | {o['max_peak_memory_gib']:.1f} | "
                f"{r['own_runs_wall_s'][0]:.1f} / {r['own_runs_wall_s'][1]:.1f} | "
                f"{r['own_identical_json']} |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_figure(results: dict[str, Any], path: Path) -> bool:
    """Published vs predicted TFLOP/s per GPU, per row; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = results["rows"]
    labels = [f"{r['row']['params_b']:g}B" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(xs, [r["row"]["tflops"] for r in rows], "ko-", label="Megatron-LM, published")
    ax.plot(xs, [r["megatron_config"]["tflops_per_gpu_megatron_count"] for r in rows], "bs--",
            label="autopart, Megatron's configuration")
    own = [(i, r["own_plan"]["tflops_per_gpu_megatron_count"]) for i, r in enumerate(rows)
           if "own_plan" in r]
    if own:
        ax.plot([i for i, _ in own], [t for _, t in own], "g^:", label="autopart, own plan")
    ax.fill_between(xs, [0.85 * r["row"]["tflops"] for r in rows],
                    [1.15 * r["row"]["tflops"] for r in rows], color="0.85", label="±15 %")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("TFLOP/s per GPU (Megatron's count)")
    ax.set_title("GPT weak scaling on A100 80GB (Narayanan et al., SC'21, Table 1)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    """Profile (or load) each row, plan it, write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated row indices (default all)")
    parser.add_argument("--skip-own", action="store_true", help="only (a)")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--korthikanti", action="store_true",
                        help="only (c): Korthikanti et al.'s 530B, full against selective "
                             "recompute with sequence parallelism")
    args = parser.parse_args(argv)
    import torch
    import transformers

    env = {"machine": platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__,
           "ortools": version("ortools"), "transformers": transformers.__version__}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.korthikanti:
        costs = profile_row(ROWS[KORTHIKANTI["row"]], args.cache)
        result = run_korthikanti(costs)
        result["environment"] = env
        (args.out_dir / "korthikanti.json").write_text(
            json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        write_korthikanti(result, env, args.out_dir / "korthikanti.md")
        return

    picked = [int(i) for i in args.rows.split(",") if i] or list(range(len(ROWS)))
    rows = []
    for i in picked:
        t0 = time.perf_counter()
        costs = profile_row(ROWS[i], args.cache)
        print(f"row {i}: {len(costs.nodes)} nodes in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        rows.append(run_row(ROWS[i], costs, own=not args.skip_own))
    results = {
        "source": "Narayanan et al., SC'21 (arXiv:2104.04473), Table 1",
        "device": "a100-80gb", "topology": "dgx-a100", "rows": rows,
        "optimizer_state_bytes_per_param_byte": OPTIMIZER_STATE,
        "environment": env,
    }
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True)
                                               + "\n", encoding="utf-8")
    write_markdown(results, args.out_dir / "results.md")
    write_figure(results, args.out_dir / "figure.png")


if __name__ == "__main__":
    main()
