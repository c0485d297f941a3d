"""Schedule simulator: replays per-rank action lists with stage costs, P2P sends and memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopart.core.errors import PlanError
from autopart.core.schedule import Schedule
from autopart.core.v_schedules import dualpipev_pairs
from autopart.solver.simulate_memory import rank_peaks
from autopart.solver.stage_costs import StageCosts

__all__ = ["StageCosts", "SimResult", "simulate", "simulate_1f1b", "rank_peaks", "host_bound_us",
           "core_bound_us"]


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one replay of a schedule gives.

    Attributes:
        step_time_us: when the last action ends, µs (all ranks start at 0).
        bubble_fraction: ``1 - mean(busy) / step_time``, the idle share of a rank's step.
        busy_us: per rank, time spent computing and sending, µs.
        peak_memory_bytes: per rank, the largest memory held at any point of its action order.
        timeline: with ``simulate(..., record=True)``, every action as ``(rank, stage_index,
            kind, mb_index, start_us, end_us)`` in the order the replay placed them (its end
            includes the action's send); empty otherwise.
        host_bound_us: the busiest issuing thread's host time, µs (:func:`host_bound_us`;
            0.0 without host times); ``step_time_us`` is never below it.
        core_bound_us: the ranks' busy time over the cores they share, µs
            (:func:`core_bound_us`; 0.0 when every rank has a core); ``step_time_us`` is
            never below it.
    """

    step_time_us: float
    bubble_fraction: float
    busy_us: tuple[float, ...]
    peak_memory_bytes: tuple[int, ...]
    timeline: tuple[tuple[int, int, str, int, float, float], ...] = ()
    host_bound_us: float = 0.0
    core_bound_us: float = 0.0


_Act = tuple[int, str, int]
_RankPlan = list[tuple[tuple[int, ...], float]]
_Timeline = list[tuple[int, int, str, int, float, float]]


