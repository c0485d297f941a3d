"""The partition subproblem as data: a chain of segments onto p x v stages, its costs and objective."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from autopart.core.errors import InfeasiblePlanError, PlanError
from autopart.core.schedule import splits_backward

__all__ = ["ChainProblem", "ChainAnswer", "RECOMPUTE_MODES"]

#: ``"none"``: no stage recomputes; ``"all"``: every stage does; ``"auto"``: the solver picks.
RECOMPUTE_MODES = ("none", "all", "auto")
#: The schedule kind whose split backward ``seg_bwd_weight`` prices (ZB-H1).
_SPLIT_KIND = "zero_bubble"


@dataclass(frozen=True, slots=True)
class ChainAnswer:
    """Cuts and per-stage recompute flags for a :class:`ChainProblem`, with their cost.

    Attributes:
        cuts: ``S - 1`` ascending cut indices, ``i`` meaning "cut after segment i".
        recompute: per stage, whether it recomputes its forward in backward.
        objective: the problem's objective at this answer (integer units).
    """

    cuts: tuple[int, ...]
    recompute: tuple[bool, ...]
    objective: int


@dataclass(frozen=True, slots=True)
class ChainProblem:
    """Split K segments into ``S = num_ranks * stages_per_rank`` contiguous non-empty stages.

    Stage ``s`` runs on rank ``placement[s]`` (default ``s % num_ranks``; the V schedules
    place rank r's two stages at r and 2p - 1 - r). Times are integers (0.1 µs units in
    :mod:`autopart.solver._problem_grid`), memory integers (bytes).

    Stage time ``t_s = speed[rank] * (sum seg_time + recompute * sum seg_fwd)`` (each product
    rounded per segment) ``+ cut_out`` of its outgoing cut ``+ cut_in`` of its incoming cut.
    Objective (``optimize="speed"``)::

        w_stage * max_s t_s + w_rank * max_r sum_{s on r} t_s + w_sum * sum_s t_s
            - sum_{s >= 1, not recomputing} W_s

    which covers the closed forms of every schedule kind (see
    :func:`autopart.solver._closed_form.objective_weights`). The last term is ZB-H1's
    (Qi et al. 2023): its cool-down runs each stage's weight-gradient part ``W`` off the
    critical path, except stage 0's. ``W_s = speed[rank] * sum seg_bwd_weight`` (part of
    ``seg_time``); it is absent (0) unless ``seg_bwd_weight`` is given, and a recomputing
    stage runs its whole backward at once, so it hides nothing (:meth:`hides_weight`).
    The stages that split their backward (the same ones) also pay ``seg_split`` (what the
    split adds, per segment, not in ``seg_time``): stage 0's inputs need no gradient, so
    its backward runs whole, as ``seg_time`` prices it.
    Stage memory::

        state_s + in_s + out_s + k_s * saved_s                 (no recompute)
        state_s + in_s + out_s + k_s * (in_s + kept_s) + saved_s - kept_s
                                                               (recompute: inputs kept, one
                                                                microbatch rebuilt in backward)

    with ``kept_s`` the sum of ``seg_rc_kept`` (what a recomputing stage still keeps under the
    selective policy, which its backward trades for the saved set; 0 without it: the full
    policy).

    plus ``k_s * out_s`` without recompute where ``outputs_held`` (the cost model counts a
    stage's outputs that its nodes do not save as held from each F to its B,
    ``CostModel.held_parts``; the crossing bytes bound them).

    with ``state_s`` / ``saved_s`` sums of ``seg_state`` / ``seg_saved``, ``in_s`` the bytes
    crossing its incoming cut (``first_in_bytes`` for stage 0), ``out_s`` those of its outgoing
    cut (``last_out_bytes`` for the last) and ``k_s = in_flight[s]``. A rank's memory is the sum
    over its stages and must stay within ``rank_caps`` (``None``: no cap). With
    ``optimize="memory"`` the objective is the largest rank memory instead.

    Raises:
        PlanError: lists of the wrong length, negative costs, unknown mode.
        InfeasiblePlanError: fewer segments than stages.
    """

    seg_time: tuple[int, ...]
    seg_fwd: tuple[int, ...]
    cut_out: tuple[int, ...]
    cut_in: tuple[int, ...]
    num_ranks: int
    stages_per_rank: int = 1
    speed: tuple[float, ...] | None = None
    w_stage: int = 1
    w_rank: int = 0
    w_sum: int = 0
    seg_state: tuple[int, ...] | None = None
    seg_saved: tuple[int, ...] | None = None
    cut_bytes: tuple[int, ...] | None = None
    first_in_bytes: int = 0
    last_out_bytes: int = 0
    in_flight: tuple[int, ...] | None = None
    rank_caps: tuple[int, ...] | None = None
    recompute: str = "none"
    optimize: str = "speed"
    seg_bwd_weight: tuple[int, ...] | None = None
    outputs_held: bool = False
    seg_split: tuple[int, ...] | None = None
    placement: tuple[int, ...] | None = None
    seg_rc_kept: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        k, s = len(self.seg_time), self.num_stages
        if self.num_ranks < 1 or self.stages_per_rank < 1:
            raise PlanError(f"num_ranks={self.num_ranks} and stages_per_rank="
                            f"{self.stages_per_rank} must be >= 1")
        if s > k:
            raise InfeasiblePlanError(
                f"num_stages={s} but the chain has only {k} segments (each stage needs at least "
                f"one); use num_stages <= {k} or allow more cut candidates")
        if self.recompute not in RECOMPUTE_MODES or self.optimize not in ("speed", "memory"):
            raise PlanError(f"recompute={self.recompute!r} must be one of {RECOMPUTE_MODES} and "
                            f"optimize={self.optimize!r} 'speed' or 'memory'")
        lengths = {"seg_fwd": (self.seg_fwd, k), "cut_out": (self.cut_out, k - 1),
                   "cut_in": (self.cut_in, k - 1), "speed": (self.speed, self.num_ranks),
                   "seg_state": (self.seg_state, k), "seg_saved": (self.seg_saved, k),
                   "cut_bytes": (self.cut_bytes, k - 1), "in_flight": (self.in_flight, s),
                   "rank_caps": (self.rank_caps, self.num_ranks),
                   "seg_bwd_weight": (self.seg_bwd_weight, k),
                   "seg_split": (self.seg_split, k), "placement": (self.placement, s),
                   "seg_rc_kept": (self.seg_rc_kept, k)}
        for name, (values, want) in lengths.items():
            if values is not None and len(values) != want:
                raise PlanError(f"ChainProblem.{name} has {len(values)} entries; expected {want}")
        ints = (self.seg_time, self.seg_fwd, self.cut_out, self.cut_in, self.seg_state or (),
                self.seg_saved or (), self.cut_bytes or (), self.seg_bwd_weight or (),
                self.seg_split or (), self.seg_rc_kept or ())
        if any(v < 0 for v in itertools.chain(*ints)) or min(self.speed or (1.0,)) <= 0:
            raise PlanError("chain costs and memory must be >= 0 and speed factors > 0")
        if self.placement is not None and sorted(self.placement) != sorted(
                r for r in range(self.num_ranks) for _ in range(self.stages_per_rank)):
            raise PlanError(f"ChainProblem.placement={list(self.placement)} must give each of "
                            f"the {self.num_ranks} ranks {self.stages_per_rank} stage(s)")

    # ---- sizes -----------------------------------------------------------------------
    @property
    def num_segments(self) -> int:
        """K."""
        return len(self.seg_time)

    @property
    def num_stages(self) -> int:
        """S = num_ranks * stages_per_rank."""
        return self.num_ranks * self.stages_per_rank

    @property
    def has_memory(self) -> bool:
        """True when memory enters the problem (caps or the memory objective)."""
        return self.rank_caps is not None or self.optimize == "memory"

    # ---- per-stage coefficients ------------------------------------------------------
    def rank_of(self, stage: int) -> int:
        """Rank that runs ``stage``."""
        if self.placement is not None:
            return self.placement[stage]
        return stage % self.num_ranks

    def stages_on(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, ascending."""
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def seg_time_on(self, rank: int) -> list[int]:
        """Segment times on ``rank`` (speed factor applied, rounded half to even)."""
        f = 1.0 if self.speed is None else self.speed[rank]
        return list(self.seg_time) if f == 1.0 else [int(round(c * f)) for c in self.seg_time]

    def seg_fwd_on(self, rank: int) -> list[int]:
        """Recompute extra time per segment on ``rank``."""
        f = 1.0 if self.speed is None else self.speed[rank]
        return list(self.seg_fwd) if f == 1.0 else [int(round(c * f)) for c in self.seg_fwd]

    def seg_bwd_weight_on(self, rank: int) -> list[int]:
        """Weight-gradient (W) time per segment on ``rank``; zeros without ``seg_bwd_weight``."""
        if self.seg_bwd_weight is None:
            return [0] * self.num_segments
        f = 1.0 if self.speed is None else self.speed[rank]
        return (list(self.seg_bwd_weight) if f == 1.0
                else [int(round(c * f)) for c in self.seg_bwd_weight])

    def seg_split_on(self, rank: int) -> list[int]:
        """What splitting the backward adds per segment on ``rank``; zeros without
        ``seg_split``."""
        if self.seg_split is None:
            return [0] * self.num_segments
        f = 1.0 if self.speed is None else self.speed[rank]
        return list(self.seg_split) if f == 1.0 else [int(round(c * f)) for c in self.seg_split]

    def hides_weight(self, stage: int, recompute: bool) -> bool:
        """Whether ``stage`` runs its ``W`` off the critical path: not stage 0, and its backward
        splits into ``I`` and ``W`` (:func:`autopart.core.schedule.splits_backward` of ZB-H1,
        the kind ``seg_bwd_weight`` is given for, and of the stage's recompute flag)."""
        return (stage > 0 and self.seg_bwd_weight is not None
                and splits_backward(_SPLIT_KIND, recompute))

    def hidden_weight(self, cuts: Sequence[int], recompute: Sequence[bool]) -> int:
        """``sum_{s >= 1, backward split} W_s``: the W time the objective takes off."""
        if self.seg_bwd_weight is None:
            return 0
        return sum(sum(self.seg_bwd_weight_on(self.rank_of(s))[a:b])
                   for s, (a, b) in enumerate(self.stage_bounds(cuts))
                   if self.hides_weight(s, recompute[s]))

    def in_flight_of(self, stage: int) -> int:
        """``k_s``: microbatches whose saved activations stage ``stage`` holds at once."""
        return 1 if self.in_flight is None else self.in_flight[stage]

    # ---- evaluation of an answer -----------------------------------------------------
    def stage_bounds(self, cuts: Sequence[int]) -> list[tuple[int, int]]:
        """Segments ``[a, b)`` of every stage."""
        bounds = [0, *(c + 1 for c in cuts), self.num_segments]
        return list(itertools.pairwise(bounds))

    def stage_times(self, cuts: Sequence[int], recompute: Sequence[bool]) -> list[int]:
        """``t_s`` of every stage (see the class docstring)."""
        out = []
        for s, (a, b) in enumerate(self.stage_bounds(cuts)):
            r = self.rank_of(s)
            t = sum(self.seg_time_on(r)[a:b])
            if recompute[s]:
                t += sum(self.seg_fwd_on(r)[a:b])
            if self.hides_weight(s, recompute[s]):
                t += sum(self.seg_split_on(r)[a:b])
            if a > 0:
                t += self.cut_in[a - 1]
            if b < self.num_segments:
                t += self.cut_out[b - 1]
            out.append(t)
        return out

    def stage_memory(self, cuts: Sequence[int], recompute: Sequence[bool]) -> list[int]:
        """Memory of every stage, bytes (0 when the problem has no memory data)."""
        state = self.seg_state or (0,) * self.num_segments
        saved = self.seg_saved or (0,) * self.num_segments
        cross = self.cut_bytes or (0,) * (self.num_segments - 1)
        kept = self.seg_rc_kept or (0,) * self.num_segments
        out = []
        for s, (a, b) in enumerate(self.stage_bounds(cuts)):
            cin = cross[a - 1] if a > 0 else self.first_in_bytes
            cout = cross[b - 1] if b < self.num_segments else self.last_out_bytes
            k = self.in_flight_of(s)
            act = sum(saved[a:b])
            held = (k * (cin + sum(kept[a:b])) + act - sum(kept[a:b]) if recompute[s]
                    else k * (act + cout * self.outputs_held))
            out.append(sum(state[a:b]) + cin + cout + held)
        return out

    def per_rank(self, per_stage: Sequence[int]) -> list[int]:
        """Each rank's sum of ``per_stage`` over the stages it runs (one pass over them)."""
        out = [0] * self.num_ranks
        for s, x in enumerate(per_stage):
            out[self.rank_of(s)] += x
        return out

    def rank_memory(self, cuts: Sequence[int], recompute: Sequence[bool]) -> list[int]:
        """Memory of every rank: the sum over its stages, bytes."""
        return self.per_rank(self.stage_memory(cuts, recompute))

    def time_objective(self, cuts: Sequence[int], recompute: Sequence[bool]) -> int:
        """``w_stage * max t + w_rank * max rank load + w_sum * sum t - hidden W``."""
        t = self.stage_times(cuts, recompute)
        loads = self.per_rank(t)
        return (self.w_stage * max(t) + self.w_rank * max(loads) + self.w_sum * sum(t)
                - self.hidden_weight(cuts, recompute))

    def fits(self, cuts: Sequence[int], recompute: Sequence[bool]) -> bool:
        """Every rank within its cap (True without caps)."""
        if self.rank_caps is None:
            return True
        return all(m <= c for m, c in zip(self.rank_memory(cuts, recompute), self.rank_caps,
                                          strict=True))

    def objective(self, cuts: Sequence[int], recompute: Sequence[bool]) -> int:
        """The value the problem minimises (time, or largest rank memory for "memory")."""
        if self.optimize == "memory":
            return max(self.rank_memory(cuts, recompute))
        return self.time_objective(cuts, recompute)

    def recompute_choices(self) -> list[tuple[bool, ...]]:
        """Every recompute assignment the mode allows (2^S for ``"auto"``)."""
        s = self.num_stages
        if self.recompute == "none":
            return [(False,) * s]
        if self.recompute == "all":
            return [(True,) * s]
        return [tuple(bits) for bits in itertools.product((False, True), repeat=s)]
