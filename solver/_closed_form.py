"""Closed forms per schedule kind: in-flight microbatches, objective weights and step time."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from autopart.core.schedule import build_schedule, in_flight_counts, stage_ranks
from autopart.core.v_schedules import V_SCHEDULE_KINDS
from autopart.solver.simulate import StageCosts, core_bound_us

__all__ = ["in_flight", "objective_weights", "closed_form_step_us", "closed_form_host_bound_us"]


@functools.lru_cache(maxsize=256)
def in_flight(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int,
              training: bool = True) -> tuple[int, ...]:
    """Per stage, the most microbatches whose saved activations it holds at once.

    GPipe holds all ``m``; 1F1B and ZB-H1 (as built by :mod:`autopart.core.schedule`) hold
    ``min(p - s, m)`` on stage s (Narayanan et al. 2021; Qi et al. 2023, H1 keeps 1F1B's
    memory); interleaved 1F1B, ZB-V and DualPipe-V are counted on their action lists with
    :func:`autopart.core.schedule.in_flight_counts` (ZB-V and DualPipe-V: ``min(2p - s, m)``
    on stage s once ``m`` fills the pipeline, tested). Inference keeps nothing for a
    backward: 0.
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if not training:
        return (0,) * (p * v)
    if kind == "gpipe":
        return (m,) * (p * v)
    if kind in ("1f1b", "zero_bubble"):
        return tuple(min(p - s, m) for s in range(p))
    if kind in V_SCHEDULE_KINDS:  # exact on the action lists (not known to saturate in m)
        return _interleaved_counts(kind, p, m, v)
    # The counts are set by the warm-up (fewer than (v + 1) p units), so they saturate: m = 4p
    # gives the same counts as any larger multiple of p (checked in the tests).
    short = min(m, 4 * p) if m % p == 0 else m
    return _interleaved_counts(kind, p, short, v)


