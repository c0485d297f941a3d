"""The figures: Gantt timelines of traces with per-rank peak memory, and per-stage bars.

Drawing needs matplotlib (the ``plot`` extra); it is imported when a figure is drawn, so the
rest of autopart runs without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopart.core.errors import UsageError
from autopart.core.trace import EXPOSED_KINDS, Trace

__all__ = ["gantt", "stage_bars"]

# one colour per action kind (forward, backward, input grad, weight grad) and comm word
_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#8172B3", "loss": "#55A868",
            "send": "#937860", "recv": "#937860", "reduce": "#DA8BC3", "wait": "#DDDDDD"}



def gantt(path: str | os.PathLike[str], traces: Sequence[tuple[str, Trace]], *,
          peaks: Sequence[tuple[str, Sequence[int]]] = (), title: str = "") -> Path:
    """Draw ``traces`` as Gantt charts, one panel each (one row per rank, one bar per slice of
    its compute lane, coloured by action kind; the collectives' lane and the nested
    ``exposed`` slices are left to the Perfetto file; a shared time axis in ms), and, when
    ``peaks`` is given, a bar chart of per-rank peak memory (GiB) per label. Writes a PNG atomically.

    Args:
        path: the PNG to write.
        traces: ``(label, trace)`` pairs, e.g. ``[("predicted", p), ("measured", m)]``.
        peaks: ``(label, bytes per rank)`` pairs, e.g. predicted and measured peaks.
        title: the figure's title.

    Raises:
        UsageError: matplotlib is not installed (``pip install matplotlib``), or no traces.
    """
    if not traces:
        raise UsageError("gantt needs at least one (label, trace) pair")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise UsageError("drawing timelines needs matplotlib: pip install matplotlib") from exc
    panels = len(traces) + (1 if peaks else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(12, 1.2 + 1.6 * panels), squeeze=False)
    end_ms = max(max((e.end_us for e in t.events), default=0.0) for _, t in traces) / 1e3
    for ax, (label, trace) in zip(axes[:, 0], traces, strict=False):
        ranks = max(trace.num_ranks, 1)
        for e in trace.lane("compute").events:  # the actions (collectives: see Perfetto)
            if e.kind in EXPOSED_KINDS:
                continue
            act = e.action
            kind = act[1] if act is not None else e.name.split(" ", 1)[0]
            ax.broken_barh([(e.start_us / 1e3, max(e.duration_us / 1e3, 1e-3))],
                           (e.rank - 0.4, 0.8), facecolors=_COLOURS.get(kind, "#999999"),
                           edgecolor="white" if kind != "wait" else "none", linewidth=0.3)
            if act is not None and e.duration_us / 1e3 > end_ms / 80:
                ax.text((e.start_us + e.end_us) / 2e3, e.rank, e.name, ha="center",
                        va="center", fontsize=6, color="white")
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.set_ylim(ranks - 0.5, -0.5)
        ax.set_xlim(0, end_ms * 1.02)
        ax.set_title(f"{label}: step {trace.step_time_us / 1e3:.1f} ms", fontsize=9, loc="left")
    axes[len(traces) - 1, 0].set_xlabel("time from step start (ms)")
    handles = [Patch(color=c, label=k) for k, c in _COLOURS.items()]
    axes[0, 0].legend(handles=handles, ncol=len(handles), fontsize=6, loc="lower right",
                      bbox_to_anchor=(1.0, 1.0), frameon=False)
    if peaks:
        ax = axes[-1, 0]
        width = 0.8 / len(peaks)
        for k, (label, values) in enumerate(peaks):
            xs = [r + (k - (len(peaks) - 1) / 2) * width for r in range(len(values))]
            ax.bar(xs, [v / 2**30 for v in values], width=width, label=label)
        ranks = max(len(v) for _, v in peaks)
        ax.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.set_ylabel("peak memory (GiB)")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, dpi=130, format="png")
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def stage_bars(path: Path, plan: Any, predicted: Any, measured: Any, plans: dict[str, Any],
                results: dict[str, Any]) -> None:
    """Two bar charts in one PNG at ``path``: per-stage busy time per step (ms), predicted vs
    measured, for ``plan``; and per-rank peak memory (MiB), predicted vs measured, for every
    plan of ``plans`` (its measurements in ``results[name].peak_bytes``).

    Args:
        path: the PNG to write (not atomically).
        plan: the plan whose stages are drawn; ``predicted``: its prediction
            (``.trace``); ``measured``: its measured :class:`~autopart.core.trace.Trace`.
        plans: arm name -> plan; ``results``: arm name -> ``ArmResult``.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (the CLI names the ``plot`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
    pred, meas = predicted.trace.stage_busy_us(), measured.stage_busy_us()
    stages = sorted(set(pred) | set(meas))
    a.bar([s - 0.2 for s in stages], [pred.get(s, 0) / 1e3 for s in stages], 0.4,
          label="predicted")
    a.bar([s + 0.2 for s in stages], [meas.get(s, 0) / 1e3 for s in stages], 0.4, label="measured")
    a.set_xlabel("stage")
    a.set_ylabel("busy ms per step")
    a.set_xticks(stages)
    a.legend(fontsize=7)
    width = 0.8 / (2 * len(plans))
    k = 0
    for name, pl in plans.items():
        ranks = range(len(pl.ranks))
        for label, values in ((f"{name} pred", [r.peak_memory_bytes for r in pl.ranks]),
                              (f"{name} meas", results[name].peak_bytes)):
            b.bar([r + (k - len(plans) + 0.5) * width for r in ranks],
                  [v / 2**20 for v in values], width, label=label)
            k += 1
    b.set_xlabel("rank")
    b.set_ylabel("peak MiB")
    b.set_xticks(list(range(len(plan.ranks))))
    b.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