def simulate(schedule: Schedule, costs: StageCosts, *, record: bool = False) -> SimResult:
    """Replay ``schedule`` (one action list per rank, e.g. from
    :func:`autopart.core.schedule.build_schedule`) and time it.

    Each rank runs its actions in order, one at a time; an action starts when the rank is free
    and its inputs have arrived. Sends are blocking (the sender is busy for the transfer, the
    receiver may start when it ends): ``F`` of stage s lasts ``fwd + send_fwd`` and is ready
    once ``F`` of s - 1 ended; ``B`` lasts ``I + W + send_bwd``, ``I`` lasts
    ``I + send_bwd``, both ready once the stage's own ``F`` and the ``B``/``I`` of s + 1 ended;
    ``W`` lasts ``W`` and follows its own ``I``. Memory of a rank follows its own order: its
    stages' ``static_bytes``, plus ``saved_bytes`` from each ``F`` until the matching ``B``
    (or ``W``) ends, plus ``backward_extra_bytes`` while a ``B``/``I`` runs, plus the
    ``kept_bytes`` of every ``B``/``I`` done. With exchange columns (``costs.
    overlaps_pairs``; DualPipe-V only) each overlapped pair runs at once and lasts
    :meth:`StageCosts.pair_us`, its backward ending with its forward. With host times, the
    step is at least the busiest issuing thread's host time (:func:`host_bound_us`): ranks
    issued by one thread cannot run faster than it issues their actions. With more CPU ranks than cores
    (``costs.ranks_per_core > 1``), the step is at least :func:`core_bound_us`.

    Args:
        schedule: per-rank action lists; the stage count is ``len(costs.fwd_us)``.
        costs: per-stage costs, see :class:`StageCosts`.
        record: also return every action's start and end (``SimResult.timeline``; default
            False: replays of 10^5 actions need not keep them).

    Returns:
        Step time, bubble fraction, per-rank busy time and peak memory.

    Raises:
        PlanError: an action names a stage outside the costs, or the schedule deadlocks.
    """
    num_stages = len(costs.fwd_us)
    # Actions as plain (stage, kind, microbatch) tuples, each numbered once: the replay reads
    # and writes end times by number (a list), which matters for replays of 10^5 actions.
    lists = [[(a.stage_index, a.kind, a.mb_index) for a in acts] for acts in schedule]
    index: dict[_Act, int] = {}
    for acts in lists:
        for a in acts:
            if a[0] >= num_stages:
                raise PlanError(f"action {a[0]}{a[1]}{a[2]} names stage {a[0]}, but the costs "
                                f"cover {num_stages} stages")
            index.setdefault(a, len(index))
    fwd = [costs.fwd_us[s] + costs.send_fwd_us[s] for s in range(num_stages)]
    bwd_w = list(costs.bwd_weight_us)
    bwd_i = [costs.bwd_input_us[s] + costs.send_bwd_us[s] for s in range(num_stages)]
    bwd_b = [bwd_i[s] + bwd_w[s] for s in range(num_stages)]

    # Per rank, each action's number, its present dependencies' numbers and its duration, in
    # the rank's order.
    ids = [[index[a] for a in acts] for acts in lists]
    plans: list[_RankPlan] = []
    get = index.get
    last = num_stages - 1
    for acts in lists:
        plan: _RankPlan = []
        for s, kind, i in acts:
            if kind == "F":
                dep = get((s - 1, "F", i)) if s > 0 else None
                deps: tuple[int, ...] = () if dep is None else (dep,)
                d = fwd[s]
            elif kind == "W":
                dep = get((s, "I", i))
                deps, d = () if dep is None else (dep,), bwd_w[s]
            else:
                own = get((s, "F", i))
                deps = () if own is None else (own,)
                if s < last:
                    nxt = get((s + 1, "B", i))
                    if nxt is None:
                        nxt = get((s + 1, "I", i))
                    if nxt is not None:
                        deps += (nxt,)
                d = bwd_b[s] if kind == "B" else bwd_i[s]
            plan.append((deps, d))
        plans.append(plan)
    if costs.overlaps_pairs:
        _pair_up(lists, ids, plans, costs)

    if costs.ranks_per_core > 1.0:
        free, busy, timeline = _replay_shared(schedule, lists, ids, plans, len(index),
                                              costs.ranks_per_core, record)
    else:
        free, busy, timeline = _replay(schedule, lists, ids, plans, len(index), record)
    step = max(free, default=0.0)
    bound = host_bound_us(schedule, costs)
    step = max(step, bound) if costs.has_host else step
    shared = core_bound_us(busy, costs.ranks_per_core)
    step = max(step, shared)
    bubble = 1.0 - sum(busy) / len(busy) / step if step > 0 else 0.0
    return SimResult(step_time_us=step, bubble_fraction=min(max(bubble, 0.0), 1.0),
                     busy_us=tuple(busy), peak_memory_bytes=rank_peaks(schedule, costs),
                     timeline=tuple(timeline), host_bound_us=bound, core_bound_us=shared)


def _pair_up(lists: list[list[_Act]], ids: list[list[int]], plans: list[_RankPlan],
             costs: StageCosts) -> None:
    """Each DualPipe-V pair (:func:`autopart.core.v_schedules.dualpipev_pairs`) in ``plans``
    as the runtime runs it: the forward starts once both it and the backward may, and lasts
    the pair (:meth:`StageCosts.pair_us`); the backward ends with it (it lasts 0 after it).

    Raises:
        PlanError: a pair that is not a forward followed at once by its backward (the
            exchange columns are for DualPipe-V schedules only).
    """
    p = len(lists)
    m = sum(1 for a in lists[0] if a[1] == "F" and a[0] == 0) if p else 0
    for r, acts in enumerate(lists):
        at = {a: k for k, a in enumerate(acts)}
        for fwd, bwd in dualpipev_pairs(p, m, r):
            k = at.get(fwd)
            if k is None or k + 1 >= len(acts) or acts[k + 1] != bwd:
                raise PlanError(f"rank {r}'s actions do not pair {fwd} with {bwd}: "
                                "StageCosts' exchange columns are for DualPipe-V schedules only")
            deps = tuple(dict.fromkeys((*plans[r][k][0], *plans[r][k + 1][0])))
            plans[r][k] = (deps, costs.pair_us(fwd[0], bwd[0]))
            plans[r][k + 1] = ((ids[r][k],), 0.0)


