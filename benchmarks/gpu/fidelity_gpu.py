"""Fidelity on one GPU: 4 stages on one device (CUDA streams), predicted vs measured.

The GPT-2-like model of ``benchmarks/fidelity`` (wider: n_embd 768, batch 32 x 256) is
profiled on ``cuda:0`` and planned for 4 stages on that one device; each plan of a small grid
(m in {4, 8, 16}; gpipe, 1f1b, zero_bubble) and the solver's own choice is run by the local
runtime (one process, a compute and a copy stream per stage), plans alternated step by
step. Per plan: median of ``--steps`` steps (``torch.cuda.synchronize`` around each), one
traced step (CUDA events), one step's ``torch.cuda.max_memory_allocated``. Not run in CI.

Issue 32's two-figure cost model: per plan, the predicted step with the host bound (the
plan's own figure: each action at the slower of its device and host times, and the one
issuing thread's host time as a floor), without it (the same plan on the profile's device
times alone, as before host times existed), and the host bound itself, beside the measured
step and the plain model's step at the plan's microbatching. Per profile: its summed device
and host times beside the plain eager step at the profiled batch.

    python benchmarks/gpu/fidelity_gpu.py [--steps 10] [--out benchmarks/gpu/out]
    python benchmarks/gpu/fidelity_gpu.py --device cpu --small --fake-host-us 50 --plans-only
        (checks the script and the host-bound path without a GPU: every node's host times
        set to 50 µs each; no pipeline runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GRID = [("gpipe", 4), ("1f1b", 4), ("1f1b", 8), ("1f1b", 16), ("zero_bubble", 8)]
#: on CUDA, also run as CUDA graphs (``compile(..., cuda_graphs=True)``) and priced so
#: (``RuntimeDescription.cuda_graphs``): the plan the host bounds most
GRAPHED = [("1f1b", 16)]


def workload(device: str = "cuda:0", small: bool = False) -> tuple[Any, ...]:
    """The GPT-2-like model (12 x 768, vocab 32768, batch 32 x 256, fp32) on ``device``;
    ``small`` (2 x 64, vocab 512, batch 32 x 16) is for checking the script without a GPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopart.apps.demo import gpt2_loss

    torch.manual_seed(0)
    layers, width, heads, vocab, batch, seq = ((2, 64, 4, 512, 32, 16) if small
                                               else (12, 768, 12, 32768, 32, 256))
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                     n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    return GPT2LMHeadModel(cfg).to(device), (tokens,), tokens, gpt2_loss


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on ``cpu``)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: str) -> str:
    """The GPU's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"


def with_host_times(costs: Any, us: float | None) -> Any:
    """``costs`` with every node's three host issue times set to ``us`` µs (None: removed,
    the cost model of before host times)."""
    return dataclasses.replace(costs, nodes=tuple(
        dataclasses.replace(n, host_fwd_us=us, host_bwd_input_us=us, host_bwd_weight_us=us)
        for n in costs.nodes))


def plain_step_s(model: Any, args: tuple[Any, ...], target: Any, loss_fn: Any, m: int,
                 rows: int, steps: int, device: str) -> float:
    """Median seconds of the plain model's forward, loss and backward over the first
    ``rows`` rows in ``m`` microbatches (gradients accumulated), ``torch.cuda.synchronize``
    around each step; the first two steps are warm-up."""
    x, t = args[0][:rows], target[:rows]
    times = []
    for i in range(steps + 2):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        t0 = time.perf_counter()
        for xs, ts in zip(x.chunk(m), t.chunk(m), strict=True):
            (loss_fn(model(xs), ts) / m).backward()
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def host_rows(profiles: dict[str, Any], plans: dict[str, Any]) -> list[dict[str, Any]]:
    """Per plan (priced on its own profile in ``profiles``): predicted step with the host
    bound, without it, and the bound, s."""
    from autopart.trace import predict

    rows = []
    for name, plan in plans.items():
        profile = profiles[name]
        device_only = dataclasses.replace(profile, costs=with_host_times(profile.costs, None))
        pred = predict(profile, plan)
        rows.append({"plan": name, "schedule": plan.schedule_kind,
                     "num_microbatches": plan.num_microbatches,
                     "predicted_step_s": plan.predicted_step_time_us / 1e6,
                     "predicted_replay_s": pred.step_time_us / 1e6,
                     "predicted_without_host_s": predict(device_only, plan).step_time_us / 1e6,
                     "host_bound_s": pred.host_bound_us / 1e6})
    return rows


def profile_sums(profile: Any, model: Any, args: tuple[Any, ...], target: Any, loss_fn: Any,
                 steps: int, device: str) -> dict[str, Any]:
    """The profile's node sums (forward + backward, loss included in the last node's device
    times) beside the plain eager step at the profiled batch, s."""
    costs = profile.costs
    eager = plain_step_s(model, args, target, loss_fn, 1, costs.batch_size, steps, device)
    device_sum = (costs.total_fwd_us() + costs.total_bwd_us()) / 1e6
    host_sum = costs.total_host_us() / 1e6
    return {"profiled_rows": costs.batch_size, "device_sum_s": device_sum,
            "host_sum_s": host_sum if costs.has_host_times else None,
            "eager_step_s": eager, "device_sum_over_eager": device_sum / eager,
            "host_sum_over_eager": host_sum / eager if costs.has_host_times else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).with_name("out")))
    parser.add_argument("--device", default="cuda:0",
                        help="cpu (with --small) checks the script on a machine without a GPU")
    parser.add_argument("--small", action="store_true", help="a 2-layer model, for checking")
    parser.add_argument("--fake-host-us", type=float, default=None,
                        help="set every node's host issue times to this many µs (checking "
                             "the host-bound path on a CPU profile, which has none)")
    parser.add_argument("--plans-only", action="store_true",
                        help="print the plans' predictions and the profile's sums; run no "
                             "pipeline")
    opts = parser.parse_args()
    import copy

    import autopart
    from autopart.apps.figures import gantt
    from autopart.trace import predict

    dev = opts.device
    if torch.device(dev).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs one GPU (or --device cpu --small)")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    devices = [dev] * 4
    model, args, target, loss_fn = workload(dev, opts.small)
    solver_plan, profile = autopart.plan_model(model, args, devices=devices, loss_fn=loss_fn,
                                               example_target=target)
    if opts.fake_host_us is not None:
        profile = dataclasses.replace(
            profile, costs=with_host_times(profile.costs, opts.fake_host_us))
        solver_plan = profile.solve()
    plans = {"solver": solver_plan}
    for kind, m in GRID:
        plans[f"{kind} m{m}"] = profile.solve(schedule_kind=kind, stages_per_rank=1,
                                              num_microbatches=m)
    profile_of = dict.fromkeys(plans, profile)
    if torch.device(dev).type == "cuda":  # the host-bound m = 16 plan replayed as CUDA graphs
        graphed = dataclasses.replace(profile, runtime=dataclasses.replace(
            profile.runtime, cuda_graphs=True))
        for kind, m in GRAPHED:
            name = f"{kind} m{m} graphs"
            plans[name] = graphed.solve(schedule_kind=kind, stages_per_rank=1,
                                        num_microbatches=m)
            profile_of[name] = graphed
    sums = profile_sums(profile, model, args, target, loss_fn, opts.steps, dev)
    host = {r["plan"]: r for r in host_rows(profile_of, plans)}
    plain = {m: plain_step_s(model, args, target, loss_fn, m, args[0].shape[0], opts.steps, dev)
             for m in sorted({p.num_microbatches for p in plans.values()})}
    print_host_figures(sums, host, plain)
    if opts.plans_only:
        (out / "host_figures.json").write_text(json.dumps(
            {"device": device_name(dev), "fake_host_us": opts.fake_host_us, "profile": sums,
             "plans": list(host.values()), "plain_step_s": plain}, indent=1) + "\n")
        return
    arms = {}
    for name, plan in plans.items():
        pipe = autopart.compile(copy.deepcopy(model), args, loss_fn=loss_fn, plan=plan,
                                cuda_graphs=name.endswith(" graphs"))
        arms[name] = (pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-5))
    times: dict[str, list[float]] = {n: [] for n in arms}
    names = list(arms)
    for i in range(opts.steps + 2):
        for name in names[i % len(names):] + names[:i % len(names)]:
            pipe, opt = arms[name]
            opt.zero_grad()
            synchronize(dev)
            t0 = time.perf_counter()
            pipe.train_step(*args, target=target)
            synchronize(dev)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
            opt.step()
    rows = []
    for name, (pipe, opt) in arms.items():
        opt.zero_grad()
        pipe.train_step(*args, target=target, trace=True)
        traced = pipe.last_trace
        opt.zero_grad()
        pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
        plan = plans[name]
        pred = predict(profile_of[name], plan)
        measured = statistics.median(times[name])
        rows.append({**host[name], "measured_step_s": measured,
                     "plain_step_same_m_s": plain[plan.num_microbatches],
                     "over_plain": measured / plain[plan.num_microbatches] - 1,
                     "step_error": plan.predicted_step_time_us / 1e6 / measured - 1,
                     "predicted_peak_bytes_device": pred.device_peak_bytes.get(
                         dev, sum(r.peak_memory_bytes for r in plan.ranks)),
                     "predicted_peak_sum_bytes": sum(r.peak_memory_bytes for r in plan.ranks),
                     "predicted_rank_peaks_bytes": [r.peak_memory_bytes for r in plan.ranks],
                     "stage_nodes": [s.num_nodes for s in plan.stages],
                     "traced_actions": action_errors(traced, pred.stage_costs),
                     "cuda_graph_reasons": ({str(k): v for k, v in pipe.cuda_graph_reasons.items()}
                                            if name.endswith(" graphs") else None),
                     "measured_peak_bytes_device": pipe.last_peak_memory_bytes.by_device[dev]})
        if name == "solver":
            gantt(out / "timeline_gpu.png", [("predicted", pred.trace), ("measured", traced)],
                  title=f"one {device_name(dev)}, 4 stages, solver's plan")
    report = {"device": device_name(dev), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(),
              "fake_host_us": opts.fake_host_us, "profile": sums, "plain_step_s": plain,
              "ranks_per_device": profile.runtime.ranks_per_core, "rows": rows,
              "nodes": node_table(profile.costs)}
    (out / "fidelity_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    for r in rows:
        acts = r["traced_actions"]
        if acts["actions"]:
            print(f"{r['plan']:>16}: traced actions against their prediction: median "
                  f"|error| {acts['median_abs_error']:.1%}, worst {acts['worst_abs_error']:.1%}; "
                  + ", ".join(f"{k} {v:+.0%}"
                              for k, v in acts["median_error_by_stage_kind"].items()))
        print(f"{r['plan']:>16}: predicted {r['predicted_step_s']:.4f} s (without the host "
              f"bound {r['predicted_without_host_s']:.4f} s), measured "
              f"{r['measured_step_s']:.4f} s ({r['step_error']:+.1%}; plain model at m = "
              f"{r['num_microbatches']}: {r['plain_step_same_m_s']:.4f} s, pipeline "
              f"{r['over_plain']:+.1%}); peak predicted "
              f"{r['predicted_peak_bytes_device'] / 2**30:.2f} GiB, measured "
              f"{r['measured_peak_bytes_device'] / 2**30:.2f} GiB")


def action_errors(measured: Any, costs: Any) -> dict[str, Any]:
    """Each compute action of a traced step (``"1F3"``: stage 1's forward of microbatch 3)
    against what the cost model charges that action alone (``Prediction.stage_costs``: F its
    forward, B both backward parts, I and W each part; sends not included), not against its
    slice in the predicted trace, which the replay stretches where stages share a device:
    ``measured / predicted - 1`` per action, their median and worst absolute value, and per
    stage and kind (``"1F"``) the median error."""
    charged = {"F": costs.fwd_us, "I": costs.bwd_input_us, "W": costs.bwd_weight_us,
               "B": [i + w for i, w in zip(costs.bwd_input_us, costs.bwd_weight_us,
                                           strict=True)]}
    errors: dict[str, float] = {}
    for e in measured.events:
        if e.action is None:
            continue
        kind = e.name.rstrip("0123456789")  # "1F3" -> "1F"
        stage, letter = int(kind[:-1]), kind[-1]
        want = charged[letter][stage]
        if want > 0:
            errors[e.name] = e.duration_us / want - 1
    by_kind: dict[str, list[float]] = {}
    for name, err in errors.items():
        by_kind.setdefault(name.rstrip("0123456789"), []).append(err)
    size = [abs(v) for v in errors.values()]
    return {"actions": len(errors),
            "median_abs_error": statistics.median(size) if size else None,
            "worst_abs_error": max(size) if size else None,
            "median_error_by_stage_kind": {k: statistics.median(v)
                                           for k, v in sorted(by_kind.items())}}


def node_table(costs: Any) -> dict[str, Any]:
    """The profile's per-node times as columns (µs; host columns None without host times),
    so that a run's cost model can be re-examined without the GPU."""
    cols = ("name", "op", "fwd_us", "bwd_input_us", "bwd_weight_us", "host_fwd_us",
            "host_bwd_input_us", "host_bwd_weight_us")
    return {"batch_size": costs.batch_size,
            **{c: [getattr(n, c) for n in costs.nodes] for c in cols}}


def print_host_figures(sums: dict[str, Any], host: dict[str, dict[str, Any]],
                       plain: dict[int, float]) -> None:
    """The profile's sums beside the eager step, and each plan's predictions, s."""
    host_sum = ("no host times (CPU)" if sums["host_sum_s"] is None else
                f"{sums['host_sum_s']:.4f} s ({sums['host_sum_over_eager']:.2f}x)")
    print(f"profile at {sums['profiled_rows']} rows: node device sum "
          f"{sums['device_sum_s']:.4f} s ({sums['device_sum_over_eager']:.2f}x the plain eager "
          f"step {sums['eager_step_s']:.4f} s), host sum {host_sum}")
    print("plain model step by m: " + ", ".join(f"m{m} {t:.4f} s" for m, t in plain.items()))
    for r in host.values():
        print(f"{r['plan']:>16}: {r['schedule']} m{r['num_microbatches']}, predicted "
              f"{r['predicted_step_s']:.4f} s with the host bound ({r['host_bound_s']:.4f} s), "
              f"{r['predicted_without_host_s']:.4f} s without")


if __name__ == "__main__":
    main()
