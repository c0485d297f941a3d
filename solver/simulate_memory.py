"""Memory on a replayed schedule: each rank's peak (saved activations in flight plus the
working set) and the peak of ranks that share one device, on the replayed times."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from autopart.core.errors import PlanError
from autopart.core.schedule import Action, Schedule
from autopart.solver.stage_costs import StageCosts

__all__ = ["rank_peaks", "device_peaks"]


def rank_peaks(schedule: Schedule, costs: StageCosts) -> tuple[int, ...]:
    """Per rank, the largest memory along its own action order, bytes (see :func:`simulate`;
    no times are replayed)."""
    peaks = []
    for acts in schedule:
        static, levels = _memory_walk(acts, costs)
        peaks.append(max([static, *(peak for peak, _ in levels)]))
    return tuple(peaks)


def _memory_walk(acts: Sequence[Action], costs: StageCosts,
                 ) -> tuple[int, list[tuple[int, int]]]:
    """One rank's memory along its action order: ``(static bytes, [(most held during the
    action, held after it)] per action)``."""
    stages = sorted({a.stage_index for a in acts})
    static = live = sum(costs.static_bytes[s] for s in stages)
    split = {a.stage_index for a in acts if a.kind == "W"}
    levels = []
    for a in acts:
        s = a.stage_index
        if a.kind == "F":
            live += costs.saved_bytes[s]
            peak = live
        elif a.kind in "BI":
            # what it sends stays until the step ends; the sent output is held already
            peak = (live + costs.kept_bytes[s] - costs.kept_held_bytes[s]
                    + costs.backward_extra_bytes[s])
            live += costs.kept_bytes[s]
            if a.kind == "B" or s not in split:
                live -= costs.saved_bytes[s]
            else:  # I keeps the gradients its W restarts from
                live += costs.split_held_bytes[s]
                peak = max(peak, live)
        else:  # W returns the weight gradients, then releases what the split kept
            peak = live + costs.weight_grad_bytes[s]
            live -= costs.saved_bytes[s] + costs.split_held_bytes[s]
        levels.append((peak, live))
    return static, levels


def device_peaks(schedule: Schedule, costs: StageCosts,
                 timeline: Sequence[tuple[int, int, str, int, float, float]],
                 groups: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Per group of ranks that share one device, the most memory the group holds at once,
    bytes, on the replayed times.

    Each rank holds what :func:`rank_peaks` walks: its static bytes, then after each action
    what that action left. While an action runs (from its start up to, not including, its
    end; at its instant where it takes no time) its rank holds the larger of what it held
    before and after it, and the action's working set (its peak less that) comes on top.
    The ranks of one device run one action at a time in effect (one H200's traced step of
    four stages on one GPU, ``benchmarks/gpu/README.md``, showed their work one after
    another, and the one-process runtime issues them from one thread), so the group's level
    at a time is the sum of what its ranks hold plus the largest working set among their
    running actions, not all of them; its peak is the largest level at any action's start or
    end. It lies between the largest rank peak and the sum of the ranks' peaks, which is
    what the group would need if every rank peaked at once: on that H200 the four stages
    peaked 12-45 % below that sum.

    Args:
        schedule: per-rank action lists, as simulated.
        costs: the stage costs they were simulated with.
        timeline: :attr:`SimResult.timeline` of ``simulate(schedule, costs, record=True)``.
        groups: lists of rank indices, e.g. the ranks on each device.

    Raises:
        PlanError: a rank of a group has no action list, or the timeline lacks an action.
    """
    when: dict[tuple[int, int, str, int], tuple[float, float]] = {
        (r, s, k, i): (start, end) for r, s, k, i, start, end in timeline}
    spans: dict[int, tuple[int, list[tuple[float, float, int, int]]]] = {}
    for r in sorted({r for g in groups for r in g}):
        if not 0 <= r < len(schedule):
            raise PlanError(f"rank {r} of a device group is not among the schedule's "
                            f"{len(schedule)} ranks")
        static, levels = _memory_walk(schedule[r], costs)
        rows = []
        before = static
        for a, (peak, after) in zip(schedule[r], levels, strict=True):
            key = (r, a.stage_index, a.kind, a.mb_index)
            if key not in when:
                raise PlanError(f"the timeline has no {a.stage_index}{a.kind}{a.mb_index} on "
                                f"rank {r}: replay with simulate(..., record=True)")
            base = max(before, after)  # what the action's rank holds beside its working set
            rows.append((*when[key], base, peak - base, after))
            before = after
        spans[r] = (static, rows)

    starts = {r: [row[0] for row in rows] for r, (_, rows) in spans.items()}

    def level(r: int, t: float) -> tuple[int, int]:
        """Rank ``r`` at ``t``: (what it holds, the working set of its running action)."""
        static, rows = spans[r]
        j = bisect.bisect_right(starts[r], t) - 1  # the last action started by t
        if j < 0:
            return static, 0
        running = [rows[k] for k in range(bisect.bisect_left(starts[r], t), j + 1)
                   if t < rows[k][1] or rows[k][0] == rows[k][1] == t]
        if t < rows[j][1] and rows[j] not in running:
            running.append(rows[j])
        if running:
            return max(row[2] for row in running), max(row[3] for row in running)
        return rows[j][4], 0

    out = []
    for group in groups:
        times = sorted({t for r in group for start, end, *_ in spans[r][1]
                        for t in (start, end)}) or [0.0]
        peak = 0
        for t in times:
            held = [level(r, t) for r in group]
            peak = max(peak, sum(h for h, _ in held) + max(w for _, w in held))
        out.append(peak)
    return tuple(out)
