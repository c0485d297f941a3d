"""A fully costed candidate (cuts, m, v, kind, recompute): closed-form step time and peaks."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from autopart.core.schedule import build_schedule, forward_schedule, in_flight_counts, stage_ranks
from autopart.core.v_schedules import V_SCHEDULE_KINDS
from autopart.solver._closed_form import (
    busy_us,
    closed_form_peaks,
    closed_form_step_us,
    in_flight,
)
from autopart.solver._cost_model import CostModel
from autopart.solver._stage_costing import StageSpan, stage_costs, stage_terms
from autopart.solver.candidates import CutCandidates
from autopart.solver.chain import ChainAnswer
from autopart.solver.simulate import StageCosts, rank_peaks, simulate, simulate_1f1b

__all__ = ["TIE_TOLERANCE", "Candidate", "evaluate"]

#: Predicted step times within this fraction of the fastest candidate's are a tie (speed
#: target, measured costs): op times measured twice differ by per cents, so a plan predicted
#: less than this much faster is not known to be faster, and picking it would make the plan
#: depend on one launch's noise. Kept below the 3 % by which a chosen plan may trail the
#: fastest measured one. Plans that differ in their cuts no tie-break among whole candidates
#: can fix: a second launch gets the same plan from the profile cache
#: (``benchmarks/determinism``). Used by the plan's selection and by ``"op"``'s choice of
#: what to keep (:mod:`autopart.solver.recompute_choice`).
TIE_TOLERANCE = 0.02


@functools.lru_cache(maxsize=256)
def _training_schedule(kind: str, p: int, m: int, v: int, recompute: tuple[int, ...]) -> Any:
    """``build_schedule``'s action lists, cached (the solver costs many cuts per schedule)."""
    return build_schedule(kind, p, m, v, recompute=recompute)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One fully costed option.

    Attributes:
        kind, v, m: schedule kind, stages per rank, microbatches.
        positions: cut positions (node indices), ascending.
        recompute: per stage.
        costs: per-stage costs as the simulator takes them.
        param_info: per stage (parameter bytes, trainable elements).
        step_us: predicted step time, µs (closed form, or simulator once ``is_simulated``).
        bubble: idle share of a rank's step.
        peaks: per rank peak memory, bytes.
        stage_peaks: per stage peak memory (static + in-flight saved + backward extra + what
            it keeps until the step ends), bytes.
        caps: per rank cap (None: no cap).
        sub: the subproblem it came from (opaque to this module).
        name: a baseline's name, ``""`` for the solver's own candidates.
        training: fwd + bwd, or forward only.
        is_simulated: ``step_us``, ``bubble``, ``peaks`` come from the simulator.
        sync_us: the end-of-step all-reduce of tied parameters' gradients, µs (part of
            ``step_us``; :meth:`CostModel.tied_sync_us`).
    """

    kind: str
    v: int
    m: int
    positions: tuple[int, ...]
    recompute: tuple[bool, ...]
    costs: StageCosts
    param_info: tuple[tuple[int, int], ...]
    step_us: float
    bubble: float
    peaks: tuple[int, ...]
    stage_peaks: tuple[int, ...]
    caps: tuple[int, ...] | None
    sub: Any = None
    name: str = ""
    training: bool = True
    is_simulated: bool = False
    sync_us: float = 0.0

    @property
    def max_peak(self) -> int:
        """Largest rank peak, bytes."""
        return max(self.peaks)

    @property
    def fits(self) -> bool:
        """Every rank within its cap."""
        return self.caps is None or all(a <= b for a, b in zip(self.peaks, self.caps, strict=True))

    def simulated(self) -> Candidate:
        """This candidate with step time, bubble and per-rank peaks from the simulator."""
        if self.is_simulated:
            return self
        p = len(self.peaks)
        c = self.costs
        if (self.training and self.kind == "1f1b" and self.v == 1 and not c.has_host
                and c.ranks_per_core <= 1.0 and not any(c.split_held_bytes)
                and not any(c.weight_grad_bytes) and not any(c.kept_bytes)):
            # the replay without the action lists (10^6 actions at thousands of GPUs); the
            # peaks are evaluate()'s closed form, which the replay's equal here (tested)
            step, busy = simulate_1f1b(p, self.m, c)
            bubble = 1.0 - sum(busy) / len(busy) / step if step > 0 else 0.0
            return replace(self, step_us=step + self.sync_us,
                           bubble=min(max(bubble, 0.0), 1.0), is_simulated=True)
        recompute = [s for s, rc in enumerate(self.recompute) if rc]
        sched = (build_schedule(self.kind, p, self.m, self.v, recompute=recompute)
                 if self.training else forward_schedule(p, self.m, self.v, kind=self.kind))
        res = simulate(sched, self.costs)
        return replace(self, step_us=res.step_time_us + self.sync_us, bubble=res.bubble_fraction,
                       peaks=res.peak_memory_bytes, is_simulated=True)


def evaluate(model: CostModel, cands: CutCandidates | None, kind: str, p: int, v: int, m: int,
             answer: ChainAnswer | Sequence[int], caps: Sequence[int] | None, *,
             sub: Any = None, name: str = "",
             recompute: bool | Sequence[bool] = False) -> Candidate:
    """Cost an answer exactly (closed-form step time; per-rank peaks following the schedule).

    Args:
        model: the cost model.
        cands: the candidates the answer's cut indices refer to; ``None`` when ``answer`` is a
            tuple of node positions (a baseline).
        kind, p, v, m: schedule kind, ranks, stages per rank, microbatches.
        answer: a chain answer (cut indices + recompute) or node positions.
        caps: per-rank memory caps, bytes (None: no cap).
        recompute: for node positions only: every stage recomputes (True), none does (the
            default), or one flag per stage.
    """
    if isinstance(answer, ChainAnswer):
        assert cands is not None
        positions = tuple(cands.positions[i] for i in answer.cuts)
        rc = tuple(answer.recompute)
    else:
        positions = tuple(answer)
        rc = ((recompute,) * (len(positions) + 1) if isinstance(recompute, bool)
              else tuple(recompute))
    training = model.training
    bounds = [0, *positions, len(model.costs.nodes)]
    s_total = len(bounds) - 1
    rank_of = stage_ranks(kind, p, v)
    terms = [stage_terms(model, kind, StageSpan(s, s_total, bounds[s], bounds[s + 1], rank_of[s],
                                                p, rc[s], rank_of), m) for s in range(s_total)]
    c = stage_costs(terms, [model.runtime.issue_thread_of(rank_of[s]) for s in range(s_total)],
                    model.runtime.ranks_per_core)
    k = in_flight(kind, p, m, v, training)
    sync = model.tied_sync_us(positions, p, rank_of)
    if training and kind in V_SCHEDULE_KINDS and m < 2 * p:
        # a V schedule whose pipeline never fills: the closed form undershoots by up to 11%
        # (tested); the replay is small (fewer than 2p microbatches)
        step = simulate(_training_schedule(kind, p, m, v, tuple(s for s in range(s_total)
                                                                 if rc[s])), c).step_time_us
    else:
        step = closed_form_step_us(kind, p, m, v, c, training=training)
    step += sync
    busy = busy_us(c, p, m, training, rank_of)
    bubble = 1.0 - sum(busy) / len(busy) / step if step > 0 else 0.0
    if (training and kind in V_SCHEDULE_KINDS) or any(c.split_held_bytes) \
            or any(c.weight_grad_bytes) or any(c.kept_bytes):
        # what a split backward holds between I and W, what torch's stages keep until the
        # step ends, and the V schedules' two stages per rank (whose peaks fall at different
        # times: the sum of the stages' peaks overcounts) follow the action order: count
        # them there
        sched = _training_schedule(kind, p, m, v, tuple(s for s in range(s_total) if rc[s]))
        peaks = list(rank_peaks(sched, c))
        pending = in_flight_counts(sched, s_total)
    else:
        peaks = closed_form_peaks(c, k, p, rank_of)
        pending = [0] * s_total
    stage_peaks = tuple(c.static_bytes[s] + k[s] * c.saved_bytes[s]
                        + max(c.backward_extra_bytes[s], c.weight_grad_bytes[s])
                        + pending[s] * c.split_held_bytes[s]
                        + m * c.kept_bytes[s]
                        for s in range(s_total))
    return Candidate(kind=kind, v=v, m=m, positions=positions, recompute=rc, costs=c,
                     param_info=tuple((t.param_bytes, t.num_parameters) for t in terms),
                     step_us=step, bubble=min(max(bubble, 0.0), 1.0),
                     peaks=tuple(peaks), stage_peaks=stage_peaks,
                     caps=None if caps is None else tuple(caps), sub=sub, name=name,
                     training=training, sync_us=sync)
