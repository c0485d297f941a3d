"""Schedules as data: actions like ``2F0``, per-rank action lists, GPipe generation and validation."""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopart.errors import PlanError

__all__ = ["Action", "Schedule", "gpipe_schedule", "forward_schedule", "validate_schedule",
           "execution_order"]

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
    if num_stages < 1 or num_microbatches < 1:
        raise PlanError(f"num_stages={num_stages} and num_microbatches={num_microbatches} must be >= 1")
    ranks = []
    for s in range(num_stages):
        acts = [Action(s, "F", i) for i in range(num_microbatches)]
        if training:
            acts += [Action(s, "B", i) for i in reversed(range(num_microbatches))]
        ranks.append(tuple(acts))
    return tuple(ranks)


def forward_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Inference: each rank runs its stage's forwards in microbatch order."""
    return gpipe_schedule(num_stages, num_microbatches, training=False)


def _deps(action: Action, num_stages: int) -> list[Action]:
    s, i = action.stage_index, action.mb_index
    if action.kind == "F":
        return [Action(s - 1, "F", i)] if s > 0 else []
    if action.kind in "BI":
        own = [Action(s, "F", i)]
        return own + ([Action(s + 1, "B", i)] if s < num_stages - 1 else [])
    return [Action(s, "F", i)]  # W


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
    kinds = "FB" if training else "F"
    for s in range(num_stages):
        for i in range(num_microbatches):
            for k in kinds:
                if Action(s, k, i) not in seen:
                    raise PlanError(f"schedule never runs {Action(s, k, i)}")
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
