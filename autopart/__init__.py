"""autopart: automatic pipeline partitioning for PyTorch models."""

from __future__ import annotations

from typing import Any

__all__ = ["compile", "plan_model", "load", "checkpoint_extra", "CompileOptions", "Profile",
           "Plan", "Pipeline", "PipelinedModule", "DistributedPipeline", "LazyPipeline",
           "AutopartError", "TraceError", "ProfileError", "PlanError", "InfeasiblePlanError",
           "CheckpointError", "PipelineFailure", "trace", "__version__"]
from autopart.core.version import __version__

# Exports resolve lazily (PEP 562) so that `import autopart.solver` or `autopart.core.plan`
# never pulls in torch: the solver layer stays pure Python.
_LAZY = {
    "compile": ("autopart.api", "compile"),
    "load": ("autopart.api", "load"),
    "checkpoint_extra": ("autopart.runtime.checkpoint.save_load", "checkpoint_extra"),
    "plan_model": ("autopart.planning", "plan_model"),
    "Profile": ("autopart.planning", "Profile"),
    "CompileOptions": ("autopart.options", "CompileOptions"),
    "Pipeline": ("autopart.runtime.pipeline", "Pipeline"),
    "LazyPipeline": ("autopart.lazy", "LazyPipeline"),
    "PipelinedModule": ("autopart.runtime.local.module", "PipelinedModule"),
    "DistributedPipeline": ("autopart.runtime.distributed.pipeline", "DistributedPipeline"),
    "Plan": ("autopart.core.plan", "Plan"),
    **{name: ("autopart.core.errors", name) for name in (
        "AutopartError", "TraceError", "ProfileError", "PlanError", "InfeasiblePlanError",
        "CheckpointError", "PipelineFailure")},
}


def __getattr__(name: str) -> Any:
    if name == "trace":  # a submodule: autopart.trace.save(...)
        import importlib

        submodule = importlib.import_module("autopart.trace")
        globals()[name] = submodule
        return submodule
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopart' has no attribute {name!r}")
