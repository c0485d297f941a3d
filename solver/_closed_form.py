"""Closed forms per schedule kind: in-flight microbatches, objective weights and step time."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from autopart.core.schedule import build_schedule, in_flight_counts
from autopart.solver.simulate import StageCosts

__all__ = ["in_flight", "objective_weights", "closed_form_step_us"]


@functools.lru_cache(maxsize=256)
def in_flight(kind: str, num_ranks: int, num_microbatches: int, stages_per_rank: int,
              training: bool = True) -> tuple[int, ...]:
    """Per stage, the most microbatches whose saved activations it holds at once.

    GPipe holds all ``m``; 1F1B and ZB-H1 (as built by :mod:`autopart.core.schedule`) hold
    ``min(p - s, m)`` on stage s (Narayanan et al. 2021; Qi et al. 2023, H1 keeps 1F1B's
    memory); interleaved 1F1B is counted on its action lists with
    :func:`autopart.core.schedule.in_flight_counts`. Inference keeps nothing for a backward: 0.
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    if not training:
        return (0,) * (p * v)
    if kind == "gpipe":
        return (m,) * (p * v)
    if kind in ("1f1b", "zero_bubble"):
        return tuple(min(p - s, m) for s in range(p))
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
    balanced stages.
    """
    p, m = num_ranks, num_microbatches
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

    These agree with :func:`autopart.solver.simulate.simulate` within 2% for balanced stages
    and small sends (tested); the solver replays its final candidates with the simulator.
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    s_total = len(c.fwd_us)
    fp = [c.fwd_us[s] + c.send_fwd_us[s] for s in range(s_total)]
    if not training:
        if v > 1:
            loads = [sum(fp[r::p]) for r in range(p)]
            return m * max(loads) + (p - 1) * max(fp)
        return (m - 1) * max(fp) + sum(fp)
    bp = [c.bwd_input_us[s] + c.bwd_weight_us[s] + c.send_bwd_us[s] for s in range(s_total)]
    t = [a + b for a, b in zip(fp, bp, strict=True)]
    if kind == "interleaved_1f1b" and v > 1:
        loads = [sum(t[r::p]) for r in range(p)]
        return m * max(loads) + (p - 1) * max(t)
    if kind == "gpipe":
        return (m - 1) * (max(fp) + max(bp)) + sum(t)
    if kind == "zero_bubble":
        return ((m - 1) * max(t) + sum(t) - sum(c.bwd_weight_us) + c.bwd_weight_us[0])
    return (m - 1) * max(t) + sum(t)


def busy_us(c: StageCosts, num_ranks: int, num_microbatches: int,
            training: bool = True) -> list[float]:
    """Per rank, compute + send time of one step, µs."""
    per = [c.fwd_us[s] + c.send_fwd_us[s]
           + ((c.bwd_input_us[s] + c.bwd_weight_us[s] + c.send_bwd_us[s]) if training else 0.0)
           for s in range(len(c.fwd_us))]
    return [num_microbatches * sum(per[r::num_ranks]) for r in range(num_ranks)]


def closed_form_peaks(c: StageCosts, in_flight_per_stage: Sequence[int],
                      num_ranks: int) -> list[int]:
    """Per rank: static + sum over its stages of in-flight x saved, + the largest backward extra."""
    out = []
    for r in range(num_ranks):
        stages = range(r, len(c.fwd_us), num_ranks)
        out.append(sum(c.static_bytes[s] + in_flight_per_stage[s] * c.saved_bytes[s] for s in stages)
                   + max(c.backward_extra_bytes[s] for s in stages))
    return out
