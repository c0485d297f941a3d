"""Schedules as data: actions like ``2F0``, per-rank action lists, generation, placement, validation."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from autopart.core.errors import PlanError
from autopart.core.v_schedules import (
    V_SCHEDULE_KINDS,
    dualpipev_rank_actions,
    v_stage_ranks,
    zbv_rank_actions,
)

__all__ = ["Action", "Schedule", "gpipe_schedule", "one_f_one_b_schedule",
           "interleaved_1f1b_schedule", "zero_bubble_schedule", "zbv_schedule",
           "dualpipev_schedule", "splits_backward", "build_schedule", "stage_ranks",
           "check_microbatches", "forward_schedule", "validate_schedule", "execution_order",
           "in_flight_counts",
           "to_csv", "from_csv", "format_timeline"]

_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One unit of a schedule: ``stage_index`` runs ``kind`` on microbatch ``mb_index``.

    Kinds: ``F`` forward, ``B`` full backward, ``I`` input-gradient only, ``W`` weight-gradient
    only. Text form follows torch.distributed.pipelining: ``"2F0"`` = stage 2 forward of
    microbatch 0.
    """

    stage_index: int
    kind: str
    mb_index: int

    def __post_init__(self) -> None:
        if self.kind not in "FBIW" or len(self.kind) != 1:
            raise PlanError(f"action kind {self.kind!r} is not one of F, B, I, W")
        if self.stage_index < 0 or self.mb_index < 0:
            raise PlanError(f"action {self.stage_index}{self.kind}{self.mb_index}: indices must be >= 0")

    def __str__(self) -> str:
        return f"{self.stage_index}{self.kind}{self.mb_index}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"2F0"``-style text.

        Raises:
            PlanError: the text is not ``<stage><F|B|I|W><microbatch>``.
        """
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise PlanError(f"cannot parse action {text!r}; expected e.g. '2F0' "
                            "(stage, F|B|I|W, microbatch)")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


# A schedule: one action list per rank, in the order that rank runs them.
Schedule = tuple[tuple[Action, ...], ...]


def gpipe_schedule(num_stages: int, num_microbatches: int, *, training: bool = True) -> Schedule:
    """GPipe (Huang et al., 2019): every forward, then every backward in reverse microbatch order.

    One stage per rank. Rank ``s``: ``sF0 .. sF(m-1)`` then ``sB(m-1) .. sB0``.
    """
    _check_sizes(num_stages, num_microbatches)
    ranks = []
    for s in range(num_stages):
        acts = [Action(s, "F", i) for i in range(num_microbatches)]
        if training:
            acts += [Action(s, "B", i) for i in reversed(range(num_microbatches))]
        ranks.append(tuple(acts))
    return tuple(ranks)


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush; Narayanan et al., 2021), one stage per rank.

    Rank ``s`` runs ``w = min(p - 1 - s, m)`` warm-up forwards, then alternates one forward
    and one backward, then drains the remaining backwards. At most ``w + 1`` microbatches
    are in flight on rank ``s`` (``p - s`` when ``m >= p``).
    """
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    ranks = []
    for s in range(p):
        w = min(p - 1 - s, m)
        acts = [Action(s, "F", i) for i in range(w)]
        for k in range(m - w):
            acts += [Action(s, "F", w + k), Action(s, "B", k)]
        acts += [Action(s, "B", i) for i in range(m - w, m)]
        ranks.append(tuple(acts))
    return tuple(ranks)


