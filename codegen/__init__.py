"""Codegen: split a captured graph at a plan's cuts into stage modules that own their
parameters (tied ones replicated), emit their source, and fuse them on request."""

from autopart.codegen.stages import BuiltStages, build_stages, check_plan_matches, stage_source

__all__ = ["build_stages", "BuiltStages", "check_plan_matches", "stage_source"]
