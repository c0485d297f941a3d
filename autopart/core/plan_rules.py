"""What a valid plan is: the plan file's vocabulary and the invariants across its fields."""

from __future__ import annotations

import reprlib
from typing import TYPE_CHECKING

from autopart.core.errors import PlanError
from autopart.core.layout import layout_problem
from autopart.core.schedule import check_microbatches, stage_ranks
from autopart.core.v_schedules import V_SCHEDULE_KINDS

if TYPE_CHECKING:
    from autopart.core.plan import Plan

__all__ = ["PLAN_SCHEMA_VERSION", "READABLE_SCHEMA_VERSIONS", "SHARD_STYLES", "SCHEDULE_KINDS",
           "OPTIMIZE_TARGETS", "FIX", "check_plan_invariants"]

#: 2 added tp, dp, zero_stage, sharded_parameters and model_flops (3D plans).
PLAN_SCHEMA_VERSION = 2
#: Versions :meth:`Plan.load` reads; a version 1 plan loads as tp = dp = 1, no ZeRO.
READABLE_SCHEMA_VERSIONS = (1, 2)
#: How tensor parallelism splits a parameter: by output feature, input feature, vocabulary row.
SHARD_STYLES = ("column", "row", "vocab")
SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
OPTIMIZE_TARGETS = ("speed", "memory")
#: The fix every field error ends with.
FIX = "correct the field, or re-plan with `autopart plan` / autopart.compile"


def check_plan_invariants(plan: Plan) -> None:
    """The cross-field invariants the runtimes rely on: a readable schema, a consistent
    (tp, dp, ZeRO) layout, known kinds, m dividing the batch per replica, stages placed as
    the schedule kind places them (:func:`autopart.core.schedule.stage_ranks`), S - 1
    ascending cuts, a bubble fraction in [0, 1].

    Raises:
        PlanError: ``"invalid plan: ..."`` naming the field, its value and the fix.
    """
    def bad(msg: str) -> PlanError:
        return PlanError(f"invalid plan: {msg}")

    if plan.schema_version not in READABLE_SCHEMA_VERSIONS:
        raise bad(f"schema_version {plan.schema_version} is not supported (this autopart "
                  f"reads {READABLE_SCHEMA_VERSIONS}); re-plan with this version")
    problem = layout_problem(plan.tp, plan.dp, plan.zero_stage, plan.schema_version,
                             [p.name for p in plan.sharded_parameters])
    if problem:
        raise bad(problem)
    for name in ("graph_fingerprint", "cluster_fingerprint", "cost_source"):
        if not getattr(plan, name).strip():
            raise bad(f"{name} is empty; a plan names what it was made for: {FIX}")
    if plan.optimize not in OPTIMIZE_TARGETS:
        raise bad(f"optimize={plan.optimize!r}; expected one of {OPTIMIZE_TARGETS}")
    if plan.schedule_kind not in SCHEDULE_KINDS:
        raise bad(f"schedule_kind={plan.schedule_kind!r}; expected one of {SCHEDULE_KINDS}")
    m, batch, v, p = plan.num_microbatches, plan.batch_size, plan.stages_per_rank, len(plan.ranks)
    if batch < 1 or m < 1 or batch % m:
        raise bad(f"num_microbatches={m} must be >= 1 and divide batch_size={batch}; "
                  "choose a divisor of the batch")
    if batch % (m * plan.dp):
        raise bad(f"num_microbatches={m} x dp={plan.dp} must divide batch_size={batch} (the "
                  "global batch); choose m dividing the batch per replica")
    kind = plan.schedule_kind
    if kind in V_SCHEDULE_KINDS and v != 2:
        raise bad(f"stages_per_rank={v} with schedule_kind={kind!r}: the V schedules run "
                  "exactly 2 stages per rank; set stages_per_rank to 2")
    if v < 1 or (v > 1 and kind not in ("interleaved_1f1b", *V_SCHEDULE_KINDS)):
        raise bad(f"stages_per_rank={v} with schedule_kind={kind!r}: only "
                  "'interleaved_1f1b' and the V schedules (v = 2) run more than one stage per "
                  "rank (v >= 1); set stages_per_rank to 1 or the schedule to "
                  "'interleaved_1f1b'")
    if p < 1 or len(plan.stages) != p * v:
        raise bad(f"{len(plan.stages)} stages on {p} ranks with stages_per_rank={v}; the "
                  f"number of stages must be ranks x stages_per_rank = {p * v}")
    try:
        check_microbatches(kind, p, m)
    except PlanError as exc:
        raise bad(str(exc)) from None
    num_stages = len(plan.stages)
    rank_of = stage_ranks(kind, p, v)
    how = "in a V: rank r runs stages r and 2p - 1 - r" if kind in V_SCHEDULE_KINDS \
        else f"stage s on rank s % {p}"
    for r, rank in enumerate(plan.ranks):
        want = tuple(s for s in range(num_stages) if rank_of[s] == r)
        if rank.rank != r or rank.stage_indices != want:
            raise bad(f"ranks[{r}] has rank={rank.rank}, stage_indices={list(rank.stage_indices)}; "
                      f"rank {r} of {p} runs stages {list(want)} ({kind}: {how})")
    for i, st in enumerate(plan.stages):
        if st.stage_index != i:
            raise bad(f"stages[{i}] has stage_index {st.stage_index}; stages are listed in "
                      f"order 0..{num_stages - 1}")
        if st.rank != rank_of[i]:
            raise bad(f"stage {i} is on rank {st.rank}, but the plan has {p} ranks and "
                      f"{kind} places it on rank {rank_of[i]} ({how})")
        if st.device != plan.ranks[st.rank].device:
            raise bad(f"stage {i} names device {st.device!r}, its rank {st.rank} names "
                      f"{plan.ranks[st.rank].device!r}; make them agree")
    if len(plan.cuts) != num_stages - 1:
        raise bad(f"{num_stages} stages but {len(plan.cuts)} cuts; S stages need S - 1 cuts")
    positions = [c.position for c in plan.cuts]
    ascending = all(a < b for a, b in zip(positions, positions[1:], strict=False))
    if not ascending or any(q < 1 for q in positions):
        raise bad(f"cut positions {reprlib.repr(positions)} must be >= 1 and strictly ascending")
    for i, cut in enumerate(plan.cuts):
        if not cut.after_node or not cut.before_node:
            raise bad(f"cuts[{i}] names no node on one side ({cut.after_node!r} | "
                      f"{cut.before_node!r}); {FIX}")
    if not 0.0 <= plan.bubble_fraction <= 1.0:
        raise bad(f"bubble_fraction={plan.bubble_fraction} is outside [0, 1]")
