"""Fidelity with fuse=True: a plan priced on compiled segments against its compiled run.

The GPT-2-like workload of ``run.py`` is profiled twice at m fixed (default 8), as
``autopart.compile(..., backend="distributed")`` profiles it for two CPU ranks: eagerly, and
with ``fuse=True`` (each calibration segment compiled with ``torch.compile``, so the node
costs sum, segment by segment, to the compiled code's times). The same schedule is solved on
each (default 1F1B, v = 1, no recompute). Two gloo ranks with one thread each build both
pipelines, the fused one with ``fuse=True``, and run them alternately, step by step
(:func:`autopart.apps.bench.run_arms`); the pair runs ``--repeats`` times in fresh
processes. Per run and arm: the median of ``--steps`` timed ``train_step`` calls (slowest
rank, after a barrier) and their spread. Also reported: what the eager profile predicts for
the fused plan (the price before this profile existed), the compile time the fused profile
adds, and how far the fused profile's stage sums are from each stage compiled whole (a
stage fuses across the segment boundaries inside it).

    .venv/bin/python benchmarks/fidelity/run_fuse.py [--steps 7] [--repeats 3] [--out DIR]

Writes ``results_fuse.json`` and ``results_fuse.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parent))

from run import WARMUP, P, gpt2  # noqa: E402  (this folder's fidelity benchmark)


def _load() -> str:
    """The 1, 5 and 15 minute load averages (``os.getloadavg``)."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _wait(load: float | None, most_s: float = 300.0) -> None:
    """Sleep until the 1-minute load average is at most ``load`` (None: no wait), or
    ``most_s`` seconds have gone by."""
    start = time.monotonic()
    while load is not None and os.getloadavg()[0] > load and time.monotonic() - start < most_s:
        time.sleep(5)


def _spread(steps: list[float]) -> float:
    """(max - min) / median of an arm's timed steps."""
    return (max(steps) - min(steps)) / statistics.median(steps)