def interleaved_1f1b_schedule(num_ranks: int, num_microbatches: int,
                              stages_per_rank: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM virtual pipeline; Narayanan et al., 2021).

    ``S = p * v`` stages; rank ``r`` runs stages ``r, r + p, .., r + (v - 1) p``. Forwards go
    through the rank's chunks in groups of ``p`` microbatches; backwards the same with the
    chunks reversed. Rank ``r`` warms up with ``min(2 (p - r - 1) + (v - 1) p, m v)``
    forwards, then alternates forward and backward, then drains.

    Raises:
        PlanError: ``num_microbatches`` is not a multiple of ``num_ranks`` (the grouping
            needs it; Megatron has the same rule).
    """
    p, v, m = num_ranks, stages_per_rank, num_microbatches
    _check_sizes(p, m)
    if v < 1:
        raise PlanError(f"stages_per_rank={v} must be >= 1")
    if m % p:
        raise PlanError(f"interleaved_1f1b needs num_microbatches ({m}) to be a multiple of the "
                        f"number of ranks ({p}); choose m in {[p * k for k in range(1, 5)]}")

    def unit(r: int, k: int, kind: str) -> Action:
        chunk = (k // p) % v
        if kind == "B":
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return Action(chunk * p + r, kind, mb)

    total = m * v
    ranks = []
    for r in range(p):
        w = min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [unit(r, k, "F") for k in range(w)]
        for k in range(total - w):
            acts += [unit(r, w + k, "F"), unit(r, k, "B")]
        acts += [unit(r, k, "B") for k in range(total - w, total)]
        ranks.append(tuple(acts))
    return tuple(ranks)


def zero_bubble_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), one stage per rank.

    The backward is split into ``I`` (gradient w.r.t. the stage's inputs, on the critical
    path) and ``W`` (gradient w.r.t. its weights, which nothing downstream waits for). Rank
    ``s`` follows 1F1B with each ``B`` replaced by ``I`` then ``W``: the previous stage
    receives its gradient after ``I`` instead of after the whole backward, and ``W`` runs
    while the rank would otherwise wait, which shrinks the cool-down bubble. In-flight
    microbatches (activations held) stay at 1F1B's ``p - s``, the H1 memory bound.
    """
    _check_sizes(num_stages, num_microbatches)
    split: list[tuple[Action, ...]] = []
    for acts in one_f_one_b_schedule(num_stages, num_microbatches):
        out: list[Action] = []
        for a in acts:
            if a.kind == "B":
                out += [Action(a.stage_index, "I", a.mb_index), Action(a.stage_index, "W", a.mb_index)]
            else:
                out.append(a)
        split.append(tuple(out))
    return tuple(split)


def zbv_schedule(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6): ``2p`` stages in a V (:func:`stage_ranks`), every
    backward split into ``I`` and ``W``, the ``W``s filling the warm-up and cool-down
    bubbles. Action order as torch 2.13's ``ScheduleZBVZeroBubble``
    (:func:`autopart.core.v_schedules.zbv_rank_actions`). Any ``m >= 1``."""
    _check_sizes(num_ranks, num_microbatches)
    return tuple(tuple(Action(*a) for a in zbv_rank_actions(num_ranks, num_microbatches, r))
                 for r in range(num_ranks))


def dualpipev_schedule(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe-V (DeepSeek 2024): ``2p`` stages in a V, forwards of one chunk paired with
    backwards of the other, the tail's backwards split into ``I`` and ``W``. Each of torch's
    overlapped F+B pairs is an ``F`` then a ``B`` here
    (:func:`autopart.core.v_schedules.dualpipev_pairs` lists them): run and priced one after
    the other, except with expert parallelism, whose all-to-alls each action of a pair runs
    under the other's compute (:func:`autopart.core.plan_rules.overlaps_expert_exchanges`).
    Action order as torch 2.13's ``ScheduleDualPipeV``
    (:func:`autopart.core.v_schedules.dualpipev_rank_actions`).

    Raises:
        PlanError: ``num_microbatches < 2 * num_ranks``.
    """
    _check_sizes(num_ranks, num_microbatches)
    return tuple(tuple(Action(*a) for a in dualpipev_rank_actions(num_ranks, num_microbatches, r))
                 for r in range(num_ranks))


