"""One report over every benchmark's recorded results: plan against measurement, and
autopart against the baselines users know.

Reads the ``results*.json`` files that the benchmarks' ``run.py`` scripts write (it runs
nothing itself) and writes ``REPORT.md`` plus PNG figures beside it:

- ``pipeline_cpu``: measured two-rank step times of autopart, torch's Schedule1F1B /
  ScheduleInterleaved1F1B and the hand split, beside the plan's predicted step;
- ``executor_overhead``: the one-device pipeline against the plain model;
- ``plan_quality``: predicted step time of the four baseline partitioners over autopart's,
  per model and rank count (analytical H100 costs);
- ``solver_scale``: the GPT-3-175B-shaped solve onto 64 ranks;
- ``layout_scale``: ``autopart plan``'s layout search for 7B-1T GPTs on 1024-8192 H100s;
- ``overlap_cpu``: ZeRO-0's overlapped gradient all-reduce against the flushed one on gloo
  CPU ranks;
- ``selective_recompute``: selective against whole-stage recompute on gloo CPU ranks;
- ``zoo``: transformers' architectures through autopart, counts per family;
- ``pipeline_cpu/results_peers.json`` (``peers.py``): peers, measured: autopart against
  DeepSpeed's pipeline engine, torch's schedules and the hand split, per workload.

A benchmark without recorded results is listed as missing, not guessed.

    .venv/bin/python benchmarks/report.py [--results benchmarks] [--out benchmarks/REPORT.md]
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# pipeline_cpu arms, in the order shown, with the labels the benchmark's README uses
PIPELINE_ARMS = (("autopart", "(c) autopart"), ("torch_1f1b", "(b) torch Schedule1F1B"),
                 ("torch_interleaved_1f1b", "(b') torch ScheduleInterleaved1F1B"),
                 ("torch_hand_split", "(d) hand split, Schedule1F1B"))
PIPELINE_FILES = (("results.json", "solver's choice"), ("results_1f1b.json", "v = 1 fixed"),
                  ("results_zero_bubble.json", "zero_bubble fixed"))
# peers.py arms, in the order shown
PEER_ARMS = ("autopart", "deepspeed_parameters", "deepspeed_uniform", "deepspeed_type",
             "torch_1f1b", "torch_interleaved_1f1b", "hand_split", "single")
BASELINES = ("uniform_layers", "deepspeed_parameters", "pippy_equal_size",
             "torchgpipe_balance_by_time")


def _load(path: Path) -> Any | None:
    """The JSON at ``path``, or None when it is absent.

    Raises:
        ValueError: the file exists but is not JSON (names the file).
    """
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); re-run that benchmark's run.py") from exc


def _figure(path: Path, draw: Callable[[Any], None], size: tuple[float, float]) -> None:
    """Draw with matplotlib (Agg, no display needed) and save ``path`` as PNG, 120 dpi."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pipeline_cpu(results: Path, figures: Path) -> list[str]:
    """Markdown lines and a figure for ``pipeline_cpu``: measured vs predicted step, per arm."""
    runs = [(name, what, data) for name, what in PIPELINE_FILES
            if (data := _load(results / "pipeline_cpu" / name)) is not None]
    if not runs:
        return ["## pipeline_cpu", "", "No recorded results (`benchmarks/pipeline_cpu/run.py`).", ""]
    first = runs[0][2]
    lines = ["## pipeline_cpu: two ranks on CPU, plan against measurement", "",
             f"{first['model']}, m = {first['num_microbatches']}, {first['ranks']} gloo ranks "
             f"with {first['threads_per_rank']} thread each; {first['machine']}, Python "
             f"{first['python']}, torch {first['torch']}. Ideal speed-up m·p/(m+p−1) = "
             f"{first['ideal_speedup']}. Measured: medians of {len(first['autopart']['steps_s'])} "
             "steps; predicted: the plan's step time on the profile it was solved from.", "",
             "| run | plan | predicted s | (a) 1 process s | "
             + " | ".join(f"{label} s" for _, label in PIPELINE_ARMS) + " |",
             "|---|---|---:|---:|" + "---:|" * len(PIPELINE_ARMS)]
    for name, what, d in runs:
        plan = d["plan"]
        desc = (f"{plan['schedule']}, v = {plan.get('stages_per_rank', 1)}, cuts "
                f"{'/'.join(map(str, plan['cuts']))}")
        cells = []
        for arm, _ in PIPELINE_ARMS:
            if arm not in d:
                cells.append("—")
                continue
            cell = f"{d[arm]['step_s']:.3f} ({d[arm]['fraction_of_ideal']:.3f} of ideal"
            ratio = d[arm].get("time_over_autopart")
            cell += f"; {ratio['median']:.3f}x autopart)" if ratio else ")"
            cells.append(cell)
        lines.append(f"| `{name}` ({what}) | {desc} | {plan['predicted_step_ms'] / 1e3:.3f} | "
                     f"{d['single_process_step_s']:.3f} | " + " | ".join(cells) + " |")
    fig = figures / "pipeline_cpu.png"

    def draw(ax: Any) -> None:
        width = 0.8 / (len(PIPELINE_ARMS) + 1)
        for k, (arm, label) in enumerate(PIPELINE_ARMS):
            xs = [i + k * width for i, (_, _, d) in enumerate(runs) if arm in d]
            ys = [d[arm]["step_s"] for _, _, d in runs if arm in d]
            ax.bar(xs, ys, width, label=label)
        for i, (_, _, d) in enumerate(runs):
            ideal = d["single_process_step_s"] / d["ideal_speedup"]
            span = (i - width / 2, i + (len(PIPELINE_ARMS) - 0.5) * width)
            ax.hlines(ideal, *span, colors="k", linestyles="dashed",
                      label="(a) / ideal speed-up" if i == 0 else None)
            ax.plot(i, d["plan"]["predicted_step_ms"] / 1e3, "kv",
                    label="autopart predicted" if i == 0 else None)
        ax.set_xticks([i + 1.5 * width for i in range(len(runs))],
                      [f"{name}\n({what})" for name, what, _ in runs])
        ax.set_ylabel("step time, s (median)")
        ax.set_title("pipeline_cpu: 2 ranks x 1 thread, m = 8")
        ax.set_ylim(0, 1.4 * max(d[arm]["step_s"] for _, _, d in runs for arm, _ in PIPELINE_ARMS
                                 if arm in d))
        ax.legend(fontsize=7, loc="upper center", ncol=3)

    _figure(fig, draw, (8.0, 4.5))
    return lines + ["", f"![pipeline_cpu]({fig.relative_to(figures.parent).as_posix()})", ""]


