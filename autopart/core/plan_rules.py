"""The plan file's vocabulary: its schema versions, schedule kinds, optimisation targets and
shard styles (the invariants across a plan's fields are :func:`autopart.core.plan.check_plan_invariants`)."""

from __future__ import annotations

__all__ = ["PLAN_SCHEMA_VERSION", "READABLE_SCHEMA_VERSIONS", "SHARD_STYLES", "SCHEDULE_KINDS",
           "OPTIMIZE_TARGETS", "CP_ATTENTIONS", "FIX", "overlaps_expert_exchanges"]

#: 2 added tp, dp, zero_stage, sharded_parameters and model_flops (3D plans).
PLAN_SCHEMA_VERSION = 2
#: Versions :meth:`Plan.load` reads; a version 1 plan loads as tp = dp = 1, no ZeRO.
READABLE_SCHEMA_VERSIONS = (1, 2)
#: How tensor parallelism splits a parameter: by output feature, input feature, vocabulary row.
SHARD_STYLES = ("column", "row", "vocab")
SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
OPTIMIZE_TARGETS = ("speed", "memory")
#: How context parallelism computes attention over the whole sequence (``Plan.cp_attention``):
#: keys and values all-gathered over the cp ranks (Llama 3's form), or Ulysses' all-to-alls
#: swapping sequence sharding for head sharding (DeepSpeed-Ulysses, Jacobs et al., 2023).
CP_ATTENTIONS = ("all_gather", "ulysses")
#: The fix every field error ends with.
FIX = "correct the field, or re-plan with `autopart plan` / autopart.compile"


def overlaps_expert_exchanges(schedule_kind: str, ep: int, tp: int = 1, cp: int = 1,
                              zero_stage: int = 0) -> bool:
    """Whether the distributed runtime runs each DualPipe-V forward-backward pair
    (:func:`autopart.core.v_schedules.dualpipev_pairs`) as two threads, so that the dispatch
    and combine all-to-alls of one run under the other's compute (DeepSeek-V3 report,
    arXiv 2412.19437, section 3.2.1; torchtitan's DualPipe-V with expert parallelism), and the
    solver prices the pair so: ``dualpipev`` with ``ep > 1``, and no other collective inside
    the stages' actions whose order two threads could swap between ranks (tp's and cp's, and
    ZeRO-2/3's gathers and reduce-scatters per microbatch): ``tp == cp == 1`` and
    ``zero_stage <= 1``. The two chunks' all-to-alls run on an ep group each. CPU ranks
    run the pairs one after the other all the same unless told otherwise
    (``DistributedPipeline.overlap_pairs``: measured slower there), and the solver prices
    them so (``autopart.solver.layout_search.hides_expert_exchanges``).
    """
    return (schedule_kind == "dualpipev" and ep > 1 and tp == 1 and cp == 1
            and zero_stage <= 1)