def _replay(schedule: Schedule, lists: list[list[_Act]], ids: list[list[int]],
            plans: list[_RankPlan], num_actions: int,
            record: bool) -> tuple[list[float], list[float], _Timeline]:
    """Every rank on a core of its own: per rank, when it is done and its busy time, µs
    (``ids``: each action's number, ``plans``: its dependencies' numbers and duration)."""
    end = [-1.0] * num_actions  # end time by action number; < 0: not run yet
    free = [0.0] * len(lists)
    busy = [0.0] * len(lists)
    cursor = [0] * len(lists)
    timeline: list[tuple[int, int, str, int, float, float]] = []
    remaining = num_actions
    while remaining:
        progressed = False
        for r, acts in enumerate(lists):
            plan, mine, c, n = plans[r], ids[r], cursor[r], len(acts)
            f = free[r]
            while c < n:
                deps, d = plan[c]
                t = 0.0
                for dep in deps:
                    e = end[dep]
                    if e < 0.0:
                        break
                    if e > t:
                        t = e
                else:
                    start = t if t > f else f
                    f = start + d
                    end[mine[c]] = f
                    if record:
                        timeline.append((r, *acts[c], start, f))
                    busy[r] += d
                    c += 1
                    continue
                break
            if c != cursor[r]:
                remaining -= c - cursor[r]
                cursor[r], free[r] = c, f
                progressed = True
        if not progressed:
            blocked = [str(acts[c]) for acts, c in zip(schedule, cursor, strict=True)
                       if c < len(acts)]
            raise PlanError(f"schedule deadlocks: every rank waits ({', '.join(blocked)} blocked)")
    return free, busy, timeline


def _replay_shared(schedule: Schedule, lists: list[list[_Act]], ids: list[list[int]],
                   plans: list[_RankPlan], num_actions: int, ranks_per_core: float,
                   record: bool) -> tuple[list[float], list[float], _Timeline]:
    """:func:`_replay` with ranks sharing cores (processor sharing, as Linux's fair scheduler
    shares a core between runnable processes): while ``a`` of the ``p`` pipeline ranks run an
    action, ``a * n / p`` of the host's ``n`` rank processes are runnable on ``n /
    ranks_per_core`` cores, so each action progresses at ``min(1, p / (ranks_per_core *
    a))`` µs of work per µs; a rank waiting on a dependency takes no core. Busy time is the
    work done (the actions' own durations), not the stretched wall time."""
    p = len(lists)
    end = [-1.0] * num_actions  # end time by action number; < 0: not run yet
    cursor = [0] * p
    running: list[list[float] | None] = [None] * p  # [start, work left, duration]
    free = [0.0] * p
    busy = [0.0] * p
    timeline: _Timeline = []
    now = 0.0
    remaining = sum(len(acts) for acts in lists)
    while remaining:
        for r in range(p):  # start every action whose inputs have arrived
            while running[r] is None and cursor[r] < len(lists[r]):
                deps, d = plans[r][cursor[r]]
                if any(end[dep] < 0.0 for dep in deps):
                    break
                if d > 0.0:
                    running[r] = [now, d, d]
                    break
                end[ids[r][cursor[r]]] = now  # nothing to do: done at once
                if record:
                    timeline.append((r, *lists[r][cursor[r]], now, now))
                cursor[r] += 1
                remaining -= 1
                free[r] = now
        active = [r for r in range(p) if running[r] is not None]
        if not active:
            if not remaining:
                break
            blocked = [str(acts[c]) for acts, c in zip(schedule, cursor, strict=True)
                       if c < len(acts)]
            raise PlanError(f"schedule deadlocks: every rank waits ({', '.join(blocked)} blocked)")
        rate = min(1.0, p / (ranks_per_core * len(active)))
        step = min(running[r][1] for r in active) / rate  # type: ignore[index]
        now += step
        for r in active:
            job = running[r]
            assert job is not None
            job[1] -= step * rate
            if job[1] <= 1e-9 * max(job[2], 1.0):
                act = lists[r][cursor[r]]
                end[ids[r][cursor[r]]] = now
                if record:
                    timeline.append((r, *act, job[0], now))
                busy[r] += job[2]
                free[r] = now
                running[r] = None
                cursor[r] += 1
                remaining -= 1
    return free, busy, timeline