#: Further peers.py runs shown after the main one, each with its own command and date:
#: file name -> what sets it apart.
PEERS_EXTRA_RUNS = {
    "results_peers_vocab50k.json": "gpt2_head_heavy with a 50k vocabulary (`--head-vocab 50000`)",
    "results_peers_untuned.json": ("the earlier run of every workload, before the CPU runtimes "
                                   "kept freed memory (`autopart/runtime/host.py`) and "
                                   "measured the link between ranks"),
}


def _peers_header(d: dict[str, Any]) -> str:
    return (f"{d['machine']}; Python {d['python']}, torch {d['torch']}, transformers "
            f"{d['transformers']}, deepspeed {d['deepspeed']}, ortools {d['ortools']}; "
            f"{d['ranks']} gloo ranks x {d['threads_per_rank']} thread; {d['launches']} "
            f"launch(es) of fresh processes x {d['steps']} timed steps, arms alternated step by "
            f"step; recorded {d['date']} by `{d['command']}`.")


def _peers_tables(d: dict[str, Any], level: str = "###") -> list[str]:
    """One table per workload of a peers.py result."""
    lines: list[str] = []
    for name, wl in d["workloads"].items():
        plan = wl["plan"]
        lines += [f"{level} {name}", "", f"{wl['description']}; m = {wl['num_microbatches']}, "
                  f"ideal speed-up {wl['ideal_speedup']}. autopart's plan: {plan['schedule']}, "
                  f"v = {plan['stages_per_rank']}, cuts {plan['cuts']}, predicted "
                  f"{plan['predicted_step_s']:.3f} s.", ""]
        for i, launch in enumerate(wl["launches"]):
            if "error" in launch:
                lines.append(f"- launch {i}: **failed**: {launch['error']}")
            for arm, why in launch.get("failed", {}).items():
                lines.append(f"- launch {i}: `{arm}` **could not run**: {why}")
        lines += ["", "| arm | step s | spread | fraction of ideal | time / autopart [95% CI] | "
                  "loss vs single: first step / every step | partition |",
                  "|---|---:|---:|---:|---|---|---|"]
        summary = wl["summary"]
        for arm in PEER_ARMS:
            if arm not in summary:
                continue
            s = summary[arm]
            ratio = s.get("time_over_autopart")
            ratio_txt = (f"{ratio['median']:.3f}x [{ratio['median_95ci'][0]:.3f}, "
                         f"{ratio['median_95ci'][1]:.3f}]" if ratio else "—")
            frac = f"{s['fraction_of_ideal']:.3f}" if "fraction_of_ideal" in s else "—"
            part = (f"parts {s['parts']}" if "parts" in s else f"cuts {plan['cuts']}"
                    if arm == "autopart" else f"at {', '.join(s['split'])}" if "split" in s
                    else "")
            lines.append(f"| {arm} | {s['step_s']:.3f} | {s['spread_over_launches']:.1%} | "
                         f"{frac} | {ratio_txt} | {s['loss_check']} / "
                         f"{s.get('loss_trajectory_check', '—')} | {part} |")
        lines.append("")
    return lines


