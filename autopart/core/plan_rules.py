"""The plan file's vocabulary: its schema versions, schedule kinds, optimisation targets and
shard styles (the invariants across a plan's fields are :func:`autopart.core.plan.check_plan_invariants`)."""

from __future__ import annotations

__all__ = ["PLAN_SCHEMA_VERSION", "READABLE_SCHEMA_VERSIONS", "SHARD_STYLES", "SCHEDULE_KINDS",
           "OPTIMIZE_TARGETS", "CP_ATTENTIONS", "FIX"]

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