def simulate_1f1b(num_ranks: int, num_microbatches: int, costs: StageCosts
                  ) -> tuple[float, tuple[float, ...]]:
    """:func:`simulate`'s step time and per-rank busy time for 1F1B training, one stage per
    rank, without building the action lists: the same replay (each action starts when its
    rank is free and its inputs have arrived, sends blocking) over the order
    :func:`autopart.core.schedule.one_f_one_b_schedule` gives rank s (``w = min(p - 1 - s,
    m)`` forwards, then forward/backward pairs, then the remaining backwards), with each
    action numbered by arithmetic. The layout search replays 1F1B schedules of 10^5-10^6
    actions; building them as ``Action`` objects took longer than the replay. Equal to
    :func:`simulate` on those lists (tested); for costs without host times and with a core
    per rank (``ranks_per_core <= 1``) only, where :func:`simulate` adds no bound.

    Args:
        num_ranks: p (= stages).
        num_microbatches: m.
        costs: per-stage costs (p stages).

    Returns:
        ``(step_time_us, busy_us per rank)``.

    Raises:
        PlanError: the costs are not p stages, have host times, or share cores.
    """
    p, m = num_ranks, num_microbatches
    if len(costs.fwd_us) != p or costs.has_host or costs.ranks_per_core > 1.0:
        raise PlanError(f"simulate_1f1b: {len(costs.fwd_us)} stages for {p} ranks, host times "
                        f"{costs.has_host}, ranks per core {costs.ranks_per_core}; use "
                        "simulate() on the built schedule")
    fwd = [costs.fwd_us[s] + costs.send_fwd_us[s] for s in range(p)]
    bwd = [costs.bwd_input_us[s] + costs.send_bwd_us[s] + costs.bwd_weight_us[s]
           for s in range(p)]
    # end times, < 0: not run yet. F of stage s, microbatch i at (s + 1) * m + i, with a
    # stage -1 whose forwards are done at 0; B of stage s at s * m + i, with a stage p whose
    # backwards are done at 0 (the first stage's inputs and the last's gradients are there)
    f_end = [0.0] * m + [-1.0] * (p * m)
    b_end = [-1.0] * (p * m) + [0.0] * m
    warm = [min(p - 1 - s, m) for s in range(p)]
    cursor = [0] * p
    free = [0.0] * p
    n = 2 * m
    remaining = p * n
    busy = [0.0] * p  # summed in each rank's order, as simulate() sums it
    # Every end time is one max and one sum of the same operands whatever the order ranks
    # are visited in, so sweeps alternate: down the ranks (forwards flow on in one sweep),
    # then up them (backwards flow back); each rank runs its phases' actions in a loop each.
    orders = (range(p), range(p - 1, -1, -1))
    sweep = 0
    while remaining:
        progressed = False
        for s in orders[sweep & 1]:
            c = c0 = cursor[s]
            if c == n:
                continue
            f, w, b = free[s], warm[s], busy[s]
            fs, bs = fwd[s], bwd[s]
            own_f, up_f = (s + 1) * m, s * m        # f_end of stage s, of stage s - 1
            own_b, down_b = s * m, (s + 1) * m      # b_end of stage s, of stage s + 1
            cool = n - w  # warm-up: c < w; pairs (F, B): w <= c < 2m - w; then backwards
            while c < w:  # warm-up: F of microbatch c
                t = f_end[up_f + c]
                if t < 0.0:
                    break
                f = (t if t > f else f) + fs
                f_end[own_f + c] = f
                b += fs
                c += 1
            while w <= c < cool:  # F of microbatch w + k (k even), B of k (k odd)
                k = c - w
                if k & 1:
                    i = k >> 1
                    t = b_end[down_b + i]
                    if t < 0.0:
                        break
                    own = f_end[own_f + i]  # earlier on this rank: always done
                    if own > t:
                        t = own
                    f = (t if t > f else f) + bs
                    b_end[own_b + i] = f
                    b += bs
                else:
                    i = own_f + w + (k >> 1)
                    t = f_end[i - m]
                    if t < 0.0:
                        break
                    f = (t if t > f else f) + fs
                    f_end[i] = f
                    b += fs
                c += 1
            while cool <= c < n:  # cool-down: B of microbatch c - m
                i = c - m
                t = b_end[down_b + i]
                if t < 0.0:
                    break
                own = f_end[own_f + i]
                if own > t:
                    t = own
                f = (t if t > f else f) + bs
                b_end[own_b + i] = f
                b += bs
                c += 1
            if c != c0:
                remaining -= c - c0
                cursor[s], free[s], busy[s] = c, f, b
                progressed = True
        sweep += 1
        if not progressed:  # cannot happen for 1F1B; kept as simulate's guard
            raise PlanError("schedule deadlocks: every rank waits (1F1B replay)")
    return max(free, default=0.0), tuple(busy)