def peers_measured(results: Path, figures: Path) -> list[str]:
    """Markdown lines and a bar chart for ``pipeline_cpu/results_peers.json``: per workload,
    every arm's median step over launches, its spread, fraction of ideal and time over
    autopart's (paired step by step, pooled over launches); then the runs of
    :data:`PEERS_EXTRA_RUNS` that are recorded, as tables."""
    d = _load(results / "pipeline_cpu" / "results_peers.json")
    if d is None:
        return ["## Peers, measured", "",
                "No recorded results (`benchmarks/pipeline_cpu/peers.py`).", ""]
    lines = ["## Peers, measured: DeepSpeed, torch's schedules and the hand split", "",
             _peers_header(d) + " Step: median over the launches of each launch's median; "
             "spread: (max − min) / median of the launch medians; time / autopart: paired "
             "step by step, pooled over launches, bootstrap 95% interval.", ""]
    workloads = d["workloads"]
    lines += _peers_tables(d)
    for file, what in PEERS_EXTRA_RUNS.items():
        extra = _load(results / "pipeline_cpu" / file)
        if extra is not None:
            lines += [f"### Also recorded: {what}", "", _peers_header(extra), ""]
            lines += _peers_tables(extra, "####")
    fig = figures / "peers.png"
    names = list(workloads)

    def draw(ax: Any) -> None:
        arms = [a for a in PEER_ARMS if any(a in wl["summary"] for wl in workloads.values())]
        width = 0.8 / max(len(arms), 1)
        for k, arm in enumerate(arms):
            xs, ys, lo, hi = [], [], [], []
            for i, wl in enumerate(workloads.values()):
                if arm in wl["summary"]:
                    per = wl["summary"][arm]["step_s_per_launch"]
                    xs.append(i + k * width)
                    ys.append(wl["summary"][arm]["step_s"])
                    lo.append(ys[-1] - min(per))
                    hi.append(max(per) - ys[-1])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=arm)
        for i, wl in enumerate(workloads.values()):
            ax.plot(i, wl["plan"]["predicted_step_s"], "kv",
                    label="autopart predicted" if i == 0 else None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, fontsize=8)
        ax.set_ylabel("step time, s (median over launches; bars: min-max)")
        ax.set_title("Peers, measured: 2 gloo ranks x 1 thread")
        ax.legend(fontsize=7, loc="upper left", ncol=3)

    _figure(fig, draw, (9.0, 4.5))
    return lines + [f"![peers, measured]({fig.relative_to(figures.parent).as_posix()})", ""]


def executor_overhead(results: Path) -> list[str]:
    """Markdown lines for ``executor_overhead``."""
    d = _load(results / "executor_overhead" / "results.json")
    if d is None:
        return ["## executor_overhead", "", "No recorded results.", ""]
    lines = ["## executor_overhead: one device, pipeline against the plain model", "",
             f"{d['device_name']}; Python {d['python']}, torch {d['torch']}; batch {d['batch']} x "
             f"{d['seq']}, m = {d['microbatches']}, {d['stages']} stages on one {d['device']}; "
             f"medians of {d['steps']} steps. The plan's prediction assumes {d['stages']} devices "
             "working in parallel, so on one device it is not the step to expect.", "",
             "| schedule | pipeline s | plain s | overhead (paired) | max loss diff | predicted s "
             f"({d['stages']} devices) |", "|---|---:|---:|---:|---:|---:|"]
    for kind, r in d["schedules"].items():
        lines.append(f"| {kind} | {r['pipeline_step_s']:.3f} | {r['plain_step_s']:.3f} | "
                     f"{r['overhead_paired']:+.1%} | {r['max_abs_loss_diff']:.1e} | "
                     f"{r['predicted_step_ms'] / 1e3:.3f} |")
    return lines + [""]