@functools.lru_cache(maxsize=64)
def _interleaved_counts(kind: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """In-flight counts counted on the built schedule (cached on the saturated ``m``)."""
    return tuple(in_flight_counts(build_schedule(kind, p, m, v), p * v))


def objective_weights(kind: str, num_ranks: int, num_microbatches: int,
                      stages_per_rank: int) -> tuple[int, int, int]:
    """``(w_stage, w_rank, w_sum)`` of the linear step-time objective for the chain solver.

    One stage per rank (GPipe, 1F1B, ZB-H1, inference): ``(m - 1) * max_s t_s + sum_s t_s``,
    the fill-and-drain form of DESIGN.md. Interleaved 1F1B: ``m * max_r load_r + (p - 1) *
    max_s t_s``, Narayanan et al. 2021's ``(1 + (p - 1) / (v m))`` times the ideal for
    balanced stages. ZB-V and DualPipe-V (two stages per rank in a V): ``m * max_r load_r``,
    a lower bound of their step (every rank runs its two stages' load m times); their bubble,
    ``(p - 1)`` times the slower of a stage's ``F`` and ``I`` (:func:`closed_form_step_us`),
    is no multiple of the chain's stage time and is left to the exact costing of the
    candidates (:func:`autopart.solver._candidate.evaluate`, then the simulator).
    """
    p, m = num_ranks, num_microbatches
    if kind in V_SCHEDULE_KINDS:
        return 0, m, 0
    if kind == "interleaved_1f1b" and stages_per_rank > 1:
        return p - 1, m, 0
    return m - 1, 0, 1


def closed_form_step_us(kind: str, num_ranks: int, num_microbatches: int,
                        stages_per_rank: int, c: StageCosts, *, training: bool = True) -> float:
    """Predicted step time, µs, from per-stage costs (the simulator's inputs), no replay.

    With ``t_s`` the stage's full per-microbatch time (F + I + W + its sends):

    - GPipe: ``(m - 1) * (max_s Fp_s + max_s Bp_s) + sum_s t_s`` (two flow shops; ``Fp`` is
      forward + send, ``Bp`` backward + gradient send). Inference: forward part only.
    - 1F1B: ``(m - 1) * max_s t_s + sum_s t_s``.
    - ZB-H1 (I then W): ``(m - 1) * max_s t_s + sum_s (t_s - W_s) + W_0``; for equal stages
      ``m (F + I + W) + (p - 1) (F + I)`` (Qi et al. 2023).
    - Interleaved 1F1B: ``m * max_r load_r + (p - 1) * max_s t_s``.
    - ZB-V and DualPipe-V (rank r runs stages r and 2p - 1 - r): ``m * max_r load_r +
      (p - 1) * max_s (Fp_s + I_s)`` for ZB-V, whose ``W`` fill the warm-up and cool-down
      (Qi et al. 2024: zero bubble when F = I = W); DualPipe-V runs whole ``B`` in its
      middle and pairs F with B one after the other here, so ``m * max_r load_r +
      (p - 1) * max_s t_s``. Both are estimates the solver's simulator replaces for its
      final candidates.

    These agree with :func:`autopart.solver.simulate.simulate` within 2% for balanced stages
    and small sends (tested); the solver replays its final candidates with the simulator.

    With host times (``c.has_host``), the step is at least
    :func:`closed_form_host_bound_us`, as in the simulator. With more CPU ranks than cores
    (``c.ranks_per_core > 1``) it is at least the ranks' mean busy time times
    ``ranks_per_core`` (:func:`autopart.solver.simulate.core_bound_us`); the simulator's
    replay of shared cores, which the solver runs on its final candidates, can only be longer.
    """
    step = _schedule_step_us(kind, num_ranks, num_microbatches, stages_per_rank, c,
                             training=training)
    if c.ranks_per_core > 1.0:
        rank_of = stage_ranks(kind, num_ranks, stages_per_rank)
        step = max(step, core_bound_us(busy_us(c, num_ranks, num_microbatches, training,
                                               rank_of), c.ranks_per_core))
    if not c.has_host:
        return step
    return max(step, closed_form_host_bound_us(kind, num_ranks, num_microbatches,
                                               stages_per_rank, c, training=training))


def closed_form_host_bound_us(kind: str, num_ranks: int, num_microbatches: int,
                              stages_per_rank: int, c: StageCosts, *,
                              training: bool = True) -> float:
    """The busiest issuing thread's host time in one step, µs (0.0 without host times):
    every microbatch runs each stage's ``F`` and, training, its ``B`` (or ``I`` and ``W``)
    once, so a thread spends ``m`` times the host time of its stages' actions
    (:func:`autopart.solver.simulate.host_bound_us` sums the same over an action list).
    ``c.issue_thread`` says which stages share a thread (default: a rank's own)."""
    if not c.has_host:
        return 0.0
    threads = c.issue_thread or stage_ranks(kind, num_ranks, stages_per_rank)
    per: dict[int, float] = {}
    for s, t in enumerate(threads):
        per[t] = per.get(t, 0.0) + num_microbatches * (c.host_fwd_us[s] + (
            c.host_bwd_input_us[s] + c.host_bwd_weight_us[s] if training else 0.0))
    return max(per.values(), default=0.0)


def _schedule_step_us(kind: str, num_ranks: int, num_microbatches: int,
                      stages_per_rank: int, c: StageCosts, *, training: bool = True) -> float:
    """:func:`closed_form_step_us` without the host bound."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    s_total = len(c.fwd_us)
    fp = [c.fwd_us[s] + c.send_fwd_us[s] for s in range(s_total)]
    rank_of = stage_ranks(kind, p, v)

    def loads(per: list[float]) -> float:
        return max(sum(x for s, x in enumerate(per) if rank_of[s] == r) for r in range(p))

    if not training:
        if v > 1:
            return m * loads(fp) + (p - 1) * max(fp)
        return (m - 1) * max(fp) + sum(fp)
    bp = [c.bwd_input_us[s] + c.bwd_weight_us[s] + c.send_bwd_us[s] for s in range(s_total)]
    t = [a + b for a, b in zip(fp, bp, strict=True)]
    if kind in V_SCHEDULE_KINDS:
        ip = [c.bwd_input_us[s] + c.send_bwd_us[s] for s in range(s_total)]
        # steady state: every rank busy with its load, plus (p - 1) slots of the slower of
        # F and I (W fills the rest); a short step is bound by one microbatch's way down and
        # back up the V
        load = m * loads(t)
        if kind == "dualpipev" and c.overlaps_pairs:
            load = _paired_load_us(p, m, c, fp, bp)
        steady = load + (p - 1) * max(max(f, i) for f, i in zip(fp, ip, strict=True))
        return max(steady, sum(fp) + sum(ip) + c.bwd_weight_us[0] + (m - 1) * max(t))
    if kind == "interleaved_1f1b" and v > 1:
        return m * loads(t) + (p - 1) * max(t)
    if kind == "gpipe":
        return (m - 1) * (max(fp) + max(bp)) + sum(t)
    if kind == "zero_bubble":
        return ((m - 1) * max(t) + sum(t) - sum(c.bwd_weight_us) + c.bwd_weight_us[0])
    return (m - 1) * max(t) + sum(t)


def _paired_load_us(p: int, m: int, c: StageCosts, fp: Sequence[float],
                    bp: Sequence[float]) -> float:
    """The busiest rank's work in one DualPipe-V step whose pairs hide their all-to-alls
    (:meth:`StageCosts.pair_us`), µs: ``m (t_c0 + t_c1)`` (``t = fp + bp``: each stage's
    forward and backward with their sends) less what each of its pairs saves, rank ``r``
    running ``m - 2p + r + 1`` pairs (F of chunk 0, B of chunk 1), one fewer on the last
    rank, and ``m - p`` pairs (F of chunk 1, B of chunk 0)
    (:func:`autopart.core.v_schedules.dualpipev_pairs`)."""
    def saved(forward: int, backward: int) -> float:
        return max(fp[forward] + bp[backward] - c.pair_us(forward, backward), 0.0)

    loads = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        n01 = m - 2 * p + r + 1 - (r == p - 1)
        loads.append(m * (fp[c0] + bp[c0] + fp[c1] + bp[c1])
                     - n01 * saved(c0, c1) - (m - p) * saved(c1, c0))
    return max(loads)


def busy_us(c: StageCosts, num_ranks: int, num_microbatches: int,
            training: bool = True, rank_of: Sequence[int] | None = None) -> list[float]:
    """Per rank, compute + send time of one step, µs (``rank_of``: stage -> rank, default
    ``s % p``)."""
    per = [c.fwd_us[s] + c.send_fwd_us[s]
           + ((c.bwd_input_us[s] + c.bwd_weight_us[s] + c.send_bwd_us[s]) if training else 0.0)
           for s in range(len(c.fwd_us))]
    owner = rank_of or [s % num_ranks for s in range(len(per))]
    busy = [0.0] * num_ranks
    for s, x in enumerate(per):  # in stage order, as a sum per rank adds them
        busy[owner[s]] += x
    return [num_microbatches * b for b in busy]


def closed_form_peaks(c: StageCosts, in_flight_per_stage: Sequence[int],
                      num_ranks: int, rank_of: Sequence[int] | None = None) -> list[int]:
    """Per rank: static + sum over its stages of in-flight x saved, + the largest backward
    extra (``rank_of``: stage -> rank, default ``s % p``)."""
    owner = rank_of or [s % num_ranks for s in range(len(c.fwd_us))]
    stages_of: list[list[int]] = [[] for _ in range(num_ranks)]
    for s, r in enumerate(owner):  # one pass over the stages, not one per rank
        stages_of[r].append(s)
    return [sum(c.static_bytes[s] + in_flight_per_stage[s] * c.saved_bytes[s] for s in stages)
            + max(c.backward_extra_bytes[s] for s in stages) for stages in stages_of]