def stage_check(eager: Any, plan: Any) -> list[dict[str, float]]:
    """Each stage of ``plan`` compiled whole against the sum of its calibration segments
    compiled one by one (cut where the fused profile is cut: :data:`CALIBRATION_SEGMENTS`
    parts of nearly equal time, here of ``eager``'s costs, plus the plan's cuts), both
    timed as the profile's calibration times segments, beside one co-runner as the two
    ranks run, back to back in this process (the loss runs outside the stages either way).

    Returns:
        Per stage: ``fwd_us``, ``bwd_us`` (compiled whole), ``segments_fwd_us``,
        ``segments_bwd_us`` (the sums of its segments compiled apart), ``segments``.
    """
    from autopart.core.signature import microbatch_inputs
    from autopart.profiler.batch_points import CALIBRATION_SEGMENTS
    from autopart.profiler.calibrate import segment_cuts, segment_times
    from autopart.profiler.corunners import co_runners, model_step
    from autopart.solver import find_candidates

    captured = eager.captured
    _, args, _, _ = gpt2()
    m_args, m_kwargs = microbatch_inputs(args, {}, plan.num_microbatches)
    flat = captured.flatten_inputs(m_args, m_kwargs)
    cuts = [c.position for c in plan.cuts]
    parts = sorted({*segment_cuts(eager.costs, find_candidates(eager.costs, 3).positions,
                                  CALIBRATION_SEGMENTS), *cuts})
    with co_runners(model_step(captured, flat), 1):
        whole = segment_times(captured, flat, "cpu", cuts, fuse=True)
        apart = segment_times(captured, flat, "cpu", parts, fuse=True)
    bounds = [0, *cuts, len(eager.costs.nodes)]
    rows = []
    for (a, z), (fwd, bwd) in zip(itertools.pairwise(bounds), whole, strict=True):
        inside = [t for q, t in zip([0, *parts], apart, strict=True) if a <= q < z]
        rows.append({"fwd_us": fwd, "bwd_us": bwd, "segments": len(inside),
                     "segments_fwd_us": sum(f for f, _ in inside),
                     "segments_bwd_us": sum(b for _, b in inside)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per arm (default 7)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of the pair in fresh processes (default 3)")
    parser.add_argument("--m", type=int, default=8, help="microbatches (default 8)")
    parser.add_argument("--schedule", default="1f1b", help="schedule kind (default 1f1b)")
    parser.add_argument("--out", default=str(HERE.parent))
    parser.add_argument("--wait-load", type=float, default=None, metavar="L",
                        help="before the profiles and each run, wait (at most 5 minutes) "
                             "for the 1-minute load average to fall to L")
    opts = parser.parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # compile from nothing, as a first launch does (the profile's compile time is reported)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopart-fuse-inductor-")
    os.environ["AUTOPART_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopart-fuse-cache-")
    import autopart
    from autopart.apps.bench import run_arms
    from autopart.trace import predict

    torch.set_num_threads(1)  # profile as each rank runs: one thread
    t_start = time.perf_counter()
    _wait(opts.wait_load)
    load_at = {"start": _load()}
    model, args, target, loss_fn = gpt2()
    profiles, plans = {}, {}
    for arm, fuse in (("eager", False), ("fused", True)):
        t0 = time.perf_counter()
        plan, profile = autopart.plan_model(
            model, args, devices=["cpu"] * P, loss_fn=loss_fn, example_target=target,
            backend="distributed", num_microbatches=opts.m, schedule_kind=opts.schedule,
            stages_per_rank=1, recompute=False, fuse=fuse)
        profiles[arm] = {"profile": profile, "plan_s": time.perf_counter() - t0}
        plans[arm] = plan
        print(f"{arm}: planned in {profiles[arm]['plan_s']:.1f} s, cuts "
              f"{[c.position for c in plan.cuts]}, predicted "
              f"{plan.predicted_step_time_us / 1e6:.3f} s", flush=True)
    load_at["profiled"] = _load()
    eager_price = predict(profiles["eager"]["profile"], plans["fused"]).step_time_us / 1e6
    t0 = time.perf_counter()
    stages = stage_check(profiles["eager"]["profile"], plans["fused"])
    stage_check_s = time.perf_counter() - t0
    load_at["stage_check"] = _load()
    runs = []
    for r in range(opts.repeats):
        _wait(opts.wait_load)
        load_at[f"before run{r}"] = _load()
        got = run_arms(f"{HERE.parent / 'run.py'}:gpt2", plans, ranks=P, steps=opts.steps,
                       warmup=WARMUP, single=False, trace=False, fuse=["fused"])
        runs.append({arm: {"steps_s": [round(t, 4) for t in res.steps_s],
                           "step_s": res.step_s, "spread": _spread(res.steps_s),
                           "peak_bytes": res.peak_bytes}
                     for arm, res in got.items()})
        load_at[f"after run{r}"] = _load()
        print(f"run {r}: " + ", ".join(f"{a} {v['step_s']:.3f} s ({v['spread']:.0%})"
                                        for a, v in runs[-1].items()), flush=True)
    arms = {}
    for arm in plans:
        pred = plans[arm].predicted_step_time_us / 1e6
        medians = [run[arm]["step_s"] for run in runs]
        measured = statistics.median(medians)
        arms[arm] = {"cuts": [c.position for c in plans[arm].cuts], "predicted_step_s": pred,
                     "measured_step_s": measured, "run_medians_s": medians,
                     "step_error": pred / measured - 1,
                     "run_errors": [pred / x - 1 for x in medians],
                     "predicted_peak_bytes": [rk.peak_memory_bytes for rk in plans[arm].ranks],
                     "plan_s": profiles[arm]["plan_s"],
                     "profile_timings_s": profiles[arm]["profile"].timings_s}
    arms["fused"]["eager_profile_predicted_step_s"] = eager_price
    arms["fused"]["eager_profile_step_error"] = eager_price / arms["fused"]["measured_step_s"] - 1
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "ranks": P, "threads_per_rank": 1, "steps": opts.steps, "repeats": opts.repeats,
              "schedule": opts.schedule, "num_microbatches": opts.m, "load": load_at,
              "wall_s": round(time.perf_counter() - t_start, 1), "arms": arms,
              "stages": stages, "stage_check_s": stage_check_s, "runs": runs}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results_fuse.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "results_fuse.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    a = report["arms"]
    e, f = a["eager"], a["fused"]
    add = f["plan_s"] - e["plan_s"]
    lines = [f"Fidelity with fuse=True, {report['date']}: {report['machine']}; Python "
             f"{report['python']}, torch {report['torch']}; GPT-2-like (run.py), "
             f"{report['schedule']} v1 m{report['num_microbatches']}, {report['ranks']} gloo "
             f"ranks x {report['threads_per_rank']} thread; the eager and the fused plan "
             f"alternated step by step, median of {report['steps']} steps, the pair run "
             f"{report['repeats']} times in fresh processes (the table's measured step is the "
             "median of the runs' medians).", "",
             "Load averages (1 / 5 / 15 min): "
             + "; ".join(f"{k} {v}" for k, v in report["load"].items()) + ".", "",
             "| arm | cuts | predicted s | measured s | error | runs' medians s | runs' "
             "errors | runs' spreads |", "|---|---|---:|---:|---:|---|---|---|"]
    for arm in ("eager", "fused"):
        r = a[arm]
        spreads = [run[arm]["spread"] for run in report["runs"]]
        lines.append(f"| {arm} | {r['cuts']} | {r['predicted_step_s']:.3f} | "
                     f"{r['measured_step_s']:.3f} | {r['step_error']:+.1%} | "
                     + ", ".join(f"{x:.3f}" for x in r["run_medians_s"]) + " | "
                     + ", ".join(f"{x:+.1%}" for x in r["run_errors"]) + " | "
                     + ", ".join(f"{x:.0%}" for x in spreads) + " |")
    lines += ["", f"- The fused plan priced on the eager profile (as before this profile "
              f"existed): {f['eager_profile_predicted_step_s']:.3f} s, "
              f"{f['eager_profile_step_error']:+.1%} against its compiled run.",
              f"- Planning with fuse=True took {f['plan_s']:.1f} s against {e['plan_s']:.1f} s "
              f"eager: {add:+.1f} s, mostly compiling the calibration segments.",
              "- Each fused stage compiled whole against the sum of its calibration segments "
              "compiled apart (forward / backward, µs at the microbatch, beside one "
              f"co-runner; {report['stage_check_s']:.0f} s with compiling):"]
    for k, s in enumerate(report["stages"]):
        lines.append(f"  - stage {k}: whole {s['fwd_us']:.0f} / {s['bwd_us']:.0f}, its "
                     f"{s['segments']} segments' sum {s['segments_fwd_us']:.0f} / "
                     f"{s['segments_bwd_us']:.0f} "
                     f"({s['segments_fwd_us'] / s['fwd_us'] - 1:+.1%} / "
                     f"{s['segments_bwd_us'] / s['bwd_us'] - 1:+.1%})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