def plan_quality(results: Path, figures: Path) -> list[str]:
    """Markdown lines and a figure for ``plan_quality``: baseline step / autopart step."""
    d = _load(results / "plan_quality" / "results.json")
    if d is None:
        return ["## plan_quality", "", "No recorded results.", ""]
    env = d["environment"]
    rows: list[tuple[str, int, float, dict[str, tuple[float, bool, bool]]]] = []
    for model, m in d["models"].items():
        for r in m["speed"]:
            base = {b["name"]: (b["predicted_step_time_us"] / r["predicted_step_time_us"],
                                b.get("recompute", False), b.get("fits", True))
                    for b in r["baselines"]}
            rows.append((model, r["ranks"], r["predicted_step_time_us"], base))
    lines = ["## plan_quality: autopart against the partitioners users know", "",
             f"Predicted step times on analytical {env['device_preset']} costs (no GPU used); "
             f"{env['machine']}, Python {env['python']}, torch {env['torch']}, ortools "
             f"{env['ortools']}. Each baseline's cuts are priced on the same costs and "
             "schedule; `r`: it fits only with every stage recomputing; `!`: not even then.", "",
             "| model | ranks | autopart ms | " + " | ".join(BASELINES) + " |",
             "|---|---:|---:|" + "---:|" * len(BASELINES)]
    for model, ranks, us, base in rows:
        cells = []
        for name in BASELINES:
            if name not in base:
                cells.append("—")
                continue
            ratio, recompute, fits = base[name]
            cells.append(f"{ratio:.2f}x" + (" r" if recompute else "") + ("" if fits else " !"))
        lines.append(f"| {model} | {ranks} | {us / 1e3:.2f} | " + " | ".join(cells) + " |")
    fig = figures / "plan_quality.png"

    def draw(ax: Any) -> None:
        width = 0.8 / len(BASELINES)
        for k, name in enumerate(BASELINES):
            xs = [i + k * width for i, row in enumerate(rows) if name in row[3]]
            ys = [row[3][name][0] for row in rows if name in row[3]]
            ax.bar(xs, ys, width, label=name)
        ax.axhline(1.0, color="k", linewidth=0.8, label="autopart")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))],
                      [f"{model}\n{ranks} ranks" for model, ranks, _, _ in rows],
                      fontsize=7)
        ax.set_ylabel("predicted step / autopart's")
        ax.set_title("plan_quality: baselines on the same costs (higher = slower)")
        ax.set_ylim(0, 1.3 * max(row[3][n][0] for row in rows for n in row[3]))
        ax.legend(fontsize=7, loc="upper center", ncol=5)

    _figure(fig, draw, (9.0, 4.5))
    lines += ["", f"![plan_quality]({fig.relative_to(figures.parent).as_posix()})", ""]
    mvs = d.get("memory_vs_speed")
    if mvs:
        speed, memory = mvs["speed"], mvs["memory"]
        lines += [f"`optimize=\"memory\"` on the same model and {speed['ranks']} ranks: largest "
                  f"rank peak {speed['max_peak_memory_bytes'] / 2**30:.2f} → "
                  f"{memory['max_peak_memory_bytes'] / 2**30:.2f} GiB "
                  f"({mvs['peak_reduction']:+.1%}) for "
                  f"{memory['predicted_step_time_us'] / speed['predicted_step_time_us']:.2f}x "
                  "the step time.", ""]
    return lines


