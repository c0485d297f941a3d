"""Codegen: split a captured graph at a plan's cuts into stage modules that own their
parameters (tied ones replicated), emit their source, and fuse them on request."""

from autopart.codegen.stages import (
    BuiltStages,
    build_stages,
    check_plan_matches,
    plan_for_graph,
    stage_source,
)
from autopart.codegen.tensor_parallel import shard_stage
from autopart.codegen.tp_layout import ShardLayout, TensorParallelRank

__all__ = ["build_stages", "BuiltStages", "check_plan_matches", "plan_for_graph", "stage_source",
           "ShardLayout",
           "TensorParallelRank", "shard_stage"]