def stage_ranks(kind: str, num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Stage -> rank of ``kind``'s placement of ``p * v`` stages.

    Looped (every kind but the V ones): stage ``s`` on rank ``s % p``. V (``zbv``,
    ``dualpipev``, ``v = 2``): rank ``r`` runs stages ``r`` and ``2p - 1 - r``
    (:func:`autopart.core.v_schedules.v_stage_ranks`; torch's ``style="v"``).

    Raises:
        PlanError: a V kind with ``stages_per_rank != 2``, or counts below 1.
    """
    if num_ranks < 1 or stages_per_rank < 1:
        raise PlanError(f"num_ranks={num_ranks} and stages_per_rank={stages_per_rank} must be >= 1")
    if kind in V_SCHEDULE_KINDS:
        if stages_per_rank != 2:
            raise PlanError(f"schedule {kind!r} runs exactly 2 stages per rank (a V); got "
                            f"stages_per_rank={stages_per_rank}: set it to 2")
        return v_stage_ranks(num_ranks)
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def check_microbatches(kind: str, num_ranks: int, num_microbatches: int) -> None:
    """Raise unless ``kind`` can run ``num_microbatches`` on ``num_ranks`` ranks.

    Raises:
        PlanError: ``interleaved_1f1b`` with m not a multiple of p, or ``dualpipev`` with
            m < 2p; the message gives the values that work.
    """
    p, m = num_ranks, num_microbatches
    if kind == "interleaved_1f1b" and m % p:
        raise PlanError(f"interleaved_1f1b needs num_microbatches ({m}) to be a multiple of the "
                        f"number of ranks ({p}); choose m in {[p * k for k in range(1, 5)]}")
    if kind == "dualpipev" and m < 2 * p:
        raise PlanError(f"dualpipev needs at least as many microbatches as stages: "
                        f"num_microbatches={m} < 2 x {p} ranks; choose m >= {2 * p}")


def splits_backward(kind: str, recompute: bool) -> bool:
    """Whether a stage's backward runs as ``I`` then ``W`` (True) or as one ``B``.

    ZB-H1, ZB-V and DualPipe-V split (DualPipe-V only some microbatches' backwards: the
    others are one ``B``), and not on a stage that recomputes its forward: every autograd call
    that reads a checkpointed stage's saved tensors re-runs its forward, and the split makes
    several such calls per microbatch (measured 5-6 forwards per microbatch instead of 2 on
    torch's runtime, and a ``W`` 5x slower than ``B`` on a 4-block MLP in the one-process
    executor). This is the one place the rule lives: the schedule carries it as data (a
    ``B`` where ``I`` would be, no ``W``), the runtimes run what the schedule says, and the
    solver prices the same actions.
    """
    return kind in ("zero_bubble", *V_SCHEDULE_KINDS) and not recompute


def build_schedule(kind: str, num_ranks: int, num_microbatches: int,
                   stages_per_rank: int = 1, *, recompute: Collection[int] = ()) -> Schedule:
    """The training schedule of ``kind`` (one of ``SCHEDULE_KINDS``) as per-rank action lists.

    Args:
        kind: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zero_bubble"``, ``"zbv"``
            or ``"dualpipev"``.
        num_ranks: p >= 1.
        num_microbatches: m >= 1 (``dualpipev``: m >= 2p).
        stages_per_rank: v >= 1 (``interleaved_1f1b`` takes any v, ``zbv`` and
            ``dualpipev`` exactly 2, the others 1).
        recompute: indices of the stages that recompute their forward in backward; under
            the kinds that split the backward their ``I`` becomes a whole ``B`` and their
            ``W`` is dropped (see :func:`splits_backward`). Default: none.

    Raises:
        PlanError: unknown kind, a stages_per_rank the kind does not run, or a microbatch
            count it cannot (:func:`check_microbatches`).
    """
    if kind == "interleaved_1f1b":
        return interleaved_1f1b_schedule(num_ranks, num_microbatches, stages_per_rank)
    builders = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
                "zero_bubble": zero_bubble_schedule, "zbv": zbv_schedule,
                "dualpipev": dualpipev_schedule}
    if kind not in builders:
        raise PlanError(f"unknown schedule kind {kind!r}; expected one of "
                        "gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv, dualpipev")
    want = 2 if kind in V_SCHEDULE_KINDS else 1
    if stages_per_rank != want:
        raise PlanError(f"schedule {kind!r} runs {want} stage(s) per rank; stages_per_rank="
                        f"{stages_per_rank} needs {want}"
                        + ("" if want == 2 else " or schedule 'interleaved_1f1b'"))
    schedule = builders[kind](num_ranks, num_microbatches)
    whole = set(recompute)
    if not whole:
        return schedule
    out = []
    for acts in schedule:
        row = []
        for a in acts:
            if a.kind in "IW" and not splits_backward(kind, a.stage_index in whole):
                if a.kind == "I":  # the whole backward where I would be; its W goes
                    row.append(Action(a.stage_index, "B", a.mb_index))
            else:
                row.append(a)
        out.append(tuple(row))
    return tuple(out)


def forward_schedule(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1,
                     *, kind: str = "1f1b") -> Schedule:
    """Inference: each rank runs its stages' forwards (ascending stage), microbatch by
    microbatch; the stages are placed as ``kind`` places them (:func:`stage_ranks`; default
    looped: stage ``s`` on rank ``s % p``)."""
    _check_sizes(num_ranks, num_microbatches)
    rank_of = stage_ranks(kind if kind in V_SCHEDULE_KINDS else "1f1b", num_ranks,
                          stages_per_rank)
    return tuple(tuple(Action(s, "F", i) for s in range(len(rank_of)) if rank_of[s] == r
                       for i in range(num_microbatches))
                 for r in range(num_ranks))


def _check_sizes(num_ranks: int, num_microbatches: int) -> None:
    if num_ranks < 1 or num_microbatches < 1:
        raise PlanError(f"num_ranks={num_ranks} and num_microbatches={num_microbatches} "
                        "must be >= 1")


def _deps(action: Action, num_stages: int) -> list[Action]:
    s, i = action.stage_index, action.mb_index
    if action.kind == "F":
        return [Action(s - 1, "F", i)] if s > 0 else []
    if action.kind in "BI":
        own = [Action(s, "F", i)]
        if s == num_stages - 1:
            return own
        # the next stage's input gradient comes from its B or its I, whichever it runs
        return own + [Action(s + 1, "B", i), Action(s + 1, "I", i)]
    return [Action(s, "I", i)]  # W follows its own I


def validate_schedule(schedule: Schedule, num_stages: int, num_microbatches: int,
                      *, training: bool = True) -> None:
    """Check every action appears once, dependencies can be met, and no rank waits on itself.

    Raises:
        PlanError: names the first missing, duplicated or unreachable action.
    """
    seen: set[Action] = set()
    for rank, acts in enumerate(schedule):
        for a in acts:
            if a in seen:
                raise PlanError(f"action {a} appears twice (second time on rank {rank})")
            if not 0 <= a.stage_index < num_stages or not 0 <= a.mb_index < num_microbatches:
                raise PlanError(f"action {a} on rank {rank} is out of range for "
                                f"{num_stages} stages x {num_microbatches} microbatches")
            seen.add(a)
    for s in range(num_stages):
        for i in range(num_microbatches):
            needed = [Action(s, "F", i)]
            if training:
                split = Action(s, "I", i) in seen or Action(s, "W", i) in seen
                needed += [Action(s, "I", i), Action(s, "W", i)] if split else [Action(s, "B", i)]
                if split and Action(s, "B", i) in seen:
                    raise PlanError(f"stage {s} microbatch {i} has both B and I/W; use one")
            for a in needed:
                if a not in seen:
                    raise PlanError(f"schedule never runs {a}")
    execution_order(schedule, num_stages)


def execution_order(schedule: Schedule, num_stages: int) -> list[Action]:
    """One global order that respects each rank's order and every cross-stage dependency.

    Ranks take turns (lowest rank first); a rank whose next action is not ready waits.
    This is how the one-process executor runs a schedule.

    Raises:
        PlanError: the schedule deadlocks; names each rank's blocked action.
    """
    done: set[Action] = set()
    present = {a for acts in schedule for a in acts}
    cursors = [0] * len(schedule)
    order: list[Action] = []
    total = len(present)
    while len(order) < total:
        progressed = False
        for rank, acts in enumerate(schedule):
            while cursors[rank] < len(acts):
                a = acts[cursors[rank]]
                if any(d in present and d not in done for d in _deps(a, num_stages)):
                    break
                done.add(a)
                order.append(a)
                cursors[rank] += 1
                progressed = True
        if not progressed:
            blocked = [str(acts[c]) for acts, c in zip(schedule, cursors, strict=True) if c < len(acts)]
            raise PlanError(f"schedule deadlocks: every rank waits ({', '.join(blocked)} blocked)")
    return order


def in_flight_counts(schedule: Schedule, num_stages: int) -> list[int]:
    """Per stage, the most microbatches whose forward has run and whose backward has not
    finished (B, or W for split backwards), following each rank's own order.

    This is the number of microbatches' saved activations the stage holds at its peak:
    ``m`` for GPipe, ``p - s`` for 1F1B and ZB-H1 when ``m >= p``.
    """
    peak = [0] * num_stages
    live = [0] * num_stages
    for acts in schedule:
        for a in acts:
            if a.kind == "F":
                live[a.stage_index] += 1
                peak[a.stage_index] = max(peak[a.stage_index], live[a.stage_index])
            elif a.kind in "BW":
                live[a.stage_index] -= 1
    return peak


def to_csv(schedule: Schedule) -> str:
    """One line per rank, actions separated by commas: the CSV action format that
    ``torch.distributed.pipelining`` schedules load (``_PipelineScheduleRuntime._load_csv``)."""
    return "".join(",".join(str(a) for a in acts) + "\n" for acts in schedule)


def from_csv(text: str) -> Schedule:
    """Parse :func:`to_csv` output (blank lines are ranks with no actions).

    Raises:
        PlanError: an action cannot be parsed.
    """
    rows = text.splitlines()
    return tuple(tuple(Action.parse(cell) for cell in row.split(",") if cell.strip())
                 for row in rows)


def format_timeline(schedule: Schedule, num_stages: int) -> str:
    """ASCII timeline: one row per rank, one column per time slot of the one-process order.

    Each action takes one slot; a rank waiting on another shows ``.``. Example (GPipe,
    2 ranks, 2 microbatches)::

        rank 0 | 0F0 0F1  .   .   .   .  0B1 0B0
        rank 1 |  .   .  1F0 1F1 1B1 1B0  .   .
    """
    order = execution_order(schedule, num_stages)
    owner = {a: r for r, acts in enumerate(schedule) for a in acts}
    width = max((len(str(a)) for a in order), default=3)
    rows = []
    for r in range(len(schedule)):
        cells = [str(a).rjust(width) if owner[a] == r else ".".center(width) for a in order]
        rows.append(f"rank {r} | " + " ".join(cells))
    return "\n".join(rows)