def solver_scale(results: Path) -> list[str]:
    """Markdown lines for ``solver_scale``."""
    d = _load(results / "solver_scale" / "results.json")
    if d is None:
        return ["## solver_scale", "", "No recorded results.", ""]
    env = d["environment"]
    lines = ["## solver_scale: a 175B-parameter plan on 64 ranks", "",
             f"{d['model']}: {d['nodes']} nodes, {d['candidates']} cut candidates, "
             f"{d['ranks']} x {d['device_preset']}; {env['machine']}, {env['cpus']} CPUs, ortools "
             f"{env['ortools']}; peak RSS {d['peak_rss_gib']:.2f} GiB; identical plan JSON over "
             f"runs: {d['identical_plan_json']}.", "",
             "| run | wall s | status | gap | schedule | m | recompute stages | predicted s | "
             "best baseline / autopart |", "|---:|---:|---|---:|---|---:|---:|---:|---:|"]
    for i, r in enumerate(d["runs"]):
        fitting = [b["predicted_step_time_us"] for b in r["baselines"] if b.get("fits", True)]
        best = f"{min(fitting) / r['predicted_step_time_us']:.2f}x" if fitting else "none fits"
        lines.append(f"| {i} | {r['wall_s']:.1f} | {r['status']} | {r['gap']:.1%} | "
                     f"{r['schedule_kind']} | {r['num_microbatches']} | {r['recompute_stages']} | "
                     f"{r['predicted_step_time_us'] / 1e6:.1f} | {best} |")
    return lines + [""]


def layout_scale(results: Path) -> list[str]:
    """Markdown lines for ``layout_scale``: each plan's wall time, twice, and its layout."""
    d = _load(results / "layout_scale" / "results.json")
    if d is None:
        return ["## layout_scale", "", "No recorded results.", ""]
    rows = d["rows"]
    worst = max(w for r in rows for w in r["plan_s"])
    lines = ["## layout_scale: `autopart plan` at 1024-8192 H100s", "",
             f"{d['machine']}. Slowest plan {worst:.1f} s (target: under 60 s); identical plan "
             f"JSON twice on every row: {all(r['same_json'] for r in rows)}.", "",
             "| shape | GPUs | plan s (2 runs) | tp | pp | dp | ZeRO | schedule | m | "
             "predicted step s |", "|---|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['gpus']} | {r['plan_s'][0]} / {r['plan_s'][1]} | "
                     f"{r['tp']} | {r['pp']} | {r['dp']} | {r['zero_stage']} | "
                     f"{r['schedule_kind']} | {r['num_microbatches']} | {r['step_s']:.3f} |")
    return lines + [""]


def fidelity(results: Path, figures: Path) -> list[str]:
    """Markdown lines for ``fidelity``: predicted against measured, per plan, and the
    timeline figure the benchmark drew."""
    d = _load(results / "fidelity" / "results.json")
    if d is None:
        return ["## fidelity", "", "No recorded results.", ""]
    s = d["summary"]
    lines = ["## fidelity: predicted vs measured step time and peak memory", "",
             f"{d['machine']}; Python {d['python']}, torch {d['torch']}; {d['ranks']} gloo "
             f"ranks x {d['threads_per_rank']} thread; median of {d['steps']} steps, plans "
             f"alternated; recorded {d['date']}.", "",
             f"{s['plans']} plans: median |step error| {s['median_abs_step_error']:.1%}, worst "
             f"{s['max_abs_step_error']:.1%}; per-rank peaks under-predicted: "
             f"{s['under_predicted_peaks']}; most over-predicted peak {s['max_peak_over']:+.1%}.",
             ""]
    drifted = "median_abs_speed_adjusted_step_error" in s
    if drifted:
        lines += ["The machine's speed while each plan ran, over its speed at the profile "
                  "(a probe around each group; above 1: slower), is the `machine` column; "
                  "predictions scaled by it come out at a median |error| of "
                  f"{s['median_abs_speed_adjusted_step_error']:.1%}, worst "
                  f"{s['max_abs_speed_adjusted_step_error']:.1%}.", ""]
    lines += [f"- {value}" for key, value in s.items() if key.endswith("_solver_vs_fastest")]
    lines += ["", "| workload | plan | predicted s | measured s | error |"
              + (" machine |" if drifted else "") + " peak MiB pred / meas |",
              "|---|---|---:|---:|---:|" + ("---:|" if drifted else "") + "---|"]
    for r in d["rows"]:
        peaks = ", ".join(f"{a / 2**20:.0f} / {b / 2**20:.0f}" for a, b in
                          zip(r["predicted_peak_bytes"], r["measured_peak_bytes"], strict=True))
        lines.append(f"| {r['workload']} | {', '.join(r['labels'])} | "
                     f"{r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | "
                     f"{r['step_error']:+.1%} |"
                     + (f" {r['machine_vs_profile']:.3f} |" if drifted else "") + f" {peaks} |")
    png = results / "fidelity" / "timeline.png"
    if png.exists():
        shutil.copyfile(png, figures / "fidelity_timeline.png")
        lines += ["", "![predicted and measured timelines](figures/fidelity_timeline.png)"]
    return lines + [""]