def core_bound_us(busy_us: Sequence[float], ranks_per_core: float) -> float:
    """The shortest step CPU ranks sharing cores allow, µs: the pipeline ranks' mean busy
    time times ``ranks_per_core``; 0.0 when ``ranks_per_core <= 1`` (a core each: no bound
    beyond the schedule's).

    ``n`` rank processes on ``c`` cores (``ranks_per_core = n / c``) each run one pipeline
    rank's actions (a dp replica or a tp shard runs a copy of the same busy time), so the
    host has ``n * mean(busy)`` of work and ``c`` cores to do it on:
    ``step >= n * mean(busy) / c``. A rank waiting in the schedule's bubble leaves its core
    to the others (gloo blocks, it does not spin), so the bound is on the total, not on each
    rank's time stretched by ``n / c``.

    Args:
        busy_us: per pipeline rank, compute and send time of one step, µs.
        ranks_per_core: rank processes per core (``RuntimeDescription.ranks_per_core``).

    Example: 4 ranks on 2 cores, two pipeline ranks busy 30 and 20 ms: ``2 x 25 = 50`` ms.
    """
    if ranks_per_core <= 1.0 or not busy_us:
        return 0.0
    return ranks_per_core * sum(busy_us) / len(busy_us)


def host_bound_us(schedule: Schedule, costs: StageCosts) -> float:
    """The most host time any one issuing thread spends on ``schedule``'s actions, µs: per
    thread (``costs.issue_thread``, default each rank's own), the sum of its actions' host
    issue times (``F``: ``host_fwd``; ``B``: ``host_bwd_input + host_bwd_weight``; ``I``,
    ``W``: their own). One thread issues its actions one after another, so no step is
    shorter. 0.0 without host times."""
    if not costs.has_host:
        return 0.0
    hf, hi, hw = costs.host_fwd_us, costs.host_bwd_input_us, costs.host_bwd_weight_us
    per_thread: dict[int, float] = {}
    for r, acts in enumerate(schedule):
        for a in acts:
            s = a.stage_index
            t = costs.issue_thread[s] if costs.issue_thread else r
            per_thread[t] = per_thread.get(t, 0.0) + (
                hf[s] if a.kind == "F" else hi[s] + hw[s] if a.kind == "B"
                else hi[s] if a.kind == "I" else hw[s])
    return max(per_thread.values(), default=0.0)