def fidelity_3d(results: Path) -> list[str]:
    """Markdown lines for ``fidelity_3d``: 3D plans on gloo CPU ranks, predicted against
    measured, per arm."""
    d = _load(results / "fidelity_3d" / "results.json")
    if d is None:
        return ["## fidelity_3d", "", "No recorded results.", ""]
    m = d["meta"]
    loads = m["load_average_1min"]
    lines = ["## fidelity_3d: 3D plans on gloo CPU ranks, predicted vs measured step", "",
             f"{m['machine']}; torch {m['torch']}; {m['threads_per_rank']} thread per rank; "
             f"{m['repeats']} runs x {m['steps']} timed steps per arm, arms alternated; "
             f"1-minute load average {min(loads):.1f}-{max(loads):.1f}; recorded {m['date']}. "
             "The 4-rank arms share the 2 cores; the prediction is the median of the "
             "repeats' (each priced just before its run).", "",
             "| ranks | arm | tp x pp x dp | m | predicted s | measured s | error | "
             "repeats' errors |", "|---:|---|---|---:|---:|---:|---:|---|"]
    for r in d["rows"]:
        errors = ", ".join(f"{e:+.0%}" for e in r["repeat_errors"])
        lines.append(f"| {r['world']} | {r['arm']} | {r['tp']} x {r['pp']} x {r['dp']} | "
                     f"{r['m']} | {r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | "
                     f"{r['error']:+.1%} | {errors} |")
    return lines + [""]


def overlap_cpu(results: Path) -> list[str]:
    """Markdown lines for ``overlap_cpu``: ZeRO-0's overlapped gradient all-reduce against the
    flushed one, and ZeRO-1/3 with one FSDP unit per layer against one per stage, on gloo CPU
    ranks, predicted and measured, and the dp communication exposed per rank."""
    d = _load(results / "overlap_cpu" / "results.json")
    if d is None:
        return ["## overlap_cpu", "", "No recorded results.", ""]
    m = d["meta"]
    loads = m["load_average_1min"]
    lines = ["## overlap_cpu: dp communication overlapped vs serialized (ZeRO-0 overlap vs "
             "flush; ZeRO-1/3 per-layer vs per-stage units)", "",
             f"{m['machine']}; torch {m['torch']}; {m['threads_per_rank']} thread per rank; "
             f"{m['parameters'] / 1e6:.2f}M parameters; {m['repeats']} runs x {m['steps']} "
             "timed steps per arm, arms alternated; 1-minute load average "
             f"{min(loads):.1f}-{max(loads):.1f}; recorded {m['date']}. CPU ranks price the "
             "overlap as the flush (gloo reduces on the rank's own core).", "",
             "| ranks | arm | predicted s | measured s | error | dp exposed per rank, "
             "predicted ms | traced reduce ms |", "|---:|---|---:|---:|---:|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['world']} | {r['arm']} | {r['predicted_step_s']:.3f} | "
                     f"{r['measured_step_s']:.3f} | {r['error']:+.1%} | "
                     + " / ".join(f"{x:.1f}" for x in r["predicted_exposed_ms"]) + " | "
                     + " / ".join(f"{x:.1f}" for x in r["traced_reduce_median_ms"]) + " |")
    return lines + [""]


def fsdp_table(results: Path) -> list[str]:
    """Markdown lines for ``fsdp_table``: ZeRO-3 per layer priced overlapped, serialized and
    with fp32 reduce-scatters against torchtitan's published FSDP2 steps on 64 A100s."""
    d = _load(results / "fsdp_table" / "results.json")
    if d is None:
        return ["## fsdp_table", "", "No recorded results.", ""]
    env = d["environment"]
    lines = ["## fsdp_table: ZeRO-3 per layer against torchtitan's published FSDP2 runs", "",
             f"{env['machine']}, {env['cpus']} CPUs; torch {env['torch']}, ortools "
             f"{env['ortools']}; analytical a100-80gb profiles, dgx-a100 hosts, tp 1 pp 1 dp 64 "
             f"ZeRO-3, one microbatch; recorded {env['date']}. Published: torchtitan "
             "docs/performance.md (64 A100 80GB).", "",
             "| model | local batch | checkpointing | published s | overlapped s | serialized s "
             "| fp32 reduce-scatter s |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in d["rows"]:
        cells = [f"{r[a]['step_s']:.3f} ({r[a]['error_vs_published']:+.1%})"
                 if "step_s" in r[a] else "refused"
                 for a in ("overlapped", "serialized", "fp32_reduce")]
        lines.append(f"| {r['model']} | {r['local_batch']} | {r['checkpointing']} | "
                     f"{r['published_step_s']:.3f} | " + " | ".join(cells) + " |")
    return lines + [""]


def selective_recompute(results: Path) -> list[str]:
    """Markdown lines for ``selective_recompute``: no, whole-stage and selective recompute on
    the same cut, and the solver's plans under a cap that forces recompute, predicted and
    measured, per recorded model."""
    lines = ["## selective_recompute: selective against whole-stage recompute (pp 2, gloo "
             "CPU ranks)", ""]
    found = False
    for name in ("results.json", "results_small.json"):
        d = _load(results / "selective_recompute" / name)
        if d is None:
            continue
        found = True
        m = d["meta"]
        cfg = m["config"]
        lines += [f"### {cfg['n_layer']} layers, n_embd {cfg['n_embd']}, vocab "
                  f"{cfg['vocab_size']}, batch {cfg['batch']} x {cfg['seq']} (`{name}`)", "",
                  f"{m['machine']}; Python {m['python']}, torch {m['torch']}; m {m['m']}, "
                  f"{m['schedule']}; medians of {m['steps']} alternated steps; cap "
                  f"{m['cap_mib']:.1f} MiB for the solver's arms; recorded {m['date']}.", "",
                  "| arm | recompute per stage | predicted / measured peak | predicted s | "
                  "measured s | error |", "|---|---|---|---:|---:|---:|"]
        for r in d["rows"]:
            ratios = ", ".join(f"{p / q:.2f}" for p, q in zip(
                r["predicted_peak_mib"], r["measured_peak_mib"], strict=True))
            err = r["predicted_step_s"] / r["measured_step_s"] - 1
            lines.append(f"| {r['arm']} | {', '.join(r['recompute'])} | {ratios} | "
                         f"{r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | "
                         f"{err:+.1%} |")
        lines.append("")
    if not found:
        lines += ["No recorded results.", ""]
    return lines


def early_receives(results: Path) -> list[str]:
    """Markdown lines for ``early_receives``: gloo ranks' receives posted first against
    torch's placement, alternated on the same pipelines."""
    d = _load(results / "early_receives" / "results.json")
    if d is None:
        return ["## early_receives", "", "No recorded results.", ""]
    m = d["meta"]
    lines = ["## early_receives: receives posted when the step starts, against torch's "
             "placement", "",
             f"{m['machine']}; Python {m['python']}, torch {m['torch']}; {m['repeats']} runs "
             f"x {m['steps']} timed steps per arm and order, alternated; recorded "
             f"{m['date']}.", "",
             "| ranks | arm | torch's order s | receives first s | ratio | same losses |",
             "|---:|---|---:|---:|---:|---|"]
    for r in d["rows"]:
        med = r["median_s"]
        lines.append(f"| {r['ranks']} | {r['arm']} | {med['torch']:.4f} | "
                     f"{med['receives_first']:.4f} | {r['ratio']:.3f} | {r['same_losses']} |")
    return lines + [""]


def gpu(results: Path, figures: Path) -> list[str]:
    """Markdown lines for ``gpu`` (``run_all.sh``'s recorded run) and the executor overhead on
    that GPU: predicted against measured for stages sharing one GPU."""
    d = _load(results / "gpu" / "results" / "fidelity_gpu.json")
    if d is None:
        return ["## gpu", "", "No recorded results.", ""]
    lines = ["## gpu: one GPU, 4 stages on its streams (`benchmarks/gpu/run_all.sh`)", "",
             f"{d['device']}; Python {d['python']}, torch {d['torch']} (CUDA {d['cuda']}). "
             "Peaks: the plan's ranks summed against the pipeline's tensors plus the step's "
             "growth. The plan treats the 4 ranks as 4 GPUs; the run is one host thread "
             "issuing all 4 stages (see benchmarks/gpu/README.md).", "",
             "| plan | predicted s | measured s | error | peak GiB pred / meas |",
             "|---|---:|---:|---:|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['plan']} | {r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f}"
                     f" | {r['step_error']:+.1%} | "
                     f"{r['predicted_peak_bytes_device'] / 2**30:.2f} / "
                     f"{r['measured_peak_bytes_device'] / 2**30:.2f} |")
    over = _load(results / "executor_overhead" / "results_h100.json")
    if over is not None:
        lines += ["", f"Executor overhead on the {over['device_name']} (batch {over['batch']} x "
                  f"{over['seq']}, m = {over['microbatches']}, {over['stages']} stages on one "
                  "device, against the plain model with the same microbatching):", "",
                  "| schedule | pipeline s | plain s | overhead (paired) |", "|---|---:|---:|---:|"]
        for kind, r in over["schedules"].items():
            lines.append(f"| {kind} | {r['pipeline_step_s']:.3f} | {r['plain_step_s']:.3f} | "
                         f"{r['overhead_paired']:+.1%} |")
    png = results / "gpu" / "results" / "timeline_gpu.png"
    if png.exists():
        shutil.copyfile(png, figures / "gpu_timeline.png")
        lines += ["", "![predicted and measured timelines on one GPU](figures/gpu_timeline.png)"]
    return lines + [""]


def zoo(results: Path) -> list[str]:
    """Markdown lines for ``zoo``: transformers architectures through autopart, per family."""
    d = _load(results / "zoo" / "results.json")
    if d is None:
        return ["## zoo", "", "No recorded results.", ""]
    cols = ("tried", "eager_ok", "export_ok", "compile_ok", "match_ok", "four_stages")
    lines = ["## zoo: transformers architectures, tiny and random, split and checked", "",
             f"{d['machine']}; Python {d['python']}, torch {d['torch']}, transformers "
             f"{d['transformers']}; batch {d['batch']}, m = {d['microbatches']}; loss, gradients "
             f"and buffers within {d['tolerance']:g} (relative) of the model run by hand on the "
             f"same microbatches. {len(d.get('not_run', []))} model types not run (time budget).",
             "", "| family | " + " | ".join(cols) + " |", "|---" + "|---:" * len(cols) + "|"]
    per = dict(d["summary"]["per_family"], total=d["summary"]["total"])
    for family, c in per.items():
        lines.append(f"| {family} | " + " | ".join(str(c.get(k, 0)) for k in cols) + " |")
    return lines + [""]


def write_report(results: Path, out: Path) -> Path:
    """Write the report (and its figures, in ``<out dir>/figures/``); returns ``out``.

    The Markdown is written atomically (``autopart.core.jsonio.write_text_atomic``), after every
    results file has been read, so a failed run leaves the previous report whole.

    Raises:
        ValueError: a results file exists but is not JSON.
    """
    figures = out.parent / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    lines = ["# autopart benchmark report", "",
             "Generated by `benchmarks/report.py` from the recorded `results*.json` of each "
             "benchmark; every number below was measured or solved by that benchmark's "
             "`run.py` (see its README for the command, machine and versions).", ""]
    lines += pipeline_cpu(results, figures)
    lines += peers_measured(results, figures)
    lines += executor_overhead(results)
    lines += plan_quality(results, figures)
    lines += solver_scale(results)
    lines += layout_scale(results)
    lines += fidelity(results, figures)
    lines += fidelity_3d(results)
    lines += overlap_cpu(results)
    lines += fsdp_table(results)
    lines += selective_recompute(results)
    lines += early_receives(results)
    lines += gpu(results, figures)
    lines += zoo(results)
    from autopart.core.jsonio import write_text_atomic

    write_text_atomic(out, "\n".join(lines))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE,
                        help="folder holding the benchmark folders (default: benchmarks/)")
    parser.add_argument("--out", type=Path, default=HERE / "REPORT.md")
    args = parser.parse_args()
    print(f"wrote {write_report(args.results, args.out)}")


if __name__ == "__main__":
    main()
